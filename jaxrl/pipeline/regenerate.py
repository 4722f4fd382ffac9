"""Filling one batch's group slots with regeneration of filtered groups into the same slots.

A filtered group (zero reward variance under dynamic sampling, or every episode failed) is
re-sampled into its own slot of the same batch: it never takes a new ring slot, so filtering can
never leak gate capacity and deadlock the pipeline, and batch ordering is untouched. Groups are
sampled and kept or dropped whole, never split.
"""

from __future__ import annotations

from jaxrl.core.errors import UserError
from jaxrl.pipeline.gate import PipelineClosed


class RegenerationCapError(UserError, RuntimeError):
  """Slots were still filtered after `rollout.max_regenerations` re-samples (one line naming
  the key)."""


def fill_batch(batch_id: int, num_groups: int, sample, keep, max_regenerations: int,
               should_stop=None, cap_name: str = "rollout.max_regenerations", cap_value=None):
  """Fills slots 0..num_groups-1 of batch `batch_id` with groups.

  `sample(slots: list[int], attempt: int) -> list of groups` (one per slot, same order; it may run
  requests concurrently); `keep(group) -> bool` (False = filtered). Attempt 0 samples every slot;
  attempts 1..max_regenerations re-sample only the slots still filtered, into the same slots.

  Returns `(groups in slot order, {"regenerated": slot re-samples, "filtered": filtered groups
  seen, "attempts": sample() calls})`. Raises RegenerationCapError (naming the batch, the slots
  and `cap_name=cap_value`: the config key and value that set `max_regenerations`, by default
  `rollout.max_regenerations` itself) when slots are still filtered after the last attempt,
  ValueError when `sample` returns the wrong number of groups, and PipelineClosed if
  `should_stop()` turns True between attempts.
  """
  if num_groups < 1:
    raise ValueError(f"num_groups must be >= 1, got {num_groups}")
  if max_regenerations < 0:
    raise ValueError(f"rollout.max_regenerations must be >= 0, got {max_regenerations}")
  groups: list = [None] * num_groups
  pending = list(range(num_groups))
  regenerated = filtered = 0
  attempt = 0
  while True:
    out = list(sample(list(pending), attempt))
    if len(out) != len(pending):
      raise ValueError(f"sample() returned {len(out)} groups for {len(pending)} slots "
                       f"(batch {batch_id}, attempt {attempt})")
    still = []
    for slot, group in zip(pending, out):
      if keep(group):
        groups[slot] = group
      else:
        filtered += 1
        still.append(slot)
    if not still:
      return groups, {"regenerated": regenerated, "filtered": filtered, "attempts": attempt + 1}
    if attempt >= max_regenerations:
      raise RegenerationCapError(
          f"batch {batch_id}: slots {still} still filtered after {attempt} regeneration(s) "
          f"({attempt + 1} generation attempts; {cap_name}="
          f"{max_regenerations if cap_value is None else cap_value}); {filtered} filtered groups "
          f"seen. Raise {cap_name} or relax the filter.")
    if should_stop is not None and should_stop():
      raise PipelineClosed(f"stopped while regenerating batch {batch_id}")
    regenerated += len(still)
    attempt += 1
    pending = still
