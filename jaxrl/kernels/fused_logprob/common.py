"""Pieces every fused-logprob implementation shares: temperature, the target logit, its gradient.

Notation (all implementations): `h = hidden [N, D]`, `W = unembedding [D, V]`, `t [N]` the
effective temperature (`T` where `T > 0`, else 1), `z = (h @ W) / t` in float32,
`lse = logsumexp_v z`, `p = softmax(z)`, `H = lse - sum_v p_v z_v`, `logp = z[target] - lse`.

The target logit `z[target] = (h . W[:, target]) / t` is one dot product per token, so every
implementation takes it from a gathered column instead of searching the vocabulary for it; only
`lse` (and `H`) need the full vocabulary. A target outside `[0, V)` (padding) picks 0, so a
padded row has finite values and no NaN can leak into a masked gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def effective_temperature(temperature, n: int) -> jax.Array:
  """float32 `[n]` divisor: `T` where `T > 0`, else 1 (greedy decoding scores at `T = 1`).

  Matches `jaxrl.models.logprobs.scale_logits`. No gradient flows to the temperature.
  """
  t = jax.lax.stop_gradient(jnp.asarray(temperature, jnp.float32))
  t = jnp.where(t > 0, t, 1.0)
  return jnp.broadcast_to(t, (n,))


def compute_dtype(h: jax.Array, w: jax.Array):
  """Dtype the matmuls run in (the promoted input dtype); accumulation is always float32."""
  return jnp.result_type(h.dtype, w.dtype)


def _target_columns(w: jax.Array, targets: jax.Array):
  """`W[:, target]` as `[N, D]` (column clipped into range) and the in-range mask `[N]`."""
  v = w.shape[1]
  in_range = (targets >= 0) & (targets < v)
  cols = jnp.take(w, jnp.clip(targets, 0, v - 1), axis=1).T
  return cols, in_range


def target_logit(h: jax.Array, w: jax.Array, targets: jax.Array, t: jax.Array) -> jax.Array:
  """`z[target] = (h . W[:, target]) / t`, float32 `[N]`; 0 for targets outside `[0, V)`."""
  cols, in_range = _target_columns(w, targets)
  dt = compute_dtype(h, w)
  picked = jnp.einsum("nd,nd->n", h.astype(dt), cols.astype(dt),
                      preferred_element_type=jnp.float32)
  return jnp.where(in_range, picked / t, 0.0)


def add_target_grads(h, w, targets, t, g_lp, dh, dw):
  """Adds the one-hot part of `d logp / d z = onehot(target) - p` to float32 `dh`, `dw`.

  With `c = g_lp / t` (zeroed for out-of-range targets):
  `dh += c * W[:, target]` and `dW[:, target] += c * h` (a scatter-add: repeated targets sum).
  """
  cols, in_range = _target_columns(w, targets)
  c = jnp.where(in_range, g_lp / t, 0.0)
  dh = dh + c[:, None] * cols.astype(jnp.float32)
  idx = jnp.clip(targets, 0, w.shape[1] - 1)
  dw = dw.at[:, idx].add((c[:, None] * h.astype(jnp.float32)).T)
  return dh, dw


def varying_axes(*xs) -> tuple:
  """Mesh axes any of `xs` varies over inside `shard_map` (empty outside one).

  Fresh constants (loop-carry inits, kernel output shapes) are invariant across devices; under
  `shard_map`'s type check they must be declared varying like the data they will hold.
  """
  axes = set()
  for x in xs:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    axes |= set(mat.varying if mat is not None else getattr(aval, "vma", ()))
  return tuple(sorted(axes))


def vary(x: jax.Array, axes: tuple) -> jax.Array:
  """`x` typed as varying over `axes` (a no-op outside `shard_map`)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_all(*xs):
  """`xs` all typed as varying over the union of their axes.

  Applied before a `custom_vjp`: its backward then returns cotangents of the same (varying)
  type, and autodiff of this cast sums them over the devices an input was replicated on (e.g.
  the unembedding's gradient under a `shard_map` over tokens).
  """
  axes = varying_axes(*xs)
  return tuple(vary(x, axes) for x in xs)


def out_struct(shape, dtype, axes: tuple) -> jax.ShapeDtypeStruct:
  """A kernel output shape that varies over `axes` like the kernel's inputs."""
  mat = getattr(jax.typeof(vary(jnp.zeros((), dtype), axes)), "manual_axis_type", None)
  if mat is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
