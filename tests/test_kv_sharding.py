"""The KV cache on a mesh (`parallel.sharding.kv_cache_spec` / `constrain_kv_cache`): rows over
'data', kv heads over 'tensor', a dim they do not divide replicated; the static sampler's and
the slot engine's caches come out so on an 8-device rollout mesh, each device holds 1/8 of the
keys and values, and the tokens are those of one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import tiny_model_config
from jaxrl.models import KVCache, init_model
from jaxrl.parallel import make_mesh, param_shardings
from jaxrl.parallel.sharding import (BATCH_AXES, ROLLOUT_ROW_AXES, kv_cache_shardings,
                                     kv_cache_spec, mesh_of)
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.static_sampler import make_sampler
from jaxrl.rollout.samplers import rows_over

# tiny_model_config: 2 layers, 2 kv heads of 8 dims.
L, K, DH = 2, 2, 8
G, N = 2, 6
# Four left-padded prompts -> P * G = 8 rows; data 4 splits them 2 per shard.
PROMPTS = np.array([[0, 0, 3, 4, 6], [0, 7, 8, 9, 10], [1, 2, 3, 4, 6], [0, 0, 0, 11, 12]],
                   np.int32)
EOS = (5, 17)


def test_cache_spec_splits_rows_and_heads_or_replicates_what_does_not_divide():
  sizes = {"data": 4, "fsdp": 1, "tensor": 2}
  # Stacked keys [L, B, K, Dh, S] and per-layer values [B, K, S, Dh]: rows then heads.
  assert kv_cache_spec((L, 8, K, DH, 16), sizes, ROLLOUT_ROW_AXES) == P(None, "data", "tensor")
  assert kv_cache_spec((8, K, 16, DH), sizes, ROLLOUT_ROW_AXES) == P("data", "tensor")
  assert kv_cache_spec((8, 16), sizes, ROLLOUT_ROW_AXES) == P("data")  # the validity mask
  # 6 rows on data 4: rows replicated, heads still split; 3 kv heads on tensor 2: replicated.
  assert kv_cache_spec((L, 6, K, DH, 16), sizes, ROLLOUT_ROW_AXES) == P(None, None, "tensor")
  assert kv_cache_spec((L, 8, 3, DH, 16), sizes, ROLLOUT_ROW_AXES) == P(None, "data")
  # The trainer's rows go over data x fsdp: 8 rows on 2 x 2 split, 6 do not (all or nothing).
  train = {"data": 2, "fsdp": 2, "tensor": 1}
  assert kv_cache_spec((L, 8, K, DH, 16), train, BATCH_AXES) == P(None, ("data", "fsdp"))
  assert kv_cache_spec((L, 6, K, DH, 16), train, BATCH_AXES) == P()
  # Axes of size 1 are left out: a pure-fsdp mesh splits no rollout row; one device: P().
  assert kv_cache_spec((L, 8, K, DH, 16), {"data": 1, "fsdp": 8, "tensor": 1},
                       ROLLOUT_ROW_AXES) == P()
  assert kv_cache_spec((8, 16), {"data": 1, "fsdp": 1, "tensor": 1}) == P()


def _device_bytes(tree, device) -> int:
  """Bytes of `tree`'s leaves held by one device (what it actually allocated)."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def _check_split(cache: KVCache, mesh, rows: int, slots: int):
  """Rows over data (4), kv heads over tensor (2): each device holds 1/8 of the keys and values
  and 1/4 of the validity mask, by sharding and by the bytes it holds."""
  want = kv_cache_shardings(cache, mesh)
  for x, sh in zip(jax.tree.leaves(cache), jax.tree.leaves(want)):
    assert x.sharding.is_equivalent_to(sh, x.ndim), (x.shape, x.sharding, sh)
  assert cache.k.sharding.spec == P(None, "data", "tensor")
  assert cache.k.sharding.shard_shape(cache.k.shape) == (L, rows // 4, K // 2, DH, slots)
  assert cache.v.sharding.shard_shape(cache.v.shape) == (L, rows // 4, K // 2, slots, DH)
  assert cache.valid.sharding.shard_shape(cache.valid.shape) == (rows // 4, slots)
  kv = 2 * L * rows * K * DH * slots * 4  # f32 keys + values, whole
  # Unsharded every device held kv + rows * slots (bool mask) bytes; now 1/8 and 1/4 of them.
  assert _device_bytes(cache, jax.devices()[0]) == kv // 8 + rows * slots // 4


@pytest.fixture(scope="module")
def setup(devices):
  cfg = tiny_model_config()
  graphdef, params = init_model(cfg, seed=0)
  mesh = make_mesh(4, 1, 2, devices)  # a rollout mesh: rows over data, tensor-parallel params
  on_mesh = jax.device_put(params, param_shardings(params, mesh))
  sample = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0)
  # The one-device result every mesh run must reproduce.
  ref = sample(params, PROMPTS, PROMPTS > 0, jax.random.key(1), np.arange(8) + 100, 0.8)
  return graphdef, params, mesh, on_mesh, sample, ref


# Compiles the sampler on one device (the fixture) and on the mesh: ~26 s on 2 loaded cores.
@pytest.mark.slow
def test_static_sampler_cache_is_split_over_the_rollout_mesh(setup):
  _, _, mesh, on_mesh, sample, ref = setup
  assert mesh_of(on_mesh) is mesh  # what `generate` splits the cache over
  # As the trainer runs it: rows over 'data' (`rows_over`), params on the mesh.
  out = rows_over(mesh, sample)(on_mesh, PROMPTS, PROMPTS > 0, jax.random.key(1),
                                np.arange(8) + 100, 0.8)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.mask, ref.mask)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  assert int(ref.lengths.min()) < N  # some row ended early on EOS: the stop test ran too

  # Prefill's cache (what decode then carries and donates) and decode's final cache.
  by_rows = NamedSharding(mesh, P("data"))
  prompts, valid = (jax.device_put(x, by_rows) for x in (PROMPTS, PROMPTS > 0))
  cache, first_logits, lens = sample.prefill(on_mesh, prompts, valid, mesh=mesh)
  _check_split(cache, mesh, rows=8, slots=5 + N)
  decoded, cache = sample.decode(on_mesh, cache, first_logits, lens, jax.random.key(1),
                                 jax.device_put(np.arange(8, dtype=np.int32) + 100, by_rows),
                                 jnp.float32(0.8), jnp.int32(0), jnp.float32(1.0), mesh=mesh)
  np.testing.assert_array_equal(decoded.tokens, ref.tokens)
  _check_split(cache, mesh, rows=8, slots=5 + N)

  # 3 rows on data 4: the rows fall back to replicated, the kv heads stay split.
  odd = make_sampler(setup[0], num_samples=3, max_new_tokens=N, eos_id=EOS, pad_id=0)
  cache, _, _ = odd.prefill(on_mesh, PROMPTS[:1], PROMPTS[:1] > 0, mesh=mesh)
  assert cache.k.sharding.shard_shape(cache.k.shape) == (L, 3, K // 2, DH, 5 + N)
  assert cache.valid.sharding.is_fully_replicated


# Compiles the engine's driver programs on the mesh: ~17 s on 2 loaded cores, + the fixture.
@pytest.mark.slow
def test_engine_slot_cache_is_split_over_the_rollout_mesh(setup):
  graphdef, _, mesh, on_mesh, _, ref = setup
  engine = Engine(graphdef, num_slots=8, max_prompt_len=5, max_new_tokens=N, eos_id=EOS,
                  pad_id=0, prefill_buckets=(5,), steps_per_dispatch=3, compact=False)
  prompts = [p[p > 0].tolist() for p in PROMPTS]
  # The engine draws the static sampler's tokens for the same keys (test_engine); on the mesh
  # too, so it matches the one-device static result.
  out = engine.run(on_mesh, prompts, np.arange(8) + 100, jax.random.key(1), temperature=0.8,
                   group_size=G)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)

  # The slot cache through the driver's programs as `run` dispatched them (all compiled now).
  state = engine.init_decode_state(on_mesh, mesh=mesh)
  _check_split(state.cache, mesh, rows=8, slots=5 + N)
  pool = engine.fns.init_pool(on_mesh, mesh=mesh)
  admit = np.zeros((5, 8), np.int32)
  admit[0], admit[2] = np.arange(8), np.arange(8) + 100
  pool, state = engine.fns.insert_many(pool, state, admit, np.ones((2, 8), np.float32),
                                       np.int32(8), jax.random.key(1), mesh=mesh)
  _check_split(state.cache, mesh, rows=8, slots=5 + N)
  state, _ = engine.fns.step(on_mesh, state, np.arange(8, dtype=np.int32), np.int32(0),
                             np.int32(3), groups=((8, None),), mesh=mesh)
  _check_split(state.cache, mesh, rows=8, slots=5 + N)
  # The prefix pool keeps its rows whole (an insert reads its row on every device) and splits
  # the kv heads.
  assert pool.cache.k.sharding.spec == P(None, None, "tensor")
