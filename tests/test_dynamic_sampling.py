"""Dynamic sampling: the group predicate, whole-group keep/drop, the pending cache across
generation batches, exactly K attempts, metrics, and that nothing is left in the store."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.pipeline import BatchMeta
from jaxrl.pipeline.dynamic_sampling import (DynamicSamplingError, fill_from_generations,
                                             group_keep, keep_group)

nan = float("nan")


@pytest.mark.parametrize("rewards, tol, keep", [
    # Any success and any failure in a group -> signal -> kept, whole.
    ([1, 0, 0, 0], 0.0, True),
    ([1, 1, 1, 0], 0.0, True),
    ([1, 1, 0, 0], 0.0, True),
    # All equal -> every advantage is 0 -> dropped.
    ([1, 1, 1, 1], 0.0, False),
    ([0, 0, 0, 0], 0.0, False),
    # Size-2 groups: a leave-one-out std would call both [1, 0] members constant; the group
    # predicate does not.
    ([1, 0], 0.0, True),
    ([1, 1], 0.0, False),
    # Failed members (non-finite reward) are not live: [nan, 1, 1, 1] has no spread.
    ([nan, 1, 1, 1], 0.0, False),
    ([nan, 1, 0, nan], 0.0, True),
    ([nan, nan], 0.0, False),
    # tol: a spread of 0.1 is dropped at tol 0.2 and kept at tol 0.05.
    ([0.5, 0.6], 0.2, False),
    ([0.5, 0.6], 0.05, True),
    ([0.5, 0.6], 0.1 + 1e-6, False),  # f32: 0.6 - 0.5 = 0.10000002
])
def test_keep_group_table(rewards, tol, keep):
  assert keep_group(np.array(rewards, np.float32), tol) is keep


def _meta(prefix, group_ids, rewards, partition="train"):
  n = len(rewards)
  return BatchMeta.mint(partition, prefix, group_ids=np.asarray(group_ids),
                        lengths=np.full(n, 3), versions=np.zeros(n),
                        tags={"reward": np.asarray(rewards, np.float32)})


def test_group_keep_uses_explicit_group_ids_not_row_order():
  # Groups 7 and 3 interleaved: 7 = rows 0, 2 (rewards 1, 1: drop); 3 = rows 1, 3 (1, 0: keep).
  meta = _meta("b0", [7, 3, 7, 3], [1, 1, 1, 0])
  groups, keep = group_keep(meta, "reward", 0.0)
  assert [g.tolist() for g in groups] == [[0, 2], [1, 3]]
  assert keep.tolist() == [False, True]
  with pytest.raises(KeyError, match="dynamic_sampling.reward_field.*'shaped'"):
    group_keep(meta, "shaped", 0.0)


class FakeStore:
  """Stands in for the data plane: a set of live keys; discarding an unknown key raises."""

  def __init__(self):
    self.live: set[str] = set()

  def put(self, meta):
    assert not self.live & set(meta.keys)
    self.live |= set(meta.keys)
    return meta

  def discard(self, meta):
    missing = set(meta.keys) - self.live
    if missing:
      raise KeyError(sorted(missing))
    self.live -= set(meta.keys)


def _generations(store, batches, G):
  """generate(attempt) returning the attempt-th reward table (groups of G), group ids unique."""
  calls = []

  def generate(attempt):
    calls.append(attempt)
    rewards = np.asarray(batches[attempt - 1], np.float32).reshape(-1)
    n_groups = len(rewards) // G
    gids = np.repeat(100 * attempt + np.arange(n_groups), G)
    return store.put(_meta(f"g{attempt}", gids, rewards))

  return generate, calls


def test_pending_cache_fills_across_generations_with_whole_groups():
  G, P = 2, 4
  store = FakeStore()
  generate, calls = _generations(store, [
      [[1, 0], [1, 1], [0, 1], [0, 0]],  # 2 kept (groups 100, 102), 2 dropped
      [[0, 0], [1, 0], [0, 1], [1, 0]],  # 3 kept (201, 202, 203), 1 dropped
  ], G)
  meta, m = fill_from_generations(generate, num_groups=P, max_gen_batches=5, tol=0.0,
                                  reward_field="reward", discard=store.discard)
  assert calls == [1, 2]
  # Survivors in generation order, whole: 100, 102 from attempt 1, then 201, 202; 203 overflows.
  assert meta.group_ids.tolist() == [100, 100, 102, 102, 201, 201, 202, 202]
  assert m["dynamic_sampling/num_gen_batches"] == 2
  assert m["dynamic_sampling/dropped_groups"] == 3  # 2 + 1
  assert m["dynamic_sampling/discarded_valid_samples"] == G  # group 203's rows
  # reward: all 16 generated rows, 7 ones -> 7/16; filtered_reward: the 8 trained rows, 4 ones.
  assert m["reward"] == pytest.approx(7 / 16)
  assert m["filtered_reward"] == pytest.approx(4 / 8)
  # Only the returned rows are still stored: dropped and overflow rows were freed.
  assert store.live == set(meta.keys)


def test_exactly_k_attempts_then_error_naming_the_key():
  G, P, K = 4, 2, 3
  store = FakeStore()
  flat = [[[1, 1, 1, 1], [0, 0, 0, 0]]] * K + [[[1, 0, 0, 0], [1, 1, 0, 0]]]
  # Attempt K + 1 would succeed; an off-by-one limit would reach it and return.
  generate, calls = _generations(store, flat, G)
  with pytest.raises(DynamicSamplingError) as info:
    fill_from_generations(generate, num_groups=P, max_gen_batches=K, tol=0.0,
                          reward_field="reward", discard=store.discard)
  assert calls == [1, 2, 3]
  msg = str(info.value)
  assert "dynamic_sampling.max_gen_batches=3" in msg and "0 of 2 groups" in msg
  assert not store.live  # nothing leaked


def test_error_frees_pending_rows():
  G = 2
  store = FakeStore()
  generate, calls = _generations(store, [[[1, 0], [1, 1]], [[1, 1], [0, 0]]], G)
  with pytest.raises(DynamicSamplingError, match="only 1 of 2 groups"):
    fill_from_generations(generate, num_groups=2, max_gen_batches=2, tol=0.0,
                          reward_field="reward", discard=store.discard)
  assert not store.live

  # An engine failure on attempt 2 frees the survivors pending from attempt 1.
  store2 = FakeStore()
  first, _ = _generations(store2, [[[1, 0], [1, 1]]], G)

  def broken(attempt):
    if attempt == 2:
      raise OSError("engine died")
    return first(attempt)

  with pytest.raises(OSError, match="engine died"):
    fill_from_generations(broken, num_groups=2, max_gen_batches=3, tol=0.0,
                          reward_field="reward", discard=store2.discard)
  assert not store2.live


def test_bad_arguments():
  store = FakeStore()
  generate, _ = _generations(store, [[[1, 0]]], 2)
  with pytest.raises(ValueError, match="max_gen_batches must be >= 1"):
    fill_from_generations(generate, num_groups=1, max_gen_batches=0, tol=0.0,
                          reward_field="reward", discard=store.discard)
  with pytest.raises(KeyError, match="reward_field"):
    fill_from_generations(generate, num_groups=1, max_gen_batches=1, tol=0.0,
                          reward_field="nope", discard=store.discard)
  assert not store.live  # the generation that could not be read was freed


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_groups_kept_or_dropped_whole(data):
  G = data.draw(st.integers(2, 4), label="G")
  P = data.draw(st.integers(1, 4), label="P")
  K = data.draw(st.integers(1, 4), label="K")
  table = data.draw(st.lists(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=G,
                                               max_size=G), min_size=P, max_size=P),
                             min_size=K, max_size=K), label="rewards")
  store = FakeStore()
  generate, calls = _generations(store, table, G)
  signal = [[max(g) > min(g) for g in batch] for batch in table]
  need = np.cumsum([sum(s) for s in signal])
  try:
    meta, m = fill_from_generations(generate, num_groups=P, max_gen_batches=K, tol=0.0,
                                    reward_field="reward", discard=store.discard)
  except DynamicSamplingError:
    assert need[-1] < P and calls == list(range(1, K + 1)) and not store.live
    return
  attempts = int(np.argmax(need >= P)) + 1
  assert calls == list(range(1, attempts + 1))
  # The first P signal groups in generation order, each with all G rows.
  want = [100 * (a + 1) + i for a in range(attempts) for i in range(P) if signal[a][i]][:P]
  assert meta.group_ids.tolist() == np.repeat(want, G).tolist()
  for rows in meta.group_rows():
    assert len(rows) == G and np.ptp(meta.tags["reward"][rows]) > 0
  assert m["dynamic_sampling/dropped_groups"] == sum(not s for b in signal[:attempts] for s in b)
  assert m["dynamic_sampling/discarded_valid_samples"] == (need[attempts - 1] - P) * G
  assert store.live == set(meta.keys)

