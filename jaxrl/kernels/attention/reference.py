"""Dense reference: builds the `[B, T, S]` mask and the `[B, H, T, S]` scores; the ground truth
the blockwise implementation is tested against.

The arithmetic is `jaxrl.models.layers.attention`'s: scores `q . k` in the inputs' dtype, then
float32 and times `scale`; masked scores replaced by `MASK_VALUE`; a float32 softmax over the keys,
cast to q's dtype; the probabilities times the values. A fully masked query row therefore gets
the uniform average of all `S` values, no gradient to q or k, and `1 / S` of its output cotangent
to each value. Gradients come from plain autodiff (no `custom_vjp`), so they are an independent
check of `xla`'s hand-written backward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The masked score, `jaxrl.models.layers.MASK_VALUE` (tests check they agree): finite, so a fully
# masked row's softmax is uniform instead of NaN.
MASK_VALUE = -1e30

# Segment ids carry a unit in their high bits (`segment >> UNIT_SHIFT`): a shared key (a group's
# prompt) is visible only to the queries of its own unit, so one packed row holds many groups.
# Segments below `1 << UNIT_SHIFT` are all unit 0 (one group per row, as before).
UNIT_SHIFT = 16


def token_mask(q_segment: jax.Array, q_position: jax.Array, kv_segment: jax.Array,
               kv_position: jax.Array, kv_shared: jax.Array | None = None) -> jax.Array:
  """Which keys each query attends: bool `[B, T, S]` (True: attend).

  Args:
    q_segment: `[B, T]` int, the query's segment; `< 0` marks a padding query (attends nothing).
    q_position: `[B, T]` int, the query's position in its sequence.
    kv_segment: `[B, S]` int, the key's segment; `< 0` marks a padding key (never attended).
    kv_position: `[B, S]` int.
    kv_shared: `[B, S]` bool or None (all False): True marks a key of a shared prompt, seen by
      every query of the same unit (`segment >> UNIT_SHIFT`).

  Returns:
    `[B, T, S]` bool: query i attends key j iff both are real (segments `>= 0`),
    `kv_position[j] <= q_position[i]`, and either `kv_segment[j] == q_segment[i]` or
    `kv_shared[j]` with both in one unit (`kv_segment[j] >> UNIT_SHIFT == q_segment[i] >>
    UNIT_SHIFT`).
  """
  qs, qp = q_segment[:, :, None], q_position[:, :, None]
  ks, kp = kv_segment[:, None, :], kv_position[:, None, :]
  same = ks == qs
  if kv_shared is not None:
    # A shared key is seen by the queries of its unit: segments `u << UNIT_SHIFT | member`.
    unit = lambda x: jnp.right_shift(x, UNIT_SHIFT)
    same = same | (kv_shared[:, None, :] & (unit(ks) == unit(qs)))
  return (qs >= 0) & (ks >= 0) & (kp <= qp) & same


def attention(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared=None, *,
              scale: float, block_k=None):
  """Dense masked attention, `out [B, T, H, Dh]` in q's dtype.

  Args:
    q: `[B, T, H, Dh]` queries; H is a multiple of Hkv (query head `h` reads kv head
      `h // (H / Hkv)`).
    k, v: `[B, S, Hkv, Dh]` keys and values.
    q_segment, q_position, kv_segment, kv_position, kv_shared: the mask (`token_mask`).
    scale: the score scale (usually `Dh ** -0.5`).
    block_k: accepted for a uniform signature and ignored.

  Returns:
    `[B, T, H, Dh]` in q's dtype.
  """
  del block_k
  b, t, h, d = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) * scale
  mask = token_mask(q_segment, q_position, kv_segment, kv_position, kv_shared)
  p = jax.nn.softmax(jnp.where(mask[:, None, None], s, MASK_VALUE), axis=-1).astype(q.dtype)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v)
  return o.reshape(b, t, h, d).astype(q.dtype)
