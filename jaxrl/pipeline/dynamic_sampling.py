"""Dynamic sampling: drop groups whose rewards carry no learning signal, keep every batch full.

The predicate is on the *group*, computed from a named per-row reward (the raw task reward by
default, never a shaped one):

    drop(group)  <=>  max(r) - min(r) <= tol   over the group's live members (finite rewards)

A group with no live member has no signal either and is dropped. Because it is one test on the
whole group, made before and independently of the advantage baseline, a group is always kept or
dropped whole: no baseline (leave-one-out or otherwise) can split it, and a group of 2 with
rewards `[1, 0]` is kept while `[1, 1]` is dropped.

Two ways to keep the batch at P groups:

- `fill_from_generations` (synchronous, lag 0): whole generation batches of P groups are made one
  after another; survivors accumulate in a pending cache (metadata only: their rows stay in the
  data plane, dropped rows are freed at once) until P groups are ready. Overflow groups are
  discarded whole, in generation order. Attempt k of K is the k-th generation batch; if P groups
  are still not ready after K attempts, `DynamicSamplingError` names
  `dynamic_sampling.max_gen_batches` (exactly K attempts, never K + 1).
- With lag > 0 the predicate is the rollout worker's `keep` hook: a dropped group is re-sampled
  into its own (batch, slot) by `jaxrl.pipeline.fill_batch`, so filtering never takes a new ring
  slot and cannot deadlock the pipeline; the same K caps the generation attempts per slot. On
  several processes every lag works this way: each process fills its own groups' slots from a
  stream of its own (`jaxrl.pipeline.producer`), and the batch's metrics add up over them.

Metrics (per training batch): `reward` is the mean over every generated row, dropped or not
(the policy's real success rate), `filtered_reward` the mean over the rows trained on, and
`dynamic_sampling/{num_gen_batches, dropped_groups, discarded_valid_samples}` count generation
attempts, groups dropped by the predicate, and rows of surviving groups discarded as overflow.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxrl.core.errors import UserError
from jaxrl.pipeline.batch_meta import BatchMeta


class DynamicSamplingError(UserError, RuntimeError):
  """P groups with reward variance were not found within `dynamic_sampling.max_gen_batches`: the
  message names the keys to change, so `python -m jaxrl.train` ends with it as one line."""


def keep_group(rewards, tol: float) -> bool:
  """True when the group's live rewards spread by more than `tol` (see the module docstring)."""
  r = np.asarray(rewards, np.float64)
  live = r[np.isfinite(r)]
  return bool(live.size) and float(live.max() - live.min()) > tol


def group_keep(meta: BatchMeta, reward_field: str, tol: float
               ) -> tuple[list[np.ndarray], np.ndarray]:
  """`(rows of each group in first-appearance order, keep flag per group)` for one batch."""
  if reward_field not in meta.tags:
    raise KeyError(f"dynamic_sampling.reward_field: rows carry no tag {reward_field!r}; they carry "
                   f"{sorted(meta.tags)}")
  rewards = meta.tags[reward_field]
  groups = meta.group_rows()
  return groups, np.array([keep_group(rewards[g], tol) for g in groups], bool)


def fill_from_generations(generate: Callable[[int], BatchMeta], *, num_groups: int,
                          max_gen_batches: int, tol: float, reward_field: str,
                          discard: Callable[[BatchMeta], object]) -> tuple[BatchMeta, dict]:
  """Synchronous dynamic sampling with a pending cache.

  `generate(attempt)` (attempt = 1..K) makes one generation batch, puts its rows in the data
  plane and returns their metadata; `discard(meta)` frees rows. Returns `(meta of exactly
  num_groups whole groups, in generation order; metrics)`. On any error every pending row is
  freed before the error propagates, so a failed batch leaks nothing.
  """
  if num_groups < 1:
    raise ValueError(f"num_groups must be >= 1, got {num_groups}")
  if max_gen_batches < 1:
    raise ValueError(f"dynamic_sampling.max_gen_batches must be >= 1, got {max_gen_batches}")
  pending: BatchMeta | None = None
  current: BatchMeta | None = None  # a generation whose rows are not yet dropped or pending
  pending_groups = 0
  dropped = 0
  all_rewards = []
  try:
    for attempt in range(1, max_gen_batches + 1):
      current = generate(attempt)
      meta = current
      groups, keep = group_keep(meta, reward_field, tol)
      all_rewards.append(np.asarray(meta.tags[reward_field], np.float64))
      dropped += int((~keep).sum())
      kept_rows = [g for g, k in zip(groups, keep) if k]
      if kept_rows:
        survivors = meta.subset(np.concatenate(kept_rows))
        pending = survivors if pending is None else pending.concat(survivors)
        pending_groups += len(kept_rows)
      current = None  # every row of this generation is now pending or about to be freed
      drop_rows = [g for g, k in zip(groups, keep) if not k]
      if drop_rows:
        discard(meta.subset(np.concatenate(drop_rows)))  # freed now, not at the end of the step
      if pending_groups >= num_groups:
        break
    else:
      raise DynamicSamplingError(
          f"only {pending_groups} of {num_groups} groups had reward variance (max - min > "
          f"dynamic_sampling.tol={tol}) after {max_gen_batches} generation batches "
          f"(dynamic_sampling.max_gen_batches={max_gen_batches}); {dropped} groups dropped. "
          "Raise dynamic_sampling.max_gen_batches, or check the task's rewards.")
    assert pending is not None
    groups = pending.group_rows()
    discarded = 0
    if len(groups) > num_groups:
      extra = np.concatenate(groups[num_groups:])
      discarded = len(extra)
      discard(pending.subset(extra))
      pending = pending.subset(np.concatenate(groups[:num_groups]))
  except BaseException:
    for rows in (current, pending):
      if rows is not None:
        discard(rows)
    raise
  return pending, batch_metrics(np.concatenate(all_rewards), pending.tags[reward_field],
                                attempts=attempt, dropped=dropped, discarded=discarded)


def batch_metrics(generated, trained, *, attempts: int, dropped: int, discarded: int) -> dict:
  """The per-batch metrics of the module docstring, for either way of filling a batch."""
  return {
      "reward": finite_mean(generated),
      "filtered_reward": finite_mean(trained),
      "dynamic_sampling/num_gen_batches": attempts,
      "dynamic_sampling/dropped_groups": dropped,
      "dynamic_sampling/discarded_valid_samples": discarded,
  }


def finite_mean(x) -> float:
  """Mean over the finite entries (failed rows carry NaN); NaN when there are none."""
  x = np.asarray(x, np.float64)
  x = x[np.isfinite(x)]
  return float(x.mean()) if x.size else float("nan")
