"""The rollout side of RL, run by the lag pipeline's worker: sample, score, filter, store.

`RolloutProducer.produce(batch_id, params, version)` makes one training batch of P whole groups.
Its rows go into partition `train` of the data plane, keyed once here; what crosses the lag ring is
the batch's item (`RingItem`: metadata, versions, timings and per-batch counters). Group ids come
from one counter, so no two groups of a run share an id (the pending cache of dynamic sampling
mixes generations). Only the worker calls `produce`, one batch after another, so the prompt stream
does not depend on timing.

The producer is also the ring's codec for checkpoints: `encode` turns a delivered item into device
arrays and JSON, `target` gives the arrays' shapes to restore into, `decode` puts them back.

Several processes (`ProcessShare`, from `process_share`): each process's worker makes only its
share of every batch, the groups whose rows its devices hold in the train mesh (groups never span
processes), on a process-local rollout mesh, so the worker thread launches no program that
involves another process. Every process draws the same P prompts from the same stream and keeps
its slice; request ids (hence sampling keys) and group ids are the ones a one-process run gives
those rows, so the rows get the same tokens. Its item carries the rows on the host
(`LocalRows`); `globalize`, run by the trainer thread in batch order on every process, gathers
the metadata of every process's rows and assembles the global train batch
(`jax.make_array_from_process_local_data` over the train mesh's row sharding).

`ProcessShare.publish` makes each process's copy of a params version in the samplers' dtype
(`rollout.dtype`, `jaxrl.rollout.precision`): a narrower dtype is cast on the train mesh before
the gather, so each process receives half the bytes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.runtime import checkpoint
from jaxrl.runtime.checkpoint import from_json_num, json_num
from jaxrl import config as config_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl import parallel
from jaxrl.envs.agent_task import is_agent
from jaxrl.core.names import lag_bound
from jaxrl.pipeline import dynamic_sampling
from jaxrl.pipeline.batch_meta import BatchMeta, balance_rows
from jaxrl.pipeline.regenerate import fill_batch
from jaxrl.pipeline.staleness import row_versions
from jaxrl.rollout.multi_turn import Episodes
from jaxrl.rollout.precision import moved_copy, rollout_dtype
from jaxrl.core.types import TrainBatch

# Per-row outcomes of `Episodes` kept as host tags of a batch's metadata, not device fields.
HOST_ROWS = ("turns", "terminated", "truncated", "failed")
# Rollout reward tags -> the `Episodes` field holding them.
_REWARD_ARRAY = {"reward": "rewards"}


def train_fields(cfg, model_cfg=None) -> tuple[str, ...]:
  """The data-plane fields the train step reads (`TrainBatch` in field order): the sampler's
  log-probs when kept, its experts for a mixture-of-experts model (`model_cfg`, the run's
  `ModelConfig`; None: `cfg.model`'s keys), the tokens' causal sequences for an agent task."""
  drop = {"rollout_logprobs"} if not cfg.rollout.logprobs else set()
  if not (model_cfg or cfg.model).num_experts:
    drop.add("routing")
  if not is_agent(cfg.task.name):  # only an agent's episodes hold several causal sequences
    drop.add("completion_segment")
  return tuple(f for f in TrainBatch._fields if f not in drop)


@dataclasses.dataclass(frozen=True)
class ProcessShare:
  """What this process makes of every training batch on several processes (see the module
  docstring): groups [first_group, first_group + num_groups) of the batch's P, which are rows
  [first_group * G, ...) of the train mesh's row sharding, held by `row_shards` of its shards;
  `starts[q]` is process q's first row (the order the gathered rows are joined in). Rollouts run
  on `mesh`, this process's own devices; params reach it through `publish` (trainer thread)."""
  process: int
  first_group: int
  num_groups: int
  row_shards: int
  starts: tuple[int, ...]
  train_mesh: Mesh
  mesh: Mesh
  dtype: str | None = None  # the samplers' dtype (`rollout.dtype`); None: the trainer's

  def publish(self, params):
    """A copy of the train params on this process's rollout mesh, in `dtype`: a global program,
    so the trainer thread calls it at the same point on every process. A narrower dtype is cast
    before the gather (a global program too: half the bytes gathered), a wider one after it, on
    this process's devices."""
    return moved_copy(params, self.dtype, lambda p: parallel.distributed.publish_local(
        p, self.train_mesh, self.mesh))


def process_share(parts) -> ProcessShare | None:
  """This process's share of every batch, or None where rollouts cannot be split by process
  (`split_by_process`).

  Raises:
    ConfigError: on several processes with `rollout.engine = 'continuous'` when the batch cannot
      be split (the config check refuses the cases it can decide; this is the device layout's):
      the engine's host driver cannot run inline over every process's devices.
  """
  share = split_by_process(parts)
  if share is None and jax.process_count() > 1 and parts.cfg.mesh.rollout_tensor > 1:
    raise config_lib.ConfigError([
        f"{config_lib.PREFIX}mesh.rollout_tensor: must be 1 when a batch cannot be split by "
        "process (train-mesh row shards that do not give each process whole groups of its own, "
        "e.g. a 'tensor' axis spanning processes): the batch is then generated inline on the "
        "train mesh, not on each process's own rollout mesh"])
  if share is None and jax.process_count() > 1 and parts.cfg.rollout.engine == "continuous":
    raise config_lib.ConfigError([
        f"{config_lib.PREFIX}rollout.engine: must be 'static' with {jax.process_count()} "
        "processes when a batch cannot be split by process (a disaggregated rollout mesh, or "
        "train-mesh row shards that do not give each process whole groups of its own, e.g. a "
        "'tensor' axis spanning processes): the batch is then generated inline over every "
        "process's devices, and the continuous engine's host driver reads every slot's state, "
        "which no process holds alone"])
  return share


def split_by_process(parts) -> ProcessShare | None:
  """This process's share of every batch, or None where rollouts cannot be split by process:
  one process; a disaggregated rollout mesh; or a train mesh whose row shards do not give each
  process one run of whole groups of its own (e.g. rows replicated over a 'tensor' axis that spans
  processes). None means the worker makes whole batches inline, on the trainer thread
  (`InlineWorker`). Dynamic sampling splits too: a group never spans processes, so each process
  filters and regenerates its own groups (`RolloutProducer.produce`)."""
  if jax.process_count() == 1 or parts.rollout_mesh is not parts.mesh:
    return None
  G = parts.cfg.rollout.group_size
  n = parts.cfg.rollout.num_prompts * G
  boxes: dict[int, set] = {}
  for dev, idx in parallel.batch_sharding(parts.mesh).devices_indices_map((n,)).items():
    boxes.setdefault(dev.process_index, set()).add(idx[0].indices(n)[:2])
  spans = {}
  for q, got in boxes.items():
    merged: list[list[int]] = []
    for a, b in sorted(got):
      if merged and merged[-1][1] == a:
        merged[-1][1] = b
      elif not (merged and merged[-1] == [a, b]):
        merged.append([a, b])
    if len(merged) != 1 or merged[0][0] % G or merged[0][1] % G:
      return None
    spans[q] = tuple(merged[0])
  ordered = sorted(spans.values())
  if ordered[0][0] != 0 or ordered[-1][1] != n or \
      any(x[1] != y[0] for x, y in zip(ordered, ordered[1:])):
    return None
  me = jax.process_index()
  a, b = spans[me]
  return ProcessShare(me, a // G, (b - a) // G, len(boxes[me]),
                      tuple(spans[q][0] for q in range(jax.process_count())), parts.mesh,
                      parallel.distributed.local_mesh(parts.mesh,
                                                      parts.cfg.mesh.rollout_tensor),
                      rollout_dtype(parts.cfg))


@dataclasses.dataclass(frozen=True)
class LocalRows:
  """This process's rows of a batch before `globalize`: host arrays by data-plane field (in its
  length-balanced order), the reward-component sums behind the batch's means, and its counters."""
  arrays: dict
  sums: dict
  counts: dict


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
  local: LocalRows | None = None  # several processes: `meta` is this process's rows only


class RolloutProducer:
  """Makes the training batches of a run (see the module docstring).

  `parts` is the run's `Parts`, `loop` the training multi-turn loop.
  """

  def __init__(self, parts, loop, share: ProcessShare | None = None):
    cfg = parts.cfg
    self.parts, self.loop, self.share = parts, loop, share
    self.r, self.ds = cfg.rollout, cfg.dynamic_sampling
    # What a checkpoint keeps of a batch.
    self.fields = train_fields(cfg, getattr(parts, "model_cfg", None)) + ("policy_version",)
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
    dp, G, share = self.parts.data, self.r.group_size, self.share
    n = len(ep.rewards)
    first = 0 if share is None else share.first_group
    groups = self.next_group + first + np.arange(n // G)
    self.next_group += n // G if share is None else self.r.num_prompts
    versions = row_versions(ep.policy_version, ep.mask)
    meta = BatchMeta(
        "train", tuple(f"{prefix}/{first * G + i}" for i in range(n)),
        group_ids=np.repeat(groups, G), lengths=ep.mask.sum(1),
        versions=np.nan_to_num(versions["first"]).astype(np.int64),
        tags={"reward": ep.rewards,
              **{k: getattr(ep, k).astype(np.float32) for k in HOST_ROWS},
              **{f"version/{k}": v for k, v in versions.items()}})
    batch = TrainBatch(
        prompt_tokens=ep.prompt_tokens, prompt_valid=ep.prompt_valid, tokens=ep.tokens,
        mask=ep.mask, rollout_logprobs=ep.logprobs if self.r.logprobs else None,
        rewards=np.nan_to_num(ep.rewards, nan=0.0).astype(np.float32),
        group_id=np.repeat(groups, G).astype(np.int32),
        temperature=np.full(n, self.r.temperature, np.float32), completion_valid=ep.valid,
        routing=ep.routing, completion_segment=ep.segment)
    arrays = {k: v for k, v in batch._asdict().items() if v is not None}
    arrays["policy_version"] = ep.policy_version
    if place:
      perm = self.placement(meta, dp.num_row_shards() if share is None else share.row_shards)
      meta = meta.subset(perm)
      arrays = {k: v[perm] for k, v in arrays.items()}
    if share is not None:
      return meta, arrays  # placed by `globalize`, on the trainer thread
    return dp.put(meta, arrays)

  def placement(self, meta: BatchMeta, shards: int) -> np.ndarray:
    """The row order a batch is stored in over `shards` data shards: length-balanced rows; with
    `train.share_prompts` (the step runs each group's prompt once and needs its G rows next to
    each other) whole groups balanced by their tokens, or, where the shards do not split the
    groups evenly, the groups as generated."""
    G = self.r.group_size
    if not config_lib.shared_prompts(self.parts.cfg):
      return balance_rows(meta.lengths, shards)[0]
    n = len(meta)
    ids = meta.group_ids.reshape(n // G, G) if n % G == 0 else None
    if ids is None or not (ids == ids[:, :1]).all():
      return balance_rows(meta.lengths, shards)[0]  # not in whole groups: nothing to keep
    if (n // G) % shards:
      return np.arange(n)
    by_group, _ = balance_rows(meta.lengths.reshape(n // G, G).sum(1), shards)
    return (by_group[:, None] * G + np.arange(G)).reshape(-1)

  def produce(self, batch_id: int, params, version: int) -> RingItem:
    """One training batch (P whole groups) with params `version`."""
    st = metrics_lib.Timer()
    r, ds, P, G = self.r, self.ds, self.r.num_prompts, self.r.group_size
    step = batch_id + 1
    key = jax.random.fold_in(self.key, step)
    source = self.parts.source
    tasks = source.sample(self.rng, P)
    # Request ids of row p*G + g of the whole batch: step*P*G + p*G + g on any process layout.
    request_base, regen_rng = step * P * G, self.rng
    share = self.share
    if share is not None:
      # The same P prompts on every process (one stream); this process keeps its groups. Groups
      # regenerated here draw from a stream of this batch and process: the main stream must stay
      # the same on every process.
      tasks = tasks[share.first_group:share.first_group + share.num_groups]
      request_base += share.first_group * G
      regen_rng = np.random.default_rng([self.parts.cfg.seed, 3, batch_id, share.process])
      P = share.num_groups
    info: dict = {}
    sums: dict = {}
    counts = {"regenerated": 0, "filtered": 0}
    if ds.enabled and lag_bound(r) == 0 and share is None:
      # Synchronous: whole generation batches into a pending cache until P groups are ready.
      # (Several processes fill their own groups slot by slot, as at lag > 0, below: a pending
      # cache of whole generation batches would draw every process's prompts from one stream.)
      def generate(attempt):
        batch = tasks if attempt == 1 else source.sample(self.rng, P)
        k = key if attempt == 1 else jax.random.fold_in(key, attempt)
        ep = self._sample(params, batch, k, step * P * G, version, info, sums)
        return self._store(f"b{batch_id}/g{attempt}", ep, place=False)

      meta, ds_info = dynamic_sampling.fill_from_generations(
          generate, num_groups=P, max_gen_batches=ds.max_gen_batches, tol=ds.tol,
          reward_field=ds.reward_field, discard=self.parts.data.discard)
      info.update(ds_info)
      meta = meta.subset(self.placement(meta, self.parts.data.num_row_shards()))
      counts["filtered"] = info["dynamic_sampling/dropped_groups"]
    else:
      # One generation; a filtered group is re-sampled into its own slot (lag > 0 dynamic
      # sampling, or a group whose every episode failed).
      seen = []

      def sample(slots, attempt):
        k = key
        if attempt:
          for s in slots:
            tasks[s] = source.sample(regen_rng, 1)[0]
          k = jax.random.fold_in(key, attempt)
        ep = self._sample(params, tasks, k, request_base, version, info, sums)
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
      if share is not None:
        meta, arrays = meta
        if ds.enabled:
          # This process's part of the batch's dynamic-sampling metrics; `globalize` adds up the
          # processes' (means from sums, the attempts' maximum).
          for name, rewards in (("reward", np.concatenate(seen)), ("filtered_reward",
                                                                  ep.rewards)):
            live = np.asarray(rewards, np.float64)[np.isfinite(rewards)]
            sums[name] = [float(live.sum()), int(live.size)]
          info.update({"dynamic_sampling/num_gen_batches": got["attempts"],
                       "dynamic_sampling/dropped_groups": got["filtered"],
                       "dynamic_sampling/discarded_valid_samples": 0})
        return RingItem(meta, version, st(), info,
                        local=LocalRows(arrays, sums, counts))
      if ds.enabled:  # regeneration never over-generates: nothing valid is discarded
        info.update(dynamic_sampling.batch_metrics(
            np.concatenate(seen), ep.rewards, attempts=got["attempts"],
            dropped=got["filtered"], discarded=0))
    info.update(_means(sums))
    return RingItem(meta, version, st(), info, counts)

  def globalize(self, item: RingItem) -> RingItem:
    """The whole batch of a process-local `item` (several processes; others are returned as they
    are): every process's rows' metadata, counters and reward sums gathered, its own rows placed
    in the data plane as its part of the global arrays. Launches global programs: the trainer
    thread calls it for every batch, in batch order, on every process.

    `env/calls` is the most any process made (each process calls each task's environment once per
    turn with its rows, as one process does with all of them; the calls of different processes
    run in parallel), and so is `dynamic_sampling/num_gen_batches` (the processes' generation
    attempts run in parallel too); `env/failed/*`, dropped groups and the counters add up."""
    if item.local is None:
      return item
    every = parallel.distributed.allgather_json(part_json(item))
    every = [every[q] for q in sorted(range(len(every)), key=lambda q: self.share.starts[q])]
    meta, info, counts, took = combine(every)
    self.parts.data.put(meta, item.local.arrays, rows="local")
    return RingItem(meta, item.submit_version, took, info, counts)


def part_json(item: RingItem) -> dict:
  """A process-local `item` as JSON: what `combine` joins."""
  return {"meta": item.meta.to_json(), "time": item.sample_time_s,
          "info": {k: json_num(v) for k, v in item.info.items()},
          "sums": item.local.sums, "counts": item.local.counts}


def combine(every: list[dict]) -> tuple[BatchMeta, dict, dict, float]:
  """One batch from the parts several processes made of it (`part_json`, in row order): its
  rows' metadata, its metrics, its counters and its sampling time (the slowest part's: they ran
  in parallel). `env/calls` and `dynamic_sampling/num_gen_batches` are the most any part made
  (`_MOST`), reward components the means over every part's rows, the rest add up."""
  metas = [BatchMeta.from_json(e["meta"]) for e in every]
  info: dict = {}
  sums: dict = {}
  counts: dict = {}
  for e in every:
    for k, v in e["info"].items():
      v = from_json_num(v)
      info[k] = max(info.get(k, v), v) if k in _MOST else info.get(k, 0) + v
    for k, (total, n) in e["sums"].items():
      got = sums.setdefault(k, [0.0, 0])
      got[0] += total
      got[1] += n
    for k, n in e["counts"].items():
      counts[k] = counts.get(k, 0) + n
  info.update(_means(sums))
  return metas[0].concat(*metas[1:]), info, counts, max(e["time"] for e in every)


# Per-batch counts that `globalize` takes the processes' maximum of (the rest add up).
_MOST = ("env/calls", "dynamic_sampling/num_gen_batches")


def _means(sums: dict) -> dict:
  """Reward components and numeric env metadata: means over the rows generated for the batch."""
  return {k: s / n if n else float("nan") for k, (s, n) in sums.items()}
