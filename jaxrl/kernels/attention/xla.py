"""Blockwise (flash-attention form) masked attention in plain XLA: never materialises the
`[T, S]` scores of all heads at once.

Forward, over key blocks `K_j` of width `c` with an online softmax (running max `m`, rescaled
sum `l`, rescaled output `a`), per query row and head:

    s_j = where(mask_j, scale q . K_j, MASK_VALUE)     float32
    m' = max(m, max s_j)     l' = l e^{m - m'} + sum e^{s_j - m'}
                             a' = a e^{m - m'} + e^{s_j - m'} @ V_j
    out = a / l

Backward (`jax.custom_vjp`), with output cotangent `do` and `delta = sum_d do * out`, recomputes
each block's scores from the saved `m`, `l` instead of storing probabilities:

    p = e^{s_j - m} / l      dV_j = p^T do      dp = do V_j^T
    ds = where(mask_j, p (dp - delta), 0) scale
    dq += ds K_j             dK_j = ds^T q

The live memory is a few `[B, H, T, c]` block buffers plus `[B, H, T]` statistics and the
inputs' own sizes: linear in T and in S for a fixed `c`. Queries are not blocked (the block
buffers are `T c` per head, which is what keeps memory linear; blocking T as well would bound
them by a constant but nest a second loop).

Masked keys score `MASK_VALUE` exactly as in `reference`, so a fully masked query row keeps the
running max at `MASK_VALUE`, every key weighs `e^0 = 1`, and the row gets the uniform average of
all S values like `reference` (no gradient to q or k; `1 / S` of its cotangent to each value).
That is why the log-sum-exp is saved as its two parts: `m + log l` rounds to `m` when
`m = MASK_VALUE`, and `e^{s - lse}` would then weigh each key 1 instead of `1 / S`.

S not a multiple of `c`: the keys are padded to `ceil(S / c) c` with zeros, and the padding
keys score `-inf` (not `MASK_VALUE`), so they weigh 0 even in a fully masked row. The first
block always holds a real key, so the running max is finite after it and `e^{m - m'}` never
sees `-inf - (-inf)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.kernels.attention.reference import MASK_VALUE, token_mask
from jaxrl.kernels.fused_logprob import common

# Key block width. Measured on CPU (2 cores, jax 0.10.2), value+grad of one 1024-token segment
# (H=4, Hkv=2, Dh=64): 37 / 31 / 33 ms for blocks of 128 / 256 / 512 (the dense reference: 109).
DEFAULT_BLOCK_K = 256


def _plan(s: int, block_k: int) -> tuple[int, int]:
  """Key block width and count; static, because they define the loop's shapes."""
  c = max(1, min(int(block_k), s))
  return c, -(-s // c)


def _blocks(x: jax.Array, c: int, n: int, fill) -> jax.Array:
  """`[B, S, ...]` padded with `fill` to `n c` keys and split as `[n, B, c, ...]` (scan's xs)."""
  pad = n * c - x.shape[1]
  if pad:
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, widths, constant_values=fill)
  x = x.reshape(x.shape[0], n, c, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _key_blocks(k, v, kv_segment, kv_position, kv_shared, c: int, n: int):
  """The scan's xs: keys, values, segments, positions, shared flags and "real key" flags, each
  `[n, B, c, ...]`; padding keys have segment -1 and real = False."""
  real = jnp.ones(kv_segment.shape, bool)
  return (_blocks(k, c, n, 0), _blocks(v, c, n, 0), _blocks(kv_segment, c, n, -1),
          _blocks(kv_position, c, n, 0), _blocks(kv_shared, c, n, False),
          _blocks(real, c, n, False))


def _block_scores(qh, kj, q_segment, q_position, seg, pos, shared, real, scale):
  """Masked float32 scores `[B, Hkv, G, T, c]` of one key block, and its mask `[B, 1, 1, T, c]`.

  Masked keys score `MASK_VALUE` (as in `reference`), padding keys `-inf` (see the module
  docstring)."""
  # The mask depends on integers alone. Under differentiation (a remat'ed layer scan around this
  # one) JAX would compute it ahead as a "known" value and keep every block's mask for the
  # backward pass: a `[blocks, B, Hkv, G, T, c]` bool residual, quadratic in the sequence.
  # Tying the integers to the keys through a barrier makes the mask as unknown as the scores,
  # so it is recomputed per block where it is used.
  kj, q_segment, q_position, seg, pos, shared, real = jax.lax.optimization_barrier(
      (kj, q_segment, q_position, seg, pos, shared, real))
  s = jnp.einsum("bkgtd,bskd->bkgts", qh, kj, preferred_element_type=jnp.float32) * scale
  mask = token_mask(q_segment, q_position, seg, pos, shared)[:, None, None]
  s = jnp.where(mask, s, MASK_VALUE)
  return jnp.where(real[:, None, None, None, :], s, -jnp.inf), mask


def _heads(q: jax.Array, kh: int) -> jax.Array:
  """`[B, T, H, Dh]` -> `[B, Hkv, G, T, Dh]` (query head h = kv head h // G, member h % G)."""
  b, t, h, d = q.shape
  return q.reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4)


def _unheads(x: jax.Array) -> jax.Array:
  """`[B, Hkv, G, T, Dh]` -> `[B, T, H, Dh]`."""
  b, kh, g, t, d = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, d)


def _forward(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, scale, block_k):
  """`(out [B, T, H, Dh] in q's dtype, m, l)`; `m`, `l` float32 `[B, Hkv, G, T]`."""
  kh, dt = k.shape[2], jnp.result_type(q, k, v)
  c, n = _plan(k.shape[1], block_k)
  qh = _heads(q.astype(dt), kh)
  xs = _key_blocks(k.astype(dt), v.astype(dt), kv_segment, kv_position, kv_shared, c, n)

  def body(carry, x):
    m, l, a = carry
    kj, vj, seg, pos, shared, real = x
    s, _ = _block_scores(qh, kj, q_segment, q_position, seg, pos, shared, real, scale)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)  # 0 on the first block (m = -inf, m_new finite)
    p = jnp.exp(s - m_new[..., None])
    l = l * alpha + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(dt), vj, preferred_element_type=jnp.float32)
    return (m_new, l, a * alpha[..., None] + pv), None

  axes = common.varying_axes(q, k, v, q_segment, q_position)
  stats = qh.shape[:-1]
  init = (common.vary(jnp.full(stats, -jnp.inf, jnp.float32), axes),
          common.vary(jnp.zeros(stats, jnp.float32), axes),
          common.vary(jnp.zeros(qh.shape, jnp.float32), axes))
  (m, l, a), _ = jax.lax.scan(body, init, xs)
  out = _unheads(a / l[..., None]).astype(q.dtype)
  return out, m, l


def _backward(res, do, scale, block_k):
  """Cotangents of q, k, v (in their dtypes); None for the integer and bool mask inputs."""
  q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, out, m, l = res
  (b, s_len, kh, d), dt = k.shape, jnp.result_type(q, k, v)
  c, n = _plan(s_len, block_k)
  qh = _heads(q.astype(dt), kh)
  doh = _heads(do.astype(dt), kh)
  # sum_s p_s dp_s = sum_d out_d do_d: the softmax backward's row sum, over Dh, once.
  delta = jnp.sum(_heads(do, kh).astype(jnp.float32) * _heads(out, kh).astype(jnp.float32),
                  axis=-1)
  xs = _key_blocks(k.astype(dt), v.astype(dt), kv_segment, kv_position, kv_shared, c, n)

  def body(dq, x):
    kj, vj, seg, pos, shared, real = x
    s, mask = _block_scores(qh, kj, q_segment, q_position, seg, pos, shared, real, scale)
    p = jnp.exp(s - m[..., None]) / l[..., None]
    dv = jnp.einsum("bkgts,bkgtd->bskd", p.astype(dt), doh, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgtd,bskd->bkgts", doh, vj, preferred_element_type=jnp.float32)
    ds = (jnp.where(mask, p * (dp - delta[..., None]), 0.0) * scale).astype(dt)
    dq = dq + jnp.einsum("bkgts,bskd->bkgtd", ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgts,bkgtd->bskd", ds, qh, preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  axes = common.varying_axes(q, k, v, do, m)
  dq, (dk, dv) = jax.lax.scan(body, common.vary(jnp.zeros(qh.shape, jnp.float32), axes), xs)
  # [n, B, c, Hkv, Dh] -> [B, S, Hkv, Dh], dropping the padding keys.
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c, kh, d)[:, :s_len]
  return (_unheads(dq).astype(q.dtype), unblock(dk).astype(k.dtype),
          unblock(dv).astype(v.dtype), None, None, None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _core(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, scale, block_k):
  return _forward(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, scale,
                  block_k)[0]


def _core_fwd(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, scale,
              block_k):
  out, m, l = _forward(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared,
                       scale, block_k)
  return out, (q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, out, m, l)


def _core_bwd(scale, block_k, res, do):
  return _backward(res, do, scale, block_k)


_core.defvjp(_core_fwd, _core_bwd)


def attention(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared=None, *,
              scale: float, block_k: int | None = None):
  """Blockwise masked attention, `out [B, T, H, Dh]` in q's dtype; the same function as
  `reference.attention` (same arguments) up to float rounding.

  `block_k` is the key block width (default `DEFAULT_BLOCK_K`, capped at S). Differentiable
  w.r.t. q, k and v; memory linear in T and S (module docstring).
  """
  block_k = DEFAULT_BLOCK_K if block_k is None else block_k
  if kv_shared is None:
    kv_shared = jnp.zeros(kv_segment.shape, bool)
  args = common.vary_all(q, k, v, q_segment.astype(jnp.int32), q_position.astype(jnp.int32),
                         kv_segment.astype(jnp.int32), kv_position.astype(jnp.int32),
                         kv_shared.astype(bool))
  return _core(*args, float(scale), int(block_k))
