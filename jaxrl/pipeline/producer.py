"""The rollout side of RL, run by the lag pipeline's worker: sample, score, filter, store.

`RolloutProducer.produce(batch_id, params, version)` makes one training batch of P whole groups.
Its rows go into partition `train` of the data plane, keyed once here; what crosses the lag ring is
the batch's item (`RingItem`: metadata, versions, timings and per-batch counters). Group ids come
from one counter, so no two groups of a run share an id (the pending cache of dynamic sampling
mixes generations). Only the worker calls `produce`, one batch after another, so the prompt stream
does not depend on timing.

The producer is also the ring's codec for checkpoints: `encode` turns a delivered item into device
arrays and JSON, `target` gives the arrays' shapes to restore into, `decode` puts them back.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl import checkpoint
from jaxrl import metrics as metrics_lib
from jaxrl import parallel
from jaxrl.loop_state import from_json_num, json_num
from jaxrl.pipeline import dynamic_sampling
from jaxrl.pipeline.data_plane import BatchMeta, balance_rows
from jaxrl.pipeline.regenerate import fill_batch
from jaxrl.pipeline.staleness import row_versions
from jaxrl.rollout.multi_turn import Episodes
from jaxrl.types import TrainBatch

# Per-row outcomes of `Episodes` kept as host tags of a batch's metadata, not device fields.
HOST_ROWS = ("turns", "terminated", "truncated", "failed")
# Rollout reward tags -> the `Episodes` field holding them.
_REWARD_ARRAY = {"reward": "rewards"}


def train_fields(cfg) -> tuple[str, ...]:
  """The data-plane fields the train step reads (`TrainBatch` in field order)."""
  return tuple(f for f in TrainBatch._fields if f != "rollout_logprobs" or cfg.rollout.logprobs)


@dataclasses.dataclass(frozen=True)
class RingItem:
  """What crosses the lag ring for one batch: its rows' metadata (the arrays stay in the data
  plane), the params version it was sampled with, its sampling time, its metrics (`info`: env
  calls, failures, dynamic sampling, reward components) and what the pipeline adds to its
  cumulative counters when it is delivered (`counts`: groups regenerated and filtered)."""
  meta: BatchMeta
  submit_version: int
  sample_time_s: float
  info: dict
  counts: dict = dataclasses.field(default_factory=dict)


class RolloutProducer:
  """Makes the training batches of a run (see the module docstring).

  `parts` is the run's `Parts`, `loop` the training multi-turn loop.
  """

  def __init__(self, parts, loop):
    cfg = parts.cfg
    self.parts, self.loop = parts, loop
    self.r, self.ds = cfg.rollout, cfg.dynamic_sampling
    self.fields = train_fields(cfg) + ("policy_version",)  # what a checkpoint keeps of a batch
    self.rng = np.random.default_rng([cfg.seed, 2])
    self.key = jax.random.key(cfg.seed)
    self.next_group = 0

  # ---- checkpoint state ----------------------------------------------------------------------

  def state_dict(self) -> dict:
    return {"rng": checkpoint.numpy_rng_state(self.rng), "next_group": self.next_group}

  def load_state_dict(self, host: dict) -> None:
    self.rng = checkpoint.restore_numpy_rng(host["rng"])
    self.next_group = host["next_group"]

  def encode(self, item: RingItem) -> tuple[dict, dict]:
    """A delivered batch as (device arrays by field, JSON)."""
    got = self.parts.data.get(item.meta, self.fields)
    return got, {"meta": item.meta.to_json(), "submit_version": item.submit_version,
                 "sample_time_s": item.sample_time_s,
                 "info": {k: json_num(v) for k, v in item.info.items()},
                 "shapes": {f: [list(a.shape), a.dtype.str] for f, a in got.items()}}

  def target(self, host: dict) -> dict:
    """The abstract arrays (shape, dtype, sharding) to restore an encoded batch into."""
    rows = parallel.batch_sharding(self.parts.mesh)
    return {f: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=rows)
            for f, (shape, dtype) in host["shapes"].items()}

  def decode(self, arrays: dict, host: dict) -> RingItem:
    """Puts a checkpointed batch back in the data plane; returns its ring item."""
    meta = self.parts.data.put(BatchMeta.from_json(host["meta"]), arrays)
    return RingItem(meta, host["submit_version"], host["sample_time_s"],
                    {k: from_json_num(v) for k, v in host["info"].items()})

  # ---- producing -----------------------------------------------------------------------------

  def _sample(self, params, tasks, key, request_base: int, version: int, info: dict,
              sums: dict) -> Episodes:
    """Episodes of G samples for each of `tasks`, rows in group order; counts what it cost."""
    r = self.r
    ep = self.loop.run(params, tasks, key, request_base, version, r.temperature, r.top_k,
                       r.top_p)
    info["env/calls"] = info.get("env/calls", 0) + ep.env_calls
    for kind, n in ep.fail_counts().items():
      info[f"env/failed/{kind}"] = info.get(f"env/failed/{kind}", 0) + n
    for prefix, named in (("reward/", ep.components), ("env/metadata/", ep.metadata)):
      for name, v in named.items():
        s = sums.setdefault(prefix + name, [0.0, 0])
        s[0] += float(np.nansum(v))
        s[1] += int(np.isfinite(v).sum())
    return ep

  def _store(self, prefix: str, ep: Episodes, place: bool) -> BatchMeta:
    """Mints keys for the rows of `ep`, puts them in the data plane; returns their metadata.

    Device fields are the train step's (`TrainBatch`) plus the tokens' version stamps; per-row
    outcomes, the raw reward and version summaries are host tags of the metadata. With `place`,
    rows are first put in length-balanced data-shard order (so the trainer's read is the stored
    arrays themselves); otherwise in generation order. The raw reward (NaN for a failed row) is
    the tag dynamic sampling and metrics read; the device field has 0 there (the row is out of
    the loss and the advantages anyway: its loss mask is empty).
    """
    dp, G = self.parts.data, self.r.group_size
    n = len(ep.rewards)
    groups = self.next_group + np.arange(n // G)
    self.next_group += n // G
    versions = row_versions(ep.policy_version, ep.mask)
    meta = BatchMeta.mint(
        "train", prefix, group_ids=np.repeat(groups, G), lengths=ep.mask.sum(1),
        versions=np.nan_to_num(versions["first"]).astype(np.int64),
        tags={"reward": ep.rewards,
              **{k: getattr(ep, k).astype(np.float32) for k in HOST_ROWS},
              **{f"version/{k}": v for k, v in versions.items()}})
    batch = TrainBatch(
        prompt_tokens=ep.prompt_tokens, prompt_valid=ep.prompt_valid, tokens=ep.tokens,
        mask=ep.mask, rollout_logprobs=ep.logprobs if self.r.logprobs else None,
        rewards=np.nan_to_num(ep.rewards, nan=0.0).astype(np.float32),
        group_id=np.repeat(groups, G).astype(np.int32),
        temperature=np.full(n, self.r.temperature, np.float32), completion_valid=ep.valid)
    arrays = {k: v for k, v in batch._asdict().items() if v is not None}
    arrays["policy_version"] = ep.policy_version
    if place:
      perm, _ = balance_rows(meta.lengths, dp.num_row_shards())
      meta = meta.subset(perm)
      arrays = {k: v[perm] for k, v in arrays.items()}
    return dp.put(meta, arrays)

  def produce(self, batch_id: int, params, version: int) -> RingItem:
    """One training batch (P whole groups) with params `version`."""
    st = metrics_lib.Timer()
    r, ds, P, G = self.r, self.ds, self.r.num_prompts, self.r.group_size
    step = batch_id + 1
    key = jax.random.fold_in(self.key, step)
    source = self.parts.source
    tasks = source.sample(self.rng, P)
    info: dict = {}
    sums: dict = {}
    counts = {"regenerated": 0, "filtered": 0}
    if ds.enabled and r.lag == 0:
      # Synchronous: whole generation batches into a pending cache until P groups are ready.
      def generate(attempt):
        batch = tasks if attempt == 1 else source.sample(self.rng, P)
        k = key if attempt == 1 else jax.random.fold_in(key, attempt)
        ep = self._sample(params, batch, k, step * P * G, version, info, sums)
        return self._store(f"b{batch_id}/g{attempt}", ep, place=False)

      meta, ds_info = dynamic_sampling.fill_from_generations(
          generate, num_groups=P, max_gen_batches=ds.max_gen_batches, tol=ds.tol,
          reward_field=ds.reward_field, discard=self.parts.data.discard)
      info.update(ds_info)
      perm, _ = balance_rows(meta.lengths, self.parts.data.num_row_shards())
      meta = meta.subset(perm)
      counts["filtered"] = info["dynamic_sampling/dropped_groups"]
    else:
      # One generation; a filtered group is re-sampled into its own slot (lag > 0 dynamic
      # sampling, or a group whose every episode failed).
      seen = []

      def sample(slots, attempt):
        k = key
        if attempt:
          for s in slots:
            tasks[s] = source.sample(self.rng, 1)[0]
          k = jax.random.fold_in(key, attempt)
        ep = self._sample(params, tasks, k, step * P * G, version, info, sums)
        return [ep.select(slice(s * G, (s + 1) * G)) for s in slots]

      def keep(group: Episodes) -> bool:
        seen.append(group.rewards)
        if ds.enabled:
          return dynamic_sampling.keep_group(getattr(group, _REWARD_ARRAY[ds.reward_field]),
                                             ds.tol)
        return bool(np.any(np.isfinite(group.rewards)))

      cap = dict(max_regenerations=r.max_regenerations)
      if ds.enabled:
        cap = dict(max_regenerations=ds.max_gen_batches - 1,
                   cap_name="dynamic_sampling.max_gen_batches", cap_value=ds.max_gen_batches)
      groups, got = fill_batch(batch_id, P, sample, keep, **cap)
      counts = {name: got[name] for name in ("regenerated", "filtered")}
      ep = Episodes.concat(groups)
      meta = self._store(f"b{batch_id}", ep, place=True)
      if ds.enabled:  # regeneration never over-generates: nothing valid is discarded
        info.update(dynamic_sampling.batch_metrics(
            np.concatenate(seen), ep.rewards, attempts=got["attempts"],
            dropped=got["filtered"], discarded=0))
    # Reward components and numeric env metadata: means over the rows generated for the batch.
    info.update({k: s / n if n else float("nan") for k, (s, n) in sums.items()})
    return RingItem(meta, version, st(), info, counts)
