"""Ragged single-token decode attention as a Pallas TPU (Mosaic) kernel; `interpret` runs it on
CPU for tests.

Grid `(B, K, S / bk)`: program `(b, h, j)` folds key block `j` of row `b`, kv head `h` into an
online softmax over the `G` query heads of that kv head (`m`, `l` `[G, 1]` and `acc` `[G, Dh]`
float32 in VMEM scratch, carried along `j`, the one "arbitrary" axis); the last `j` writes
`acc / l`. The rows' `lengths` are scalar-prefetched (in SMEM before the grid runs) so that:

- the block index maps clamp `j` to the row's last filled block: a block past the length maps
  to the block already in VMEM, and the pipeline issues no copy for an unchanged block index,
  so HBM traffic is the filled blocks only;
- the kernel body skips both matmuls on such a block (`pl.when(j * bk < length)`).

Scores are `q @ k_t` in the cache's dtype with float32 accumulation (`preferred_element_type`);
the weights are cast to the values' dtype for `p @ v`, as `reference` does. Masked slots weigh
exactly 0, so a row that attends nothing returns 0 (`reference`: the mean of all S values).

Blocks: `bk` a multiple of 128 when compiled (it is the lane axis of the keys `[Dh, bk]`, the
scores and the per-slot flags), or the whole S. With S a multiple of 128, `bk` shrinks to the
widest multiple of 128 that divides S (`plan_block`); otherwise S not a multiple of `bk` is zero
padded (a copy of the cache: size the cache's slots as a multiple of 128 to avoid it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.core import platform
from jaxrl.kernels.decode_attention.reference import MASK_VALUE, operand_dtype

# 512 slots: a bf16 [128, 512] key block and a [512, 128] value block are 128 KiB each, double
# buffered well inside VMEM; fewer grid steps than 128-slot blocks for the same bytes.
DEFAULT_BLOCK_K = 512
_LANES = 128


def plan_block(s_len: int, block_k: int | None, compiled: bool) -> tuple[int, int]:
  """`(bk, padded S)` for a cache of `s_len` slots."""
  bk = int(block_k or DEFAULT_BLOCK_K)
  if bk >= s_len:
    return s_len, s_len  # one block covering the whole row: any width is a legal block
  if compiled and bk % _LANES:
    raise ValueError(f"pallas_tpu decode blocks must be multiples of {_LANES} when compiled for "
                     f"TPU; got block_k={bk} (interpret=True takes any width)")
  if s_len % bk and bk % _LANES == 0 and s_len % _LANES == 0:
    # A block that divides S saves padding (copying) the whole cache on every call: the widest
    # multiple of 128 up to `bk` that does (768 slots at bk = 512: 384, not a pad to 1024).
    bk = max(w for w in range(_LANES, bk + 1, _LANES) if s_len % w == 0)
  return bk, -(-s_len // bk) * bk


def _kernel(len_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bk):
  b, j = pl.program_id(0), pl.program_id(2)
  length = len_ref[b]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(j * bk < length)
  def _block():
    od = q_ref.dtype  # the products' dtype (`operand_dtype`): 8-bit cache blocks upcast here
    s = jnp.dot(q_ref[...], k_ref[...].astype(od), preferred_element_type=jnp.float32) * scale
    slots = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    keep = (valid_ref[...] != 0) & (slots < length)  # [1, bk]
    s = jnp.where(keep, s, MASK_VALUE)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(keep, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(od), v_ref[...].astype(od),
                                                preferred_element_type=jnp.float32)
    m_sc[...] = m_new

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    l = l_sc[...]
    o_ref[...] = (acc_sc[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _default_interpret():
  backend = platform.current()
  if backend == "tpu":
    return False
  if backend == "cpu":
    return True
  raise ValueError(f"decode attention 'pallas_tpu' compiles for TPU only (backend is "
                   f"{backend!r}): use 'pallas_gpu' or 'xla' there, or pass interpret=True")


def decode_attention(q, k_t, v, valid, lengths, *, scale: float, out_dtype,
                     block_k: int | None = None, interpret=None, **_):
  """q `[B, K, G, Dh]`, k_t `[B, K, Dh, S]`, v `[B, K, S, Dh]` -> `[B, K, G, Dh]`."""
  from jax.experimental.pallas import tpu as pltpu
  interpret = _default_interpret() if interpret is None else interpret
  b, kh, g, d = q.shape
  s_len = k_t.shape[-1]
  bk, sp = plan_block(s_len, block_k, compiled=not interpret)
  if sp != s_len:
    k_t = jnp.pad(k_t, [(0, 0)] * 3 + [(0, sp - s_len)])
    v = jnp.pad(v, [(0, 0), (0, 0), (0, sp - s_len), (0, 0)])
    valid = jnp.pad(valid, [(0, 0), (0, sp - s_len)])
  lengths = jnp.clip(lengths, 0, s_len).astype(jnp.int32)
  flags = valid.astype(jnp.int32)[:, None, :]  # [B, 1, S]: slots on lanes

  def last(bi, j, lens):
    # The row's last filled block (block 0 for an empty row): later steps re-map to it. `lax.div`
    # (lengths are >= 0): Mosaic lowers jnp's floor division through `sign`, which needs a TPU.
    return jnp.minimum(j, jnp.maximum(lax.div(lens[bi] + bk - 1, bk) - 1, 0))

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, kh, sp // bk),
      in_specs=[
          pl.BlockSpec((None, None, g, d), lambda bi, h, j, lens: (bi, h, 0, 0)),
          pl.BlockSpec((None, None, d, bk), lambda bi, h, j, lens: (bi, h, 0, last(bi, j, lens))),
          pl.BlockSpec((None, None, bk, d), lambda bi, h, j, lens: (bi, h, last(bi, j, lens), 0)),
          pl.BlockSpec((None, 1, bk), lambda bi, h, j, lens: (bi, 0, last(bi, j, lens))),
      ],
      out_specs=pl.BlockSpec((None, None, g, d), lambda bi, h, j, lens: (bi, h, 0, 0)),
      scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                      pltpu.VMEM((g, d), jnp.float32)],
  )
  params = None if interpret else pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary"))
  return pl.pallas_call(
      functools.partial(_kernel, scale=scale, bk=bk),
      out_shape=jax.ShapeDtypeStruct((b, kh, g, d), out_dtype),
      grid_spec=grid_spec,
      compiler_params=params,
      interpret=interpret,
      name="decode_attention_tpu",
  )(lengths, q.astype(operand_dtype(q.dtype, k_t.dtype)), k_t, v, flags)
