"""Single-token decode attention in plain XLA: reads the cache in its own dtype, and only the
key blocks below the batch's longest row.

A `while` loop over key blocks of `block_k` slots runs `ceil(max(lengths) / block_k)` times
(a traced trip count, so one compiled program serves every decode step) and folds each block
into an online softmax (running max `m`, sum `l`, float32 accumulator). Each block is a
`dynamic_slice` of the cache, so slots past every row's length are never read; the products
take the cache's dtype (bf16 stays bf16) with float32 accumulation (`preferred_element_type`),
so no float32 copy of the cache is made; an 8-bit float cache is read in 8 bits and each block
upcast to the query's dtype for the products (`reference.operand_dtype`). When `block_k` does
not divide S the last block starts early (`dynamic_slice` clamps) and masks the slots the
previous block already covered.

Masked slots weigh exactly 0 (not `e^{MASK_VALUE - m}`), so a row that attends nothing ends
with `l = 0` and returns 0 rather than `reference`'s uniform average.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.kernels.decode_attention.reference import MASK_VALUE, operand_dtype, slot_mask

# 512 slots per block: [B, K, G, 512] float32 scores are small, and few loop trips per step.
DEFAULT_BLOCK_K = 512


def decode_attention(q, k_t, v, valid, lengths, *, scale: float, out_dtype,
                     block_k: int | None = None, **_):
  """q `[B, K, G, Dh]`, k_t `[B, K, Dh, S]`, v `[B, K, S, Dh]` -> `[B, K, G, Dh]`."""
  b, kh, g, d = q.shape
  s_len = k_t.shape[-1]
  bk = min(int(block_k or DEFAULT_BLOCK_K), s_len)
  mask = slot_mask(valid, lengths)  # [B, S]
  od = operand_dtype(q.dtype, k_t.dtype)
  qc = q.astype(od)  # the query is tiny; the cache keeps its dtype (8-bit blocks upcast as read)
  blocks = (jnp.max(lengths) + bk - 1) // bk

  def body(carry):
    j, m, l, acc = carry
    start = jnp.minimum(j * bk, s_len - bk)
    kb = lax.dynamic_slice_in_dim(k_t, start, bk, axis=3).astype(od)  # [B, K, Dh, bk]
    vb = lax.dynamic_slice_in_dim(v, start, bk, axis=2).astype(od)  # [B, K, bk, Dh]
    slots = start + jnp.arange(bk, dtype=jnp.int32)
    keep = lax.dynamic_slice_in_dim(mask, start, bk, axis=1) & (slots >= j * bk)[None, :]
    keep = keep[:, None, None, :]  # [B, 1, 1, bk]
    s = jnp.einsum("bkgd,bkds->bkgs", qc, kb, preferred_element_type=jnp.float32) * scale
    s = jnp.where(keep, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(keep, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgs,bksd->bkgd", p.astype(od), vb,
                    preferred_element_type=jnp.float32)
    return j + 1, m_new, l * alpha + jnp.sum(p, axis=-1, keepdims=True), acc * alpha + pv

  init = (jnp.int32(0), jnp.full((b, kh, g, 1), MASK_VALUE, jnp.float32),
          jnp.zeros((b, kh, g, 1), jnp.float32), jnp.zeros((b, kh, g, d), jnp.float32))
  _, _, l, acc = lax.while_loop(lambda c: c[0] < blocks, body, init)
  return (acc / jnp.where(l > 0, l, 1.0)).astype(out_dtype)
