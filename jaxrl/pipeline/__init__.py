"""Forced-lag rollout pipeline: pure ring ops, the host gate, params handoff, rollout worker,
in-slot regeneration, staleness accounting and the keyed row store (data plane). See `gate.py`
for the lag contract and `data_plane.py` for the key/field/partition model."""

from jaxrl.pipeline import ring
from jaxrl.pipeline.data_plane import PARTITIONS, BatchMeta, DataPlane, balance_rows
from jaxrl.pipeline.gate import LagGate, PipelineClosed, StallError, WorkerFailed
from jaxrl.pipeline.handoff import ParamsHandoff, VersionUnavailable
from jaxrl.pipeline.regenerate import RegenerationCapError, fill_batch
from jaxrl.pipeline.staleness import staleness_metrics
from jaxrl.pipeline.worker import InlineWorker, RolloutWorker, params_version

__all__ = [
    "PARTITIONS", "BatchMeta", "DataPlane", "InlineWorker", "LagGate", "ParamsHandoff", "PipelineClosed",
    "RegenerationCapError", "RolloutWorker", "StallError", "VersionUnavailable", "WorkerFailed",
    "balance_rows", "fill_batch", "params_version", "ring", "staleness_metrics",
]
