"""Dense reference: materialises the `[N, V]` logits; the ground truth the others are tested on.

    z = (h @ W) / t            float32 (matmul in the input dtype, float32 accumulation)
    logp = z[target] - logsumexp(z)
    H = logsumexp(z) - sum_v softmax(z)_v z_v

Gradients come from plain autodiff (no `custom_vjp`), so they are an independent check of the
hand-written backward passes of `xla` and `pallas`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.kernels.fused_logprob import common


def fused_logprob(h, w, targets, t, *, with_entropy: bool = False, chunk_size=None,
                  interpret=None):
  """`(logp [N], entropy [N] or None)` in float32; `t` is the effective temperature `[N]`.

  `chunk_size` and `interpret` are accepted for a uniform signature and ignored.
  """
  del chunk_size, interpret
  dt = common.compute_dtype(h, w)
  z = jnp.dot(h.astype(dt), w.astype(dt), preferred_element_type=jnp.float32) / t[:, None]
  lse = jax.nn.logsumexp(z, axis=-1)
  v = w.shape[1]
  in_range = (targets >= 0) & (targets < v)
  picked = jnp.take_along_axis(z, jnp.clip(targets, 0, v - 1)[:, None], axis=-1)[:, 0]
  logp = jnp.where(in_range, picked, 0.0) - lse
  if not with_entropy:
    return logp, None
  p = jax.nn.softmax(z, axis=-1)
  entropy = lse - jnp.sum(p * z, axis=-1)
  return logp, entropy
