"""Forced-lag rollout pipeline: pure ring ops, the host gate, params handoff, rollout worker,
in-slot regeneration and staleness accounting. See `gate.py` for the lag contract."""

from jaxrl.pipeline import ring
from jaxrl.pipeline.gate import LagGate, PipelineClosed, StallError, WorkerFailed
from jaxrl.pipeline.handoff import ParamsHandoff, VersionUnavailable
from jaxrl.pipeline.regenerate import RegenerationCapError, fill_batch
from jaxrl.pipeline.staleness import staleness_metrics
from jaxrl.pipeline.worker import RolloutWorker, params_version

__all__ = [
    "LagGate", "ParamsHandoff", "PipelineClosed", "RegenerationCapError", "RolloutWorker",
    "StallError", "VersionUnavailable", "WorkerFailed", "fill_batch", "params_version", "ring",
    "staleness_metrics",
]
