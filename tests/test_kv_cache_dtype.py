"""`rollout.kv_cache_dtype`: the sampler's KV cache stored in float32, bfloat16 or an 8-bit float,
read back upcast; "auto" on CPU is the compute dtype (today's sampler, bit for bit)."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from conftest import tiny_model_config
from jaxrl.kernels import decode_attention as da
from jaxrl.models import init_model
from jaxrl.models.model_config import KVCache, resolve_kv_cache_dtype
from jaxrl.models.transformer import abstract_model
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.precision import rollout_model
from jaxrl.rollout.static_sampler import make_sampler

LP, N, G = 8, 10, 2
EOS = (1,)
PROMPTS = [[2, 3, 4, 5, 6, 7], [8, 9, 10], [11], [12, 13, 14, 15]]
ROWS = len(PROMPTS) * G


def _left_pad(prompts):
  tokens = np.zeros((len(prompts), LP), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, LP - len(p):] = p
  return tokens, tokens > 0


@functools.lru_cache(maxsize=None)
def _params():
  # Built once: every cache dtype reads the same float32 weights.
  return init_model(tiny_model_config(vocab_size=64, init_std=0.3), 0)[1]


def _sampler(kv, impl="dense"):
  graphdef, _ = abstract_model(tiny_model_config(vocab_size=64, init_std=0.3, kv_cache_dtype=kv,
                                                 decode_attention=impl))
  return make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0)


@functools.lru_cache(maxsize=None)
def _cached(kv, impl, sampling):
  gen = _sampler(kv, impl)
  return gen(_params(), *_left_pad(PROMPTS), jax.random.key(3), np.arange(ROWS), **dict(sampling))


def _run(kv, impl="dense", **sampling):
  """The sampler's output (one compile per cache dtype, implementation and setting)."""
  return _cached(kv, impl, tuple(sorted((sampling or dict(temperature=0.0)).items())))


def _agreement(out, ref):
  """(fraction of tokens equal, max log-prob error over each row's tokens before its first
  difference: after one the rows continue from different contexts)."""
  t, r = np.asarray(out.tokens), np.asarray(ref.tokens)
  same_prefix = np.cumprod(t == r, axis=1).astype(bool) & np.asarray(ref.mask)
  err = np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs))[same_prefix]
  return (t == r).mean(), err.max()


def test_auto_resolves_per_backend():
  assert resolve_kv_cache_dtype("auto", "float32", "cpu") == "float32"
  assert resolve_kv_cache_dtype("auto", "bfloat16", "cpu") == "bfloat16"
  assert resolve_kv_cache_dtype("auto", "float32", "gpu") == "bfloat16"
  assert resolve_kv_cache_dtype("auto", "float32", "tpu") == "bfloat16"
  assert resolve_kv_cache_dtype(None, "float32", "gpu") == "float32"  # the trainer's model
  assert resolve_kv_cache_dtype("float8_e5m2", "float32", "cpu") == "float8_e5m2"
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    tiny_model_config(kv_cache_dtype="fp8")


def test_rollout_model_on_cpu_is_the_trainers_model():
  # The default run: the sampler's model config is the trainer's own object (same graphdef).
  model_cfg = tiny_model_config()
  cfg = ConfigDict({"rollout": {"dtype": "auto", "kv_cache_dtype": "auto"},
                    "model": {"param_dtype": "float32", "dtype": "float32"}})
  assert rollout_model(cfg, model_cfg, "cpu") is model_cfg
  assert rollout_model(cfg, model_cfg, "gpu").kv_cache_dtype == "bfloat16"
  cfg.rollout.kv_cache_dtype = "float8_e4m3fn"
  assert rollout_model(cfg, model_cfg, "cpu").kv_cache_dtype == "float8_e4m3fn"


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_caches_are_of_that_dtype(kv):
  # The static sampler's prefill cache and the engine's slot cache, through their public seams,
  # traced for their types (jax.eval_shape: the dtypes and shapes a run returns, no compile).
  gen = _sampler(kv)
  cache, _, _ = jax.eval_shape(gen.prefill, _params(), *_left_pad(PROMPTS))
  assert cache.k.dtype == cache.v.dtype == jnp.dtype(kv)
  engine = Engine(abstract_model(tiny_model_config(vocab_size=64, kv_cache_dtype=kv))[0],
                  num_slots=2, max_prompt_len=LP, max_new_tokens=N, eos_id=EOS, pad_id=0)
  state = jax.eval_shape(engine.init_decode_state, _params())
  assert state.cache.k.dtype == state.cache.v.dtype == jnp.dtype(kv)
  per_position_row = sum(x.dtype.itemsize * x.size for x in (cache.k, cache.v)) // (
      cache.valid.size)
  cfg = tiny_model_config()
  assert per_position_row == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * \
      jnp.dtype(kv).itemsize


def test_auto_on_cpu_is_todays_sampler_bit_for_bit():
  # None (the trainer's model: the compute dtype) and "auto" on CPU give identical outputs.
  for sampling in (dict(temperature=0.0),):
    ref, auto = _run(None, **sampling), _run("auto", **sampling)
    np.testing.assert_array_equal(np.asarray(auto.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(auto.logprobs), np.asarray(ref.logprobs))


# Measured on this model (tests/test_kv_cache_dtype.py; init_std 0.3, greedy, 8 rows x 10
# tokens): bfloat16 keeps every token, log-probs within 0.03; the 8-bit caches change tokens
# (3 mantissa bits for e4m3, 2 for e5m2), so only agreement is bounded, loosely.
BOUNDS = {"bfloat16": (1.0, 0.05), "float8_e4m3fn": (0.5, None), "float8_e5m2": (0.1, None)}


@pytest.mark.parametrize("impl", ["dense", pytest.param("xla", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kv", sorted(BOUNDS))
def test_narrow_caches_against_a_float32_cache(kv, impl):
  ref, out = _run("float32", impl), _run(kv, impl)
  agree, err = _agreement(out, ref)
  min_agree, max_err = BOUNDS[kv]
  assert agree >= min_agree, (kv, agree)
  if max_err is not None:
    assert err <= max_err, (kv, err)
  assert err > 0  # the cache really is narrower: the log-probs moved
  assert np.isfinite(np.asarray(out.logprobs)).all()


@pytest.mark.slow
def test_engine_honours_the_cache_dtype():
  # The continuous engine with a bfloat16 cache draws the static sampler's tokens (same keys).
  graphdef, _ = init_model(tiny_model_config(vocab_size=64, init_std=0.3,
                                             kv_cache_dtype="bfloat16"), 0)
  engine = Engine(graphdef, num_slots=3, max_prompt_len=LP, max_new_tokens=N, eos_id=EOS,
                  pad_id=0, prefill_buckets=(4, 8), steps_per_dispatch=3)
  out = engine.run(_params(), PROMPTS, np.arange(ROWS), jax.random.key(3), group_size=G,
                   temperature=0.0)
  ref = _run("bfloat16")
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)


def test_bad_value_is_one_line():
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train",
                         "--config.rollout.kv_cache_dtype=fp8"], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode != 0
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert lines == [lines[0]] and lines[0].startswith("jaxrl: config.rollout.kv_cache_dtype"), \
      proc.stderr


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_tpu"])
@pytest.mark.parametrize("kv", ["float8_e4m3fn", "bfloat16"])
def test_decode_attention_upcasts_a_narrow_cache(kv, impl):
  # Each implementation on a cache stored in `kv` equals the float32 reference on the same
  # (rounded) values upcast: the narrow cache is read as it is, not re-rounded elsewhere.
  b, kh, g, d, s = 2, 2, 2, 16, 32
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, kh, g, d), jnp.float32)
  k_t = jax.random.normal(keys[1], (b, kh, d, s)).astype(kv)
  v = jax.random.normal(keys[2], (b, kh, s, d)).astype(kv)
  valid = jnp.ones((b, s), bool)
  lengths = jnp.array([s, s // 2], jnp.int32)
  want = da.decode_attention(q, k_t.astype(jnp.float32), v.astype(jnp.float32), valid,
                             lengths, implementation="reference")
  got = da.decode_attention(q, k_t, v, valid, lengths, implementation=impl, block_k=16)
  # bf16 products for a bf16 cache (the query rounded to it); f32 ones for an 8-bit cache.
  tol = 2e-2 if kv == "bfloat16" else 1e-5
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)
  assert got.dtype == jnp.float32
