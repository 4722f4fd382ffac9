"""The metrics row of one RL step (`metrics.jsonl`, `phase` "rl"): what the batch held, what the
update measured, how stale the rows were, the pipeline's counters and the step's time."""

from __future__ import annotations

import numpy as np

from jaxrl.core.names import lag_bound
from jaxrl.pipeline.dynamic_sampling import finite_mean
from jaxrl.pipeline.staleness import staleness_from_rows


def step_row(parts, step: int, batch_id: int, item, train: dict, loop: dict) -> dict:
  """The row of RL step `step`, which trained on batch `batch_id` (`item`, a `RingItem`).

  Args:
    parts: the run's `Parts` (its config, task source counters and data plane).
    step: the 1-based RL step.
    batch_id: the batch it trained on.
    item: that batch's ring item (metadata, versions, per-batch info).
    train: the train step's metrics, on the host.
    loop: the loop's own values, in row order: `train/skipped_updates`, `pipeline/*`,
      `val/trainer_wait_s`, then `perf/*`.

  Returns:
    The row, keys in the order `metrics.jsonl` has always had them.
  """
  meta, consumer = item.meta, step - 1  # versions published so far: one per completed step
  rewards = meta.tags["reward"]
  mixed = [np.ptp(rewards[g]) > 0 for g in meta.group_rows()]
  n = max(len(meta), 1)
  lag = lag_bound(parts.cfg.rollout)  # the ring has lag_bound + 1 slots
  head = {k: x for k, x in loop.items() if k == "train/skipped_updates"}
  pipe = {k: x for k, x in loop.items() if k.startswith("pipeline/")}
  tail = {k: x for k, x in loop.items() if k not in head and k not in pipe}
  # (batch_id, slot, submit_version, consume_version, seed) make an async run replayable
  # synchronously: batch b used params version submit_version and the stream of `seed`.
  return {"phase": "rl", "step": step, "batch_id": batch_id, "slot": batch_id % (lag + 1),
          "submit_version": item.submit_version, "consume_version": consumer,
          "reward": finite_mean(rewards), "filtered_reward": finite_mean(rewards), **item.info,
          "reward/mixed_groups": float(np.mean(mixed)),
          "completion_len": float(meta.lengths.mean()),
          "env/turns/mean": float(meta.tags["turns"].mean()),
          **{f"env/{k}_frac": float(meta.tags[k].sum()) / n
             for k in ("terminated", "truncated", "failed")}, **train, **head,
          **{f"data/skipped/{k}": c for k, c in parts.source.skipped.items()},
          **staleness_from_rows({k: meta.tags[f"version/{k}"] for k in ("first", "last", "mean")},
                                consumer),
          **pipe, "data_plane/train_rows": parts.data.stats()["train/rows"], **tail}
