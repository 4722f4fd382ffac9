"""The data plane: BatchMeta transforms, length-balanced sharding and the keyed device row store
(values, order, fast path, errors, memory release, threads, recompiles, several processes)."""

from __future__ import annotations

import gc
import os
import queue
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.parallel import batch_sharding, make_mesh
from jaxrl.pipeline import BatchMeta, DataPlane, balance_rows
from processes import communicate, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _meta(n=16, prefix="b0", partition="train", group=4, **tags):
  return BatchMeta.mint(partition, prefix, np.arange(n) // group, np.arange(n) % 5 + 1,
                        np.full(n, 3), tags or None)


def _rows(n, seed=0):
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, 100, (n, 6)).astype(np.int32),
          "mask": rng.integers(0, 2, (n, 6)).astype(bool),
          "logp": rng.standard_normal((n, 6)).astype(np.float32),
          "version": np.arange(n, dtype=np.int32)}


# -- BatchMeta -----------------------------------------------------------------------------------


def test_mint_keys_dtypes_and_private_copies():
  gids = np.array([7, 7, 3, 3])
  reward = np.array([1.0, 0.0, 0.5, 0.5], np.float32)
  m = BatchMeta.mint("train", "step3", gids, [4, 2, 4, 1], [0, 0, 1, 1], {"reward": reward})
  assert m.keys == ("step3/0", "step3/1", "step3/2", "step3/3") and len(m) == 4
  assert m.group_ids.dtype == np.int64 and m.lengths.dtype == np.int32
  assert m.versions.dtype == np.int32 and m.tags["reward"].dtype == np.float32
  gids[0], reward[0] = 99, 9.0  # the caller's arrays are not aliased
  assert m.group_ids[0] == 7 and m.tags["reward"][0] == 1.0
  with pytest.raises(ValueError):
    m.lengths[0] = 5  # read-only: shared between metas


def test_meta_validation_errors():
  with pytest.raises(ValueError, match="partition 'test'"):
    BatchMeta.mint("test", "p", [0], [1], [0])
  with pytest.raises(ValueError, match="duplicate row key 'a'"):
    BatchMeta("train", ("a", "b", "a"), [0, 0, 0], [1, 1, 1], [0, 0, 0], {})
  with pytest.raises(ValueError, match="tag 'reward'"):
    BatchMeta.mint("train", "p", [0, 0], [1, 1], [0, 0], {"reward": np.zeros(3)})
  with pytest.raises(ValueError, match="lengths"):
    BatchMeta("train", ("a", "b"), [0, 0], [1], [0, 0], {})
  with pytest.raises(TypeError):
    BatchMeta("train", ("a", 1), [0, 0], [1, 1], [0, 0], {})


def test_subset_slice_drop():
  m = _meta(6, reward=np.arange(6, dtype=np.float32))
  s = m.subset(np.array([4, 0, 2]))
  assert s.keys == ("b0/4", "b0/0", "b0/2")
  np.testing.assert_array_equal(s.tags["reward"], [4, 0, 2])
  np.testing.assert_array_equal(s.group_ids, m.group_ids[[4, 0, 2]])
  np.testing.assert_array_equal(s.lengths, m.lengths[[4, 0, 2]])
  for bad in ([6], [-1], [0, 7]):
    with pytest.raises(IndexError):
      m.subset(np.array(bad))
  with pytest.raises(ValueError, match="duplicate row key 'b0/1'"):
    m.subset([1, 1])
  assert m.slice(1, 3).keys == ("b0/1", "b0/2")
  assert m.slice(4, None).keys == ("b0/4", "b0/5")
  d = m.drop([0, 5, 5])
  assert d.keys == ("b0/1", "b0/2", "b0/3", "b0/4")
  np.testing.assert_array_equal(d.tags["reward"], [1, 2, 3, 4])
  assert m.drop(np.arange(6)) is None
  with pytest.raises(IndexError):
    m.drop([6])
  assert len(m) == 6 and m.keys[0] == "b0/0"  # the input is untouched


def test_concat():
  a = _meta(4, "a", reward=np.zeros(4, np.float32))
  b = _meta(2, "b", reward=np.ones(2, np.float32))
  c = a.concat(b)
  assert c.keys == ("a/0", "a/1", "a/2", "a/3", "b/0", "b/1")
  np.testing.assert_array_equal(c.tags["reward"], [0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(c.group_ids, [0, 0, 0, 0, 0, 0])
  assert len(a) == 4 and len(b) == 2
  with pytest.raises(ValueError, match="partition 'val'"):
    a.concat(_meta(2, "v", partition="val", reward=np.ones(2)))
  with pytest.raises(ValueError, match="tag 'reward'"):
    a.concat(_meta(2, "x"))
  with pytest.raises(ValueError, match="tag 'std'"):
    a.concat(_meta(2, "x", reward=np.ones(2), std=np.ones(2)))
  with pytest.raises(ValueError, match="duplicate row key 'a/0'"):
    a.concat(a.slice(0, 1))


def test_with_tags_and_group_rows():
  m = BatchMeta.mint("train", "g", [5, 2, 5, 7, 2, 7], np.ones(6), np.zeros(6))
  t = m.with_tags(reward=np.arange(6.0), std=np.ones(6))
  assert set(t.tags) == {"reward", "std"} and m.tags == {}
  t2 = t.with_tags(reward=np.zeros(6))
  np.testing.assert_array_equal(t2.tags["reward"], 0)
  np.testing.assert_array_equal(t.tags["reward"], np.arange(6.0))
  with pytest.raises(ValueError, match="tag 'bad'"):
    m.with_tags(bad=np.ones(5))
  groups = m.group_rows()
  assert [g.tolist() for g in groups] == [[0, 2], [1, 4], [3, 5]]
  assert [g.tolist() for g in m.subset([3, 1, 0]).group_rows()] == [[0], [1], [2]]


# -- balance_rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("n,shards,seed", [(8, 2, 0), (64, 8, 1), (48, 4, 2), (16, 16, 3),
                                           (30, 1, 4)])
def test_balance_rows_properties(n, shards, seed):
  rng = np.random.default_rng(seed)
  lengths = (rng.pareto(1.0, n) * 20).astype(np.int32) + 1
  perm, inverse = balance_rows(lengths, shards)
  assert sorted(perm.tolist()) == list(range(n))
  np.testing.assert_array_equal(inverse[perm], np.arange(n))
  np.testing.assert_array_equal(perm[inverse], np.arange(n))
  per = n // shards
  loads = [int(lengths[perm[k * per:(k + 1) * per]].sum()) for k in range(shards)]
  assert max(loads) - min(loads) <= lengths.max()
  for k in range(shards):
    part = perm[k * per:(k + 1) * per]
    assert (np.diff(part) > 0).all()  # ascending original order within a shard
  again = balance_rows(lengths.copy(), shards)
  np.testing.assert_array_equal(again[0], perm)


def test_balance_rows_beats_a_contiguous_split_and_is_exact():
  lengths = np.arange(1, 17)  # sorted lengths: the contiguous split is as bad as it gets
  perm, _ = balance_rows(lengths, 4)
  loads = lengths[perm].reshape(4, 4).sum(1)
  assert loads.max() - loads.min() <= 2 < np.ptp(lengths.reshape(4, 4).sum(1))
  perm, inv = balance_rows(np.array([5, 1, 3, 9, 2, 2, 7, 0]), 2)
  # 9->s0, 7->s1, 5->s1, 3->s0, 2->s0 (tie: lower shard), 2->s1, 1->s0 (full), 0->s1.
  np.testing.assert_array_equal(perm, [1, 2, 3, 4, 0, 5, 6, 7])
  np.testing.assert_array_equal(inv, [4, 0, 1, 2, 3, 5, 6, 7])


def test_balance_rows_errors():
  with pytest.raises(ValueError, match="no rows"):
    balance_rows(np.zeros(0, np.int32), 2)
  with pytest.raises(ValueError, match="6 rows do not split evenly over 4"):
    balance_rows(np.ones(6), 4)
  with pytest.raises(ValueError, match="num_shards"):
    balance_rows(np.ones(4), 0)


# -- DataPlane -----------------------------------------------------------------------------------


@pytest.fixture(params=["8dev", "1dev"])
def mesh(request, devices):
  return make_mesh(4, 2, 1) if request.param == "8dev" else make_mesh(1, 1, 1)


@pytest.fixture
def mesh8(devices):
  return make_mesh(4, 2, 1)


def test_put_get_round_trip_and_fast_path(mesh):
  dp = DataPlane(mesh)
  m = _meta(16)
  data = _rows(16)
  assert dp.put(m, data) is m
  out = dp.get(m, ["logp", "tokens", "mask", "version"])
  assert list(out) == ["logp", "tokens", "mask", "version"]
  for f, a in out.items():
    np.testing.assert_array_equal(np.asarray(a), data[f])
    assert a.dtype == data[f].dtype
    assert a.sharding.is_equivalent_to(batch_sharding(mesh), a.ndim)
  again = dp.get(m, ["tokens"])
  assert again["tokens"] is out["tokens"]  # whole block in placement order: no copy
  assert dp.get(list(m.keys), ["mask"], partition="train")["mask"] is out["mask"]
  assert dp.stats()["gather_calls"] == 0  # whole blocks in placement order: never gathered


def test_gather_order_and_blocks(mesh):
  dp = DataPlane(mesh)
  a, b = _meta(16, "a"), _meta(16, "b")
  da, db = _rows(16, 1), _rows(16, 2)
  dp.put(a, da)
  dp.put(b, db)
  rev = a.subset(np.arange(16)[::-1])
  out = dp.get(rev, ["tokens", "logp"])
  np.testing.assert_array_equal(np.asarray(out["tokens"]), da["tokens"][::-1])
  np.testing.assert_array_equal(np.asarray(out["logp"]), da["logp"][::-1])
  assert out["tokens"].sharding.is_equivalent_to(batch_sharding(mesh), 2)
  # Rows from both blocks, interleaved.
  mix = b.subset([1, 3, 5, 7, 9, 11, 13, 15]).concat(a.subset([0, 2, 4, 6, 8, 10, 12, 14]))
  out = dp.get(mix, ["tokens", "version", "mask"])
  for f in ("tokens", "version", "mask"):
    want = np.concatenate([db[f][1::2], da[f][0::2]])
    np.testing.assert_array_equal(np.asarray(out[f]), want)
    assert out[f].dtype == da[f].dtype
  # A prefix of a block is not the whole block: gathered, not the stored array.
  half = dp.get(a.slice(0, 8), ["tokens"])["tokens"]
  np.testing.assert_array_equal(np.asarray(half), da["tokens"][:8])


def test_field_added_later_under_existing_keys(mesh):
  dp = DataPlane(mesh)
  m = _meta(16)
  data = _rows(16)
  dp.put(m, {"tokens": data["tokens"]})
  adv = np.arange(16, dtype=np.float32) * 0.5
  rev = m.subset(np.arange(16)[::-1])
  dp.put(rev, {"advantages": adv[::-1]})  # written in another row order
  out = dp.get(m, ["tokens", "advantages"])
  np.testing.assert_array_equal(np.asarray(out["advantages"]), adv)
  np.testing.assert_array_equal(np.asarray(out["tokens"]), data["tokens"])
  assert dp.get(rev, ["advantages"])["advantages"] is dp.get(rev, ["advantages"])["advantages"]
  assert dp.stats()["train/blocks"] == 2 and dp.stats()["train/rows"] == 16
  # `advantages` in `m`'s order (the reverse of how it was stored) is the one gathered read.
  assert dp.stats()["gather_calls"] == 1
  assert dp.discard(m) == 16
  assert dp.stats() == {"gather_calls": 1, **{f"{p}/{s}": 0 for p in ("train", "val")
                                              for s in ("rows", "blocks", "bytes")}}


def test_put_errors_place_nothing(mesh8):
  dp = DataPlane(mesh8)
  m = _meta(16)
  dp.put(m, {"tokens": np.zeros((16, 4), np.int32)})
  before = dp.stats()
  with pytest.raises(ValueError, match="overwrite field 'tokens' of key 'b0/3'"):
    dp.put(m.slice(3, 11).concat(_meta(8, "new")),
           {"mask": np.ones((16, 4), bool), "tokens": np.ones((16, 4), np.int32)})
  with pytest.raises(ValueError, match="multiple of the 8 row shards"):
    dp.put(_meta(12, "c"), {"x": np.zeros((12, 2))})
  with pytest.raises(ValueError, match=r"field 'x' has shape \(15, 2\), expected 16 rows"):
    dp.put(_meta(16, "c"), {"y": np.zeros((16,)), "x": np.zeros((15, 2))})
  with pytest.raises(ValueError, match="at least one field"):
    dp.put(_meta(16, "c"), {})
  with pytest.raises(ValueError, match="rows must be"):
    dp.put(_meta(16, "c"), {"x": np.zeros(16)}, rows="some")
  with pytest.raises(TypeError, match="rows='local'"):
    dp.put(_meta(16, "c"), {"x": jax.numpy.zeros(16)}, rows="local")
  with pytest.raises(KeyError, match="partition 'val'"):
    DataPlane(mesh8, partitions=("train",)).put(_meta(8, partition="val"), {"x": np.zeros(8)})
  assert dp.stats() == before
  np.testing.assert_array_equal(np.asarray(dp.get(m, ["tokens"])["tokens"]), 0)
  with pytest.raises(KeyError, match="'mask'"):
    dp.get(m, ["mask"])  # the failed put left no field behind


def test_get_errors(mesh8):
  dp = DataPlane(mesh8)
  m = _meta(16)
  dp.put(m, {"tokens": np.zeros((16, 4), np.int32)})
  dp.put(m.slice(0, 8), {"adv": np.zeros(8, np.float32)})
  with pytest.raises(ValueError, match="non-empty list of fields"):
    dp.get(m, [])
  with pytest.raises(KeyError, match=r"'logp'.*'train'.*\['adv', 'tokens'\]"):
    dp.get(m, ["tokens", "logp"])
  with pytest.raises(KeyError, match=r"'tokens'.*'val'.*\[\]"):
    dp.get(_meta(16, partition="val"), ["tokens"])
  unknown = m.slice(0, 6).concat(_meta(2, "zz"))
  with pytest.raises(KeyError, match=r"key 'zz/0'.*2 of 8"):
    dp.get(unknown, ["tokens"])
  with pytest.raises(KeyError, match=r"field 'adv' was never written for key 'b0/8'.*8 of 16"):
    dp.get(m, ["adv"])
  with pytest.raises(ValueError, match="partition="):
    dp.get(list(m.keys), ["tokens"])
  with pytest.raises(ValueError, match="contradicts"):
    dp.get(m, ["tokens"], partition="val")
  with pytest.raises(ValueError, match="multiple of the 8 row shards"):
    dp.get(m.slice(0, 4), ["tokens"])


def test_put_local_rows_and_device_arrays(mesh):
  dp = DataPlane(mesh)
  m, data = _meta(16), _rows(16)
  dp.put(m, {"tokens": data["tokens"]}, rows="local")  # one process: local rows = all rows
  np.testing.assert_array_equal(np.asarray(dp.get(m, ["tokens"])["tokens"]), data["tokens"])
  sharded = jax.device_put(data["logp"], batch_sharding(mesh))
  replicated = jax.device_put(data["mask"], NamedSharding(mesh, P()))
  dp.put(m, {"logp": sharded, "mask": replicated})
  out = dp.get(m, ["logp", "mask"])
  assert out["logp"] is sharded  # already row-sharded: stored as is
  assert out["mask"].sharding.is_equivalent_to(batch_sharding(mesh), 2)
  np.testing.assert_array_equal(np.asarray(out["mask"]), data["mask"])
  with pytest.raises(ValueError, match="local rows"):
    dp.put(_meta(16, "c"), {"x": np.zeros((8, 2))}, rows="local")


def test_discard_clear_stats(mesh8):
  dp = DataPlane(mesh8)
  a, b, v = _meta(16, "a"), _meta(8, "b"), _meta(8, "v", partition="val")
  a_tokens = np.arange(64, dtype=np.int32).reshape(16, 4)
  dp.put(a, {"tokens": a_tokens, "logp": np.zeros((16, 4), np.float32)})
  dp.put(b, {"tokens": np.zeros((8, 4), np.int32), "logp": np.zeros((8, 4), np.float32)})
  dp.put(v, {"tokens": np.zeros((8, 2), np.int32)})
  assert dp.stats() == {"gather_calls": 0, "train/rows": 24, "train/blocks": 2,
                        "train/bytes": 24 * 4 * 8, "val/rows": 8, "val/blocks": 1,
                        "val/bytes": 8 * 2 * 4}
  with pytest.raises(KeyError, match=r"key 'nope'.*1 of 3"):
    dp.discard(["a/0", "a/1", "nope"], partition="train")
  assert dp.stats()["train/rows"] == 24  # validated before removing any
  with pytest.raises(ValueError, match="duplicate"):
    dp.discard(["a/0", "a/0"], partition="train")
  assert dp.discard(a.slice(0, 8)) == 8
  assert dp.stats()["train/blocks"] == 2  # half of block a is still live
  rest = dp.get(a.slice(8, 16), ["tokens", "logp"])
  np.testing.assert_array_equal(np.asarray(rest["tokens"]), a_tokens[8:])
  assert dp.discard(a.slice(8, 16)) == 8
  assert dp.stats()["train/blocks"] == 1 and dp.stats()["train/bytes"] == 8 * 4 * 8
  with pytest.raises(KeyError, match="'a/0'"):
    dp.get(a, ["tokens"])
  assert dp.clear("val") == 8 and dp.stats()["val/rows"] == 0
  assert dp.clear() == 8 and dp.clear() == 0
  with pytest.raises(KeyError, match="partition 'test'"):
    dp.clear("test")
  dp.put(a, {"tokens": np.ones((16, 4), np.int32)})  # keys are free again after discard
  assert dp.stats()["train/rows"] == 16


def test_memory_returns_to_baseline(mesh8):
  """Device arrays are released by reference counting as soon as the rows are discarded and the
  results dropped. Automatic gc is off during the loop, so a reference cycle that kept a block
  alive until some later collection would show up as growth too."""
  dp = DataPlane(mesh8)
  rng = np.random.default_rng(0)
  counts = []
  gc.collect()
  gc.disable()
  try:
    for it in range(200):
      m = _meta(64, f"it{it}")
      dp.put(m, {"tokens": rng.integers(0, 9, (64, 32)).astype(np.int32),
                 "logp": rng.standard_normal((64, 32)).astype(np.float32),
                 "mask": np.ones((64, 32), bool)})
      dp.put(m.subset(np.arange(64)[::-1]), {"adv": np.zeros(64, np.float32)})
      out = dp.get(m, ["tokens", "logp", "mask", "adv"])  # fast path + gather
      jax.block_until_ready(out)
      assert dp.discard(m) == 64
      del out
      counts.append(len(jax.live_arrays()))
  finally:
    gc.enable()
  gc.collect()
  counts.append(len(jax.live_arrays()))
  assert dp.stats()["train/blocks"] == 0
  assert set(counts) == {counts[0]}, f"live arrays grew: {counts[0]} -> {max(counts)}"


def test_threads_put_while_trainer_gets_and_discards(mesh8):
  dp = DataPlane(mesh8)
  ready: queue.Queue = queue.Queue()
  errors = []

  def producer():
    try:
      for i in range(40):
        m = _meta(16, f"t{i}")
        dp.put(m, {"x": np.full((16, 8), i, np.int32), "y": np.full(16, -i, np.float32)})
        ready.put(m)
    except BaseException as e:  # surfaced by the main thread
      errors.append(e)
    finally:
      ready.put(None)

  th = threading.Thread(target=producer)
  th.start()
  seen = 0
  while (m := ready.get(timeout=30)) is not None:
    i = int(m.keys[0].split("/")[0][1:])
    out = dp.get(m.subset(np.arange(16)[::-1]), ["x", "y"])
    assert (np.asarray(out["x"]) == i).all() and (np.asarray(out["y"]) == -i).all()
    assert dp.discard(m) == 16
    seen += 1
  th.join()
  assert not errors and seen == 40
  assert dp.stats()["train/rows"] == 0 and dp.stats()["train/blocks"] == 0


def test_gather_does_not_recompile_for_a_repeated_pattern(mesh8):
  """Counts growth of the gather's jit cache (jit caches are per function, shared by every
  DataPlane): new blocks of the same shapes and new row orders must hit the cache."""
  dp = DataPlane(mesh8)
  sizes = []
  for it in range(6):
    a, b = _meta(16, f"a{it}"), _meta(16, f"b{it}")
    dp.put(a, {"x": np.full((16, 4), it, np.float32), "n": np.arange(16)})
    dp.put(b, {"x": np.full((16, 4), -it, np.float32), "n": np.arange(16)})
    rows = np.random.default_rng(it).permutation(16)[:8]
    out = dp.get(a.subset(rows).concat(b.subset(rows)), ["x", "n"])
    np.testing.assert_array_equal(np.asarray(out["n"]), np.concatenate([rows, rows]))
    np.testing.assert_array_equal(np.asarray(out["x"])[:, 0], [it] * 8 + [-it] * 8)
    dp.discard(a)
    dp.discard(b)
    sizes.append(dp.gather_rows._cache_size())
  assert sizes == [sizes[0]] * 6
  c = [_meta(8, f"c{i}") for i in range(3)]
  for m in c:
    dp.put(m, {"x": np.zeros((8, 4), np.float32)})
  dp.get(c[0].concat(c[1], c[2]), ["x"])  # three blocks, one field: a new pattern compiles
  assert dp.gather_rows._cache_size() == sizes[0] + 1


# -- several processes ---------------------------------------------------------------------------


def test_two_processes_assemble_and_gather_rows():
  """Two jax.distributed CPU processes of 4 devices each: contiguous, interleaved and
  replicated-across-processes row layouts (see `_process_main`)."""
  port = free_port()
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  for out in communicate(procs, 120):
    for layout in ("blocked", "interleaved", "replicated"):
      assert f"OK {layout}" in out, out[-3000:]


def _process_main(pid: int, port: int) -> None:
  """One of two processes: each layout puts global and local host rows and a replicated
  jax.Array, then checks every addressable shard of fast-path and gathered reads."""
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
  mine = [d for d in jax.devices() if d.process_index == pid]
  theirs = [d for d in jax.devices() if d.process_index != pid]
  p0 = mine if pid == 0 else theirs
  p1 = theirs if pid == 0 else mine
  alternating = [d for pair in zip(p0, p1) for d in pair]
  meshes = {
      "blocked": make_mesh(4, 2, 1, p0 + p1),  # process 0 holds rows 0..15, process 1 the rest
      "interleaved": make_mesh(4, 2, 1, alternating),  # row shards alternate between processes
      "replicated": make_mesh(2, 2, 2, alternating),  # tensor crosses processes: all rows on both
  }
  n = 32
  for name, mesh in meshes.items():
    dp = DataPlane(mesh)
    shards = mesh.devices.reshape(dp.num_row_shards(), -1)
    per = n // len(shards)
    local = np.concatenate([np.arange(k * per, (k + 1) * per) for k, devs in enumerate(shards)
                            if any(d.process_index == pid for d in devs)])
    a, b = _meta(n, "a"), _meta(n, "b")
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    dp.put(a, {"x": x})
    dp.put(a, {"y": 2 * x[local]}, rows="local")
    dp.put(b, {"x": x + 100, "y": jax.device_put(2 * x + 200, NamedSharding(mesh, P()))})

    def check(arr, want):
      assert arr.sharding.is_equivalent_to(batch_sharding(mesh), arr.ndim)
      for s in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), want[s.index])

    out = dp.get(a, ["x", "y"])
    check(out["x"], x)
    check(out["y"], 2 * x)
    out = dp.get(a.subset(np.arange(n)[::-1]), ["x", "y"])
    check(out["x"], x[::-1])
    check(out["y"], 2 * x[::-1])
    mix = a.slice(0, n // 2).concat(b.slice(n // 2, n))
    want = np.concatenate([x[:n // 2], x[n // 2:] + 100])
    out = dp.get(mix, ["x", "y"])
    check(out["x"], want)
    check(out["y"], 2 * want)
    assert dp.discard(a) == n and dp.clear() == n
    print(f"OK {name}", flush=True)


if __name__ == "__main__":
  _process_main(int(sys.argv[1]), int(sys.argv[2]))
