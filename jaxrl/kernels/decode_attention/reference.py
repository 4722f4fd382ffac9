"""Dense single-token decode attention: the semantics every implementation is tested against.

Exactly `jaxrl.models.layers.decode_attention`'s math (scores and softmax in float32 over every
slot, weights cast to the values' dtype for the value product), with its mask built from the
per-slot `valid` flags and the per-row `lengths` bound. A row that attends no slot gets the
uniform average of all S values, as that function gives it (the kernels give 0 there instead:
see `api`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The same finite mask value as `jaxrl.models.layers`: a fully masked row softmaxes to uniform
# instead of NaN.
MASK_VALUE = -1e30


def slot_mask(valid: jax.Array, lengths: jax.Array) -> jax.Array:
  """`[B, S]` bool: slot s of row b is attended iff `valid[b, s]` and `s < lengths[b]`."""
  slots = jnp.arange(valid.shape[1], dtype=jnp.int32)
  return valid & (slots[None, :] < lengths[:, None])


def operand_dtype(q_dtype, cache_dtype):
  """The dtype the products of every implementation take: the cache's, except an 8-bit float
  cache, whose blocks are upcast to the query's dtype as they are read (a query rounded to 8
  bits would lose too much, and 8-bit products are not on every device)."""
  cache_dtype = jnp.dtype(cache_dtype)
  return jnp.dtype(q_dtype) if cache_dtype.itemsize == 1 else cache_dtype


def decode_attention(q, k_t, v, valid, lengths, *, scale: float, out_dtype, **_):
  """q `[B, K, G, Dh]`, k_t `[B, K, Dh, S]`, v `[B, K, S, Dh]` -> `[B, K, G, Dh]`."""
  mask = slot_mask(valid, lengths)[:, None, None, :]  # [B, 1, 1, S]
  s = jnp.einsum("bkgd,bkds->bkgs", q.astype(jnp.float32), k_t.astype(jnp.float32)) * scale
  od = operand_dtype(q.dtype, v.dtype)
  w = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1).astype(od)
  return jnp.einsum("bkgs,bksd->bkgd", w, v.astype(od)).astype(out_dtype)
