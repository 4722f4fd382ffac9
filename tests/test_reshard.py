"""jaxrl.parallel.reshard: publishing a param tree from a train mesh to a rollout mesh without
gathering a leaf whole (values, shardings, which path each leaf takes, peak live bytes per
device, no host-copy fallback) and the benchmark's smoke run."""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys

import jax
import jax._src.array as jax_array
import numpy as np
import pytest
from jax._src.lib import xla_client
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import tiny_model_config
from jaxrl.models.transformer import abstract_model
from jaxrl.parallel import make_mesh, param_shardings, reshard
from jaxrl.parallel.reshard import device_bytes, intermediate_sharding, leaf_path

# The module (`jaxrl.parallel.reshard` as an attribute is the function of the same name).
reshard_module = importlib.import_module("jaxrl.parallel.reshard")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 heads and 2 kv heads: wk, wv, bk, bv stay replicated over a tensor axis of 4, split over 2.
CFG = tiny_model_config(vocab_size=64, d_model=64, mlp_dim=128, qkv_bias=True)
_, ABSTRACT = abstract_model(CFG)


def _params(mesh):
  """Random values laid out by the model's param shardings on `mesh` (put from the host)."""
  rng = np.random.default_rng(0)
  values = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), ABSTRACT)
  return jax.device_put(values, param_shardings(ABSTRACT, mesh))


def _shard_bytes(x, sharding) -> int:
  return int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize


def _tree_bytes(tree, shardings) -> dict:
  """Bytes per device of `tree` laid out by `shardings` (replicas counted on each device)."""
  out: dict = {}
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    for d in s.device_set:
      out[d] = out.get(d, 0) + _shard_bytes(x, s)
  return out


@pytest.fixture
def no_host_copy(monkeypatch):
  """Makes JAX's whole-array-via-host fallback raise; returns its call log."""
  calls = []

  def refuse(x, *args, **kwargs):
    calls.append(x.shape)
    raise AssertionError(f"host-copy fallback used for a {x.shape} leaf")

  monkeypatch.setattr(jax_array, "shard_sharded_device_array_slow_path", refuse)
  return calls


def _peak(fn):
  """Runs fn(observe) and returns (its result, baseline and peak live bytes per device)."""
  gc.collect()
  base = device_bytes()
  peak = dict(base)

  def observe(stage):
    for d, b in device_bytes().items():
      peak[d] = max(peak.get(d, 0), b)

  out = fn(observe)
  observe("end")
  return out, base, peak


def _check_bound(src, src_sh, dst_sh, base, peak):
  """No device above its baseline (its source shards and whatever else is alive) + its
  destination shards + the largest single shard of any leaf."""
  dst_bytes = _tree_bytes(src, dst_sh)
  leaf_shard = max(max(_shard_bytes(x, s), _shard_bytes(x, t)) for x, s, t in
                   zip(jax.tree.leaves(src), jax.tree.leaves(src_sh), jax.tree.leaves(dst_sh)))
  over = {d.id: peak[d] - (base[d] + dst_bytes.get(d, 0) + leaf_shard) for d in peak
          if peak[d] > base[d] + dst_bytes.get(d, 0) + leaf_shard}
  return over


CASES = {
    # name: (source mesh shape, source devices, destination mesh shape, destination devices)
    "fsdp4_to_tensor4": ((1, 4, 1), range(0, 4), (1, 1, 4), range(4, 8)),
    "fsdp4_to_data4": ((1, 4, 1), range(0, 4), (4, 1, 1), range(4, 8)),
    "fsdp4_to_data2_tensor2": ((1, 4, 1), range(0, 4), (2, 1, 2), range(4, 8)),
    "fsdp4_to_tensor2": ((1, 4, 1), range(0, 4), (1, 1, 2), range(4, 6)),
    "fsdp2_to_tensor4": ((1, 2, 1), range(0, 2), (1, 1, 4), range(4, 8)),
    "overlapping_devices": ((1, 4, 1), range(0, 4), (1, 1, 4), [5, 3, 2, 4]),
    "same_devices_reordered": ((1, 4, 1), range(0, 4), (1, 2, 2), [3, 1, 2, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_values_shardings_memory(devices, no_host_copy, case):
  src_shape, src_devs, dst_shape, dst_devs = CASES[case]
  src_mesh = make_mesh(*src_shape, [devices[i] for i in src_devs])
  dst_mesh = make_mesh(*dst_shape, [devices[i] for i in dst_devs])
  src = _params(src_mesh)
  src_sh, dst_sh = param_shardings(src, src_mesh), param_shardings(src, dst_mesh)
  expected = jax.tree.map(np.asarray, src)

  out, base, peak = _peak(lambda observe: reshard(src, dst_sh, observe=observe))

  assert no_host_copy == []
  for want, got, s, x in zip(jax.tree.leaves(expected), jax.tree.leaves(out),
                             jax.tree.leaves(dst_sh), jax.tree.leaves(src)):
    assert got.sharding == s
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(x), want)  # the source is intact
    assert not x.is_deleted()
  assert _check_bound(src, src_sh, dst_sh, base, peak) == {}


def test_naive_device_put_takes_the_host_copy(devices, no_host_copy):
  """Why the module exists: plain device_put of FSDP params onto a tensor-parallel mesh of other
  devices goes through the host (`x._value`, the whole leaf), which the fixture refuses."""
  src_mesh = make_mesh(1, 4, 1, devices[:4])
  dst_mesh = make_mesh(1, 1, 4, devices[4:])
  src = _params(src_mesh)
  with pytest.raises(AssertionError, match="host-copy fallback"):
    jax.device_put(src, param_shardings(src, dst_mesh))
  assert no_host_copy


def test_gather_to_one_device_breaks_the_bound(devices):
  """The memory check can fail: gathering every leaf onto one device first exceeds it."""
  src_mesh = make_mesh(1, 4, 1, devices[:4])
  dst_mesh = make_mesh(1, 1, 4, devices[4:])
  src = _params(src_mesh)
  src_sh, dst_sh = param_shardings(src, src_mesh), param_shardings(src, dst_mesh)

  def gather(observe):
    whole = jax.tree.map(lambda x: jax.device_put(x, devices[0]), src)
    observe("gathered")
    return jax.device_put(whole, dst_sh)

  _, base, peak = _peak(gather)
  assert devices[0].id in _check_bound(src, src_sh, dst_sh, base, peak)


def test_intermediate_lines_up_device_by_device(devices):
  """Device i of the intermediate holds the index that device i of the destination holds (in
  the destination's device-list order, the order JAX's per-shard copy pairs them in), also for
  a destination mesh listed in a scrambled device order."""
  src = NamedSharding(make_mesh(1, 4, 1, devices[:4]), P(None, "fsdp"))
  for order in ([4, 5, 6, 7], [7, 5, 4, 6]):
    for spec in (P("tensor", None), P(None, "tensor"), P("tensor", "fsdp")):
      dst = NamedSharding(make_mesh(1, 2, 2, [devices[i] for i in order]), spec)
      inter = intermediate_sharding(src, dst)
      assert list(inter.mesh.devices.flat) == devices[:4]
      shape = (8, 12)
      im, dm = inter.devices_indices_map(shape), dst.devices_indices_map(shape)
      for a, b in zip(inter._internal_device_list, dst._internal_device_list):
        assert im[a] == dm[b]
      assert inter.is_equivalent_to(NamedSharding(inter.mesh, spec), 2)


def test_fast_path_is_the_per_shard_copy(devices, no_host_copy, monkeypatch):
  """Evenly split leaves go through the collective on the source devices and then JAX's batched
  per-shard device-to-device copy; replicated destination leaves go piece by piece."""
  src_mesh = make_mesh(1, 4, 1, devices[:4])
  dst_mesh = make_mesh(1, 1, 4, devices[4:])
  src = _params(src_mesh)
  dst_sh = param_shardings(src, dst_mesh)
  paths = {k: leaf_path(src[k][...], dst_sh[k].get_value())[0]
           for k in ("embed", "w_up", "wk", "bv")}
  assert paths == {"embed": "collective", "w_up": "collective", "wk": "pieces", "bv": "pieces"}

  copied = []
  batched = xla_client.batched_copy_array_to_devices_with_sharding

  def spy(xs, *args):
    copied.extend(x.shape for x in xs)
    return batched(xs, *args)

  monkeypatch.setattr(xla_client, "batched_copy_array_to_devices_with_sharding", spy)
  stages = []
  reshard({"embed": src["embed"][...]}, {"embed": dst_sh["embed"].get_value()},
          observe=stages.append)
  assert copied == [src["embed"].shape] and stages == ["intermediate", "final"]
  assert no_host_copy == []


def test_full_rematerialization_is_avoided(devices, no_host_copy):
  """Some evenly split destinations XLA cannot reach by an all-to-all: its collective replicates
  the leaf on every source device first (a leaf-sized temporary), so those go piece by piece."""
  src = NamedSharding(make_mesh(1, 4, 1, devices[:4]), P(None, None, "fsdp"))
  x = jax.ShapeDtypeStruct((64, 64, 8), np.float32, sharding=src)
  leaf = 64 * 64 * 8 * 4
  to_all = NamedSharding(make_mesh(1, 2, 2, devices[4:]), P("fsdp", "tensor"))
  y = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(src.mesh, P("fsdp")))
  path, temp = leaf_path(y, to_all)
  assert path == "collective" and temp < leaf
  remat = NamedSharding(make_mesh(2, 2, 1, devices[4:]), P("data", "fsdp"))
  inter = intermediate_sharding(src, remat)
  temp = reshard_module.collective_temp_bytes(src, inter, x.shape, np.dtype(np.float32), False)
  assert temp >= leaf
  assert leaf_path(x, remat) == ("pieces", None)
  value = np.arange(64 * 64 * 8, dtype=np.float32).reshape(x.shape)
  out = reshard(jax.device_put(value, src), remat)
  np.testing.assert_array_equal(np.asarray(out), value)
  assert out.sharding == remat
  partly_replicated = NamedSharding(make_mesh(2, 1, 2, devices[4:]), P(None, "tensor"))
  assert leaf_path(x, partly_replicated) == ("pieces", None)


def test_same_sharding_is_a_fresh_copy(devices, no_host_copy):
  """A leaf already sharded as asked still gets its own buffers: the source can be donated."""
  mesh = make_mesh(1, 4, 1, devices[:4])
  x = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp")))
  y = reshard(x, x.sharding)
  assert leaf_path(x, x.sharding) == ("copy", None)
  ptrs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  assert ptrs.isdisjoint(s.data.unsafe_buffer_pointer() for s in y.addressable_shards)
  x.delete()
  np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(8, 4))


def test_odd_leaves(devices, no_host_copy):
  """Scalars, replicated leaves, numpy leaves and a single-device source."""
  src = NamedSharding(make_mesh(1, 4, 1, devices[:4]), P())
  dst = NamedSharding(make_mesh(1, 1, 2, devices[6:]), P())
  tree = {"scalar": jax.device_put(np.float32(3.5), src),
          "one_device": jax.device_put(np.arange(12.0).reshape(4, 3), devices[1]),
          "host": np.ones((2, 2), np.int32)}
  shardings = {"scalar": dst, "one_device": NamedSharding(dst.mesh, P("tensor")), "host": dst}
  out = reshard(tree, shardings)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))
    assert out[k].sharding == shardings[k]


def test_several_processes_not_implemented(devices, monkeypatch):
  class Remote:  # stands in for a leaf with shards on another process's devices
    is_fully_addressable = False

  dst = NamedSharding(make_mesh(1, 1, 4, devices[4:]), P())
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(NotImplementedError, match="one process only"):
    reshard([Remote()], [dst])


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_benchmark_quick():
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("XLA_FLAGS", None)  # the benchmark sets its own 8 host devices
  run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "reshard.py"), "--quick",
                        "--repeats", "1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(run.stdout)
  assert result["met"] is True and result["outputs_equal"] is True
  assert result["host_copy_calls_reshard"] == 0 and result["host_copy_calls_gather"] > 0


@pytest.mark.parametrize("tensor", [1, 2])
def test_publish_local_lays_params_out_on_the_process_rollout_mesh(tensor):
  """`publish_local` (several processes' rollout copies; here one process, so the stacked mesh is
  its own): the values of the train-mesh params, on this process's devices as a (4 / t, 1, t)
  mesh, split over 'tensor' by the parameter rules, and never the train step's buffers."""
  from jaxrl.parallel import distributed

  train = make_mesh(1, 4, 1, jax.devices()[:4])
  params = _params(train)
  local = distributed.local_mesh(train, tensor)
  assert dict(local.shape) == {"data": 4 // tensor, "fsdp": 1, "tensor": tensor}
  out = distributed.publish_local(params, train, local)
  want = param_shardings(params, local)
  split = 0
  for x, y, s in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(want)):
    assert y.sharding == s
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert {b.data.unsafe_buffer_pointer() for b in y.addressable_shards}.isdisjoint(
        b.data.unsafe_buffer_pointer() for b in x.addressable_shards)
    split += not y.sharding.is_fully_replicated
  assert (split > 0) == (tensor > 1)
