"""The forced-lag rollout pipeline: the lag pipeline object (`LagPipeline`: gate, params handoff,
rollout worker, publishing, checkpoint state), the rollout producer that makes its batches,
in-slot regeneration, dynamic sampling, staleness accounting and the keyed row store (the data
plane). See `gate.py` for the lag contract and `row_store.py` for the key/field/partition model."""

from jaxrl.pipeline.batch_meta import PARTITIONS, BatchMeta, balance_rows
from jaxrl.pipeline.row_store import DataPlane
from jaxrl.pipeline.gate import LagGate, PipelineClosed, StallError, WorkerFailed
from jaxrl.pipeline.handoff import ParamsHandoff, VersionUnavailable
from jaxrl.pipeline.lag import LagPipeline
from jaxrl.pipeline.regenerate import RegenerationCapError, fill_batch
from jaxrl.pipeline.staleness import row_versions, staleness_from_rows
from jaxrl.pipeline.worker import InlineWorker, RolloutWorker, params_version

__all__ = [
    "PARTITIONS", "BatchMeta", "DataPlane", "InlineWorker", "LagGate", "LagPipeline",
    "ParamsHandoff", "PipelineClosed", "RegenerationCapError", "RolloutWorker", "StallError",
    "VersionUnavailable", "WorkerFailed", "balance_rows", "fill_batch", "params_version",
    "row_versions", "staleness_from_rows",
]
