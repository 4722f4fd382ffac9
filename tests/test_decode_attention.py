"""Single-token decode attention (`jaxrl.kernels.decode_attention`): `xla`, `pallas_tpu` and
`pallas_gpu` (both in Pallas' interpreter here) against the dense `reference`, which is
`jaxrl.models.layers.decode_attention`'s math; slots past a row's length never read; the Pallas
kernels lowered for a TPU (Mosaic) and a CUDA GPU (Triton)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.core import names
from jaxrl.kernels import decode_attention as da
from jaxrl.models.layers import decode_attention as layers_decode_attention

KERNELS = ("xla", "pallas_tpu", "pallas_gpu")
BLOCK = 16


def make_inputs(dtype=jnp.float32, b=3, kh=2, g=3, d=16, s=40, seed=0):
  """Ragged rows as the engine leaves them: row b's prompt left-padded by `pad[b]` slots, filled
  up to `lengths[b]`; S = 40 is not a multiple of the 16-slot blocks (the last block is short
  or padded), and one row fills every slot."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, kh, g, d)), dtype)
  k_t = jnp.asarray(rng.normal(size=(b, kh, d, s)), dtype)
  v = jnp.asarray(rng.normal(size=(b, kh, s, d)), dtype)
  lengths = jnp.array([5, s, 23][:b], jnp.int32)
  pad = jnp.array([2, 0, 7][:b])
  slots = jnp.arange(s)[None]
  valid = (slots >= pad[:, None]) & (slots < lengths[:, None])
  return q, k_t, v, valid, lengths


def rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def test_registry_is_the_names_registry():
  assert da.IMPLEMENTATIONS == names.DECODE_ATTENTION_KERNELS
  assert da.default_impl() == "xla"


def test_golden_value():
  # Dh = 1, scale 1, q = 1: scores are the keys. Slots 0, 1 attended with scores 0 and ln 3, so
  # weights 1/4, 3/4 and out = 4/4 + 3 * 8/4 = 7. Slot 2 is invalid, slot 3 past the length;
  # an implementation that attended either would be pulled to ~1000.
  q = jnp.ones((1, 1, 1, 1))
  k_t = jnp.array([0.0, math.log(3.0), 50.0, 50.0]).reshape(1, 1, 1, 4)
  v = jnp.array([4.0, 8.0, 1000.0, 1000.0]).reshape(1, 1, 4, 1)
  valid = jnp.array([[True, True, False, True]])
  for impl in ("reference",) + KERNELS:
    out = da.decode_attention(q, k_t, v, valid, jnp.array([3]), scale=1.0,
                              implementation=impl, block_k=2)
    np.testing.assert_allclose(np.asarray(out).ravel(), [7.0], rtol=1e-6, err_msg=impl)


def test_reference_is_the_models_decode_attention():
  # The mask `layers.decode_attention` takes broadcasts over [B, K, G, 1, S]; its result is the
  # reference's for the same valid & (slot < length) slots, bit for bit.
  q, k_t, v, valid, lengths = make_inputs()
  mask = valid & (jnp.arange(valid.shape[1])[None] < lengths[:, None])
  want = layers_decode_attention(q, k_t, v, mask[:, None, None, None, :], 0.25, jnp.float32)
  got = da.decode_attention(q, k_t, v, valid, lengths, scale=0.25, implementation="reference")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_matches_reference(impl, dtype, tol):
  q, k_t, v, valid, lengths = make_inputs(dtype)
  ref = da.decode_attention(q, k_t, v, valid, lengths, implementation="reference")
  out = da.decode_attention(q, k_t, v, valid, lengths, implementation=impl, block_k=BLOCK)
  assert out.dtype == dtype and out.shape == q.shape
  assert rel_err(out, ref) < tol


@pytest.mark.parametrize("impl", KERNELS)
def test_one_block_and_no_lengths(impl):
  # block_k >= S: one block per row; lengths=None is S for every row.
  q, k_t, v, valid, _ = make_inputs(s=32)
  ref = da.decode_attention(q, k_t, v, valid, implementation="reference")
  out = da.decode_attention(q, k_t, v, valid, implementation=impl, block_k=64)
  assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("impl", KERNELS)
def test_blocks_past_the_length_are_not_read(impl):
  # NaN in every whole block past what the implementation may read: a row's last filled block
  # for the Pallas kernels (their grids / loops skip by row), the longest row's for `xla` (one
  # loop for the batch). Reading any of them would make the row NaN (0 * NaN in p @ v).
  q, k_t, v, valid, _ = make_inputs(s=48)
  lengths = jnp.array([5, 30, 23], jnp.int32)  # xla reads 2 blocks; pallas 1, 2, 2 by row
  valid = valid & (jnp.arange(48)[None] < lengths[:, None])
  ref = da.decode_attention(q, k_t, v, valid, lengths, implementation="reference")
  per_row = lengths if impl != "xla" else jnp.full_like(lengths, jnp.max(lengths))
  read = -(-per_row // BLOCK) * BLOCK
  past = (jnp.arange(48)[None] >= read[:, None])  # [B, S]
  k_nan = jnp.where(past[:, None, None, :], jnp.nan, k_t)
  v_nan = jnp.where(past[:, None, :, None], jnp.nan, v)
  assert bool(jnp.any(past))  # rows 0 and 2 (lengths 5, 23) leave whole blocks unread
  out = da.decode_attention(q, k_nan, v_nan, valid, lengths, implementation=impl,
                            block_k=BLOCK)
  assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("impl", KERNELS)
def test_row_that_attends_nothing_is_zero(impl):
  # The reference averages all S values there (today's model behaviour); the kernels skip every
  # block of an empty row and return 0. Neither is read by a caller; the other rows are exact.
  q, k_t, v, valid, lengths = make_inputs()
  valid = valid.at[0].set(False)
  out = da.decode_attention(q, k_t, v, valid, lengths, implementation=impl, block_k=BLOCK)
  ref = da.decode_attention(q, k_t, v, valid, lengths, implementation="reference")
  np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
  np.testing.assert_allclose(np.asarray(ref[0]), np.broadcast_to(
      np.asarray(v[0]).mean(axis=1)[:, None], ref[0].shape), rtol=1e-5, atol=1e-6)
  assert rel_err(out[1:], ref[1:]) < 1e-5


def test_xla_reads_the_cache_in_its_dtype():
  # No float32 copy of a bf16 cache: the products take bf16 operands (f32 results), and no
  # convert from a bf16 cache-sized array to f32 appears in the program.
  q, k_t, v, valid, lengths = make_inputs(jnp.bfloat16, s=64)
  f = functools.partial(da.decode_attention, implementation="xla", block_k=BLOCK)
  text = jax.jit(f).lower(q, k_t, v, valid, lengths).as_text()
  assert "tensor<3x2x16x64xf32>" not in text and "tensor<3x2x64x16xf32>" not in text
  assert "bf16" in text


def test_traced_lengths_one_program():
  # lengths are data: the decode loop's every step reuses one compiled program.
  q, k_t, v, valid, lengths = make_inputs()
  f = jax.jit(functools.partial(da.decode_attention, implementation="xla", block_k=BLOCK))
  for shift in (0, 1, 8):  # 8: the longest row (40 -> 32) needs one block fewer
    short = jnp.maximum(lengths - shift, 4)
    ref = da.decode_attention(q, k_t, v, valid, short, implementation="reference")
    assert rel_err(f(q, k_t, v, valid, short), ref) < 1e-5
  assert f._cache_size() == 1


def test_bad_arguments():
  q, k_t, v, valid, lengths = make_inputs()
  with pytest.raises(ValueError, match="unknown decode attention implementation"):
    da.decode_attention(q, k_t, v, valid, implementation="flash")
  with pytest.raises(ValueError, match="do not fit"):
    da.decode_attention(q, k_t.transpose(0, 1, 3, 2), v, valid)
  with pytest.raises(ValueError, match="valid must be"):
    da.decode_attention(q, k_t, v, valid[:, :-1])
  with pytest.raises(ValueError, match="lengths must be"):
    da.decode_attention(q, k_t, v, valid, lengths[:2])


# Qwen2.5-0.5B-like heads (H = 14, K = 2, so G = 7; Dh = 64) over a 4,096-slot cache.
_LOWER_SHAPE = (8, 2, 7, 64, 4096)


def _structs(dtype, b, kh, g, d, s):
  st = jax.ShapeDtypeStruct
  return [st((b, kh, g, d), dtype), st((b, kh, d, s), dtype), st((b, kh, s, d), dtype),
          st((b, s), bool), st((b,), jnp.int32)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_tpu_lowers_for_tpu(dtype):
  # Lowering (not compiling) for a TPU runs on any machine: the kernel becomes Mosaic inside a
  # `tpu_custom_call`; a primitive without a Mosaic rule (jnp's integer floor division in the
  # index maps, for one) fails here.
  f = functools.partial(da.decode_attention, implementation="pallas_tpu", interpret=False)
  text = jax.export.export(jax.jit(f), platforms=["tpu"])(
      *_structs(dtype, *_LOWER_SHAPE)).mlir_module()
  assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
  assert "decode_attention_tpu" in text


def test_pallas_tpu_compiled_blocks_are_multiples_of_128():
  f = functools.partial(da.decode_attention, implementation="pallas_tpu", interpret=False,
                        block_k=BLOCK)
  with pytest.raises(ValueError, match="multiples of 128 when compiled"):
    jax.export.export(jax.jit(f), platforms=["tpu"])(*_structs(jnp.bfloat16, *_LOWER_SHAPE))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_gpu_lowers_to_triton(dtype):
  # Lowering for CUDA runs on any machine: Pallas' Triton lowering accepts the kernel only if
  # every tile is a power of two (G = 7 padded to 16) and the per-program loop bounds lower.
  f = functools.partial(da.decode_attention, implementation="pallas_gpu", interpret=False)
  text = jax.export.export(
      jax.jit(f), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(*_structs(dtype, *_LOWER_SHAPE)).mlir_module()
  assert 'name = "decode_attention_gpu"' in text


@pytest.mark.parametrize("impl", KERNELS)
def test_under_vmap_over_slots(impl):
  # The engine decodes each slot under `vmap` (one row, its own cache index): each call sees
  # B = 1 and a batched length. The result is the batched call's.
  q, k_t, v, valid, lengths = make_inputs()
  one = lambda q, k, v, ok, n: da.decode_attention(q[None], k[None], v[None], ok[None], n[None],
                                                   implementation=impl, block_k=BLOCK)[0]
  out = jax.vmap(one)(q, k_t, v, valid, lengths)
  ref = da.decode_attention(q, k_t, v, valid, lengths, implementation="reference")
  assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("impl,platform,marker", [
    ("pallas_tpu", "tpu", "@tpu_custom_call"), ("pallas_gpu", "cuda", "decode_attention_gpu")])
def test_pallas_lowers_under_vmap_over_slots(impl, platform, marker):
  # The engine's per-slot `vmap` batches the kernel (its batching rule adds a grid axis, the
  # scalar-prefetched lengths included); that program must still lower for the accelerator.
  one = lambda q, k, v, ok, n: da.decode_attention(q[None], k[None], v[None], ok[None], n[None],
                                                   implementation=impl, interpret=False)[0]
  text = jax.export.export(
      jax.jit(jax.vmap(one)), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(*_structs(jnp.bfloat16, *_LOWER_SHAPE)).mlir_module()
  assert marker in text
