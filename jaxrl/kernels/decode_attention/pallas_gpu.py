"""Split-K ("flash-decoding") single-token decode attention as a Pallas GPU (Triton) kernel;
`interpret` runs it on CPU for tests.

One query token per row leaves little parallelism in `(B, K)` alone (a few dozen programs on a
GPU with 132 SMs), so the key blocks of each row are cut into `splits` slices: grid
`(B, K, splits)`, program `(b, h, c)` walks the key blocks of slice `c` that lie below the row's
length (a loop with per-program bounds: blocks past the length are never loaded) with an online
softmax over the `G` query heads of kv head `h`, and writes that slice's float32 `m`, `l` and
unnormalised `acc`. XLA merges the slices (`G (Dh + 2)` floats per row, head and slice):

    M = max_c m_c,   out = sum_c e^{m_c - M} acc_c / sum_c e^{m_c - M} l_c

An empty slice has `l = 0`, `acc = 0`; masked slots weigh exactly 0, so a row that attends
nothing returns 0 (`reference`: the mean of all S values).

Triton tiles are powers of two, at least 16 on a dot's sides: the query heads are zero padded
to `max(16, next pow2(G))` rows (a copy of q only); `Dh` must be a power of two (64, 128: every
model here) or the cache is padded (a copy); S not a multiple of `bk` is zero padded (a copy:
size the cache's slots as a multiple of `block_k` to avoid it). Products take the cache's dtype
with float32 accumulation; f32 dots run in TF32 unless `jax_default_matmul_precision` asks for
IEEE f32, as XLA GPU does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.core import platform
from jaxrl.kernels.decode_attention.reference import MASK_VALUE, operand_dtype

# 64 slots: a [128, 64] bf16 key tile and a [16, 64] float32 score tile per step stay in
# registers / shared memory at 4 warps.
DEFAULT_BLOCK_K = 64
# Enough programs to fill an H100 (132 SMs) a few times over when rows are few.
MIN_PROGRAMS = 512
_MIN_DOT = 16


def _pow2_ceil(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def plan(b: int, kh: int, s_len: int, block_k: int | None) -> tuple[int, int, int, int]:
  """`(bk, padded S, splits, blocks per split)` for `b` rows of `kh` kv heads over `s_len`."""
  bk = _pow2_ceil(min(int(block_k or DEFAULT_BLOCK_K), max(s_len, _MIN_DOT)))
  bk = max(bk, _MIN_DOT)
  blocks = -(-s_len // bk)
  want = max(1, min(blocks, -(-MIN_PROGRAMS // (b * kh))))
  per = -(-blocks // want)
  return bk, blocks * bk, -(-blocks // per), per


def _precision(x):
  if x.dtype == jnp.float32 and jax.config.jax_default_matmul_precision in ("highest",
                                                                            "float32"):
    return lax.Precision.HIGHEST
  return None


def _kernel(len_ref, q_ref, k_ref, v_ref, valid_ref, m_ref, l_ref, acc_ref, *, scale, bk, per):
  length = len_ref[...]  # [1]
  lo = pl.program_id(2) * per
  hi = jnp.minimum(lo + per, lax.div(length[0] + bk - 1, bk))  # lengths are >= 0
  q = q_ref[...]  # [Gp, Dh]

  def body(j, carry):
    m, l, acc = carry
    start = pl.multiple_of(j * bk, bk)
    # The products take q's dtype (`operand_dtype`): 8-bit cache blocks are upcast as loaded.
    kb = k_ref[:, pl.ds(start, bk)].astype(q.dtype)
    s = jnp.dot(q, kb, preferred_element_type=jnp.float32,
                precision=_precision(q)) * scale  # [Gp, bk]
    slots = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    keep = (valid_ref[pl.ds(start, bk)][None, :] != 0) & (slots < length[0])
    s = jnp.where(keep, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(keep, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    vb = v_ref[pl.ds(start, bk), :].astype(q.dtype)
    pv = jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32,
                 precision=_precision(vb))
    return m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True), acc * alpha + pv

  gp, d = q.shape
  m, l, acc = lax.fori_loop(lo, hi, body, (jnp.full((gp, 1), MASK_VALUE, jnp.float32),
                                           jnp.zeros((gp, 1), jnp.float32),
                                           jnp.zeros((gp, d), jnp.float32)))
  m_ref[...] = m
  l_ref[...] = l
  acc_ref[...] = acc


def _default_interpret():
  backend = platform.current()
  if backend == "gpu":
    return False
  if backend == "cpu":
    return True
  raise ValueError(f"decode attention 'pallas_gpu' compiles for CUDA GPUs only (backend is "
                   f"{backend!r}): use 'pallas_tpu' or 'xla' there, or pass interpret=True")


def _pad(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def decode_attention(q, k_t, v, valid, lengths, *, scale: float, out_dtype,
                     block_k: int | None = None, interpret=None, **_):
  """q `[B, K, G, Dh]`, k_t `[B, K, Dh, S]`, v `[B, K, S, Dh]` -> `[B, K, G, Dh]`."""
  interpret = _default_interpret() if interpret is None else interpret
  b, kh, g, d = q.shape
  s_len = k_t.shape[-1]
  bk, sp, splits, per = plan(b, kh, s_len, block_k)
  gp, dp = max(_MIN_DOT, _pow2_ceil(g)), max(_MIN_DOT, _pow2_ceil(d))
  qp = _pad(_pad(q.astype(operand_dtype(q.dtype, k_t.dtype)), 2, gp), 3, dp)
  k_t, v = _pad(_pad(k_t, 2, dp), 3, sp), _pad(_pad(v, 3, dp), 2, sp)
  flags = _pad(valid.astype(jnp.int32), 1, sp)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton
    params = pltriton.CompilerParams(num_warps=4, num_stages=2)
  part = lambda *tail: jax.ShapeDtypeStruct((b, kh, splits, gp, *tail), jnp.float32)
  out_spec = lambda last: pl.BlockSpec((None, None, None, gp, last),
                                       lambda bi, h, c: (bi, h, c, 0, 0))
  m, l, acc = pl.pallas_call(
      functools.partial(_kernel, scale=scale, bk=bk, per=per),
      out_shape=(part(1), part(1), part(dp)),
      grid=(b, kh, splits),
      in_specs=[
          pl.BlockSpec((None, 1), lambda bi, h, c: (bi, 0)),
          pl.BlockSpec((None, None, gp, dp), lambda bi, h, c: (bi, h, 0, 0)),
          pl.BlockSpec((None, None, dp, sp), lambda bi, h, c: (bi, h, 0, 0)),
          pl.BlockSpec((None, None, sp, dp), lambda bi, h, c: (bi, h, 0, 0)),
          pl.BlockSpec((None, sp), lambda bi, h, c: (bi, 0)),
      ],
      out_specs=(out_spec(1), out_spec(1), out_spec(dp)),
      compiler_params=params,
      interpret=interpret,
      name="decode_attention_gpu",
  )(lengths.astype(jnp.int32)[:, None], qp, k_t, v, flags)
  top = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp(m - top)  # [B, K, splits, Gp, 1]
  l_all = jnp.sum(w * l, axis=2)
  o = jnp.sum(w * acc, axis=2) / jnp.where(l_all > 0, l_all, 1.0)
  return o[:, :, :g, :d].astype(out_dtype)
