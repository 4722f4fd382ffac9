"""Basic GRPO pieces: group-normalised advantages and the PPO-clip token loss.

Losses return `(sum, count)` over masked tokens, never a mean, so micro-batches and hosts can be
summed exactly and divided once by the global count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards: jax.Array, group_id: jax.Array, eps: float) -> jax.Array:
  """`A_i = (r_i - mean_g) / (std_g + eps)` over each explicit group g.

  std is the population std (ddof = 0): for a group of G rewards with k ones,
  std = sqrt(p (1 - p)), p = k / G. A group with equal rewards gets A = 0 exactly.
  Group ids may be any ints; no group count is static.
  """
  b = rewards.shape[0]
  # Any int ids: densify to [0, B) first (segment ops silently drop ids >= num_segments).
  _, group_id = jnp.unique(group_id, size=b, return_inverse=True)
  group_id = group_id.reshape(b)
  r = rewards.astype(jnp.float32)
  n = jax.ops.segment_sum(jnp.ones_like(r), group_id, num_segments=b)
  mean = jax.ops.segment_sum(r, group_id, num_segments=b) / jnp.maximum(n, 1.0)
  centred = r - mean[group_id]
  var = jax.ops.segment_sum(centred * centred, group_id, num_segments=b) / jnp.maximum(n, 1.0)
  std = jnp.sqrt(var[group_id])
  # A zero-variance group has no signal: exactly 0, also when eps = 0 (0/0 would be NaN).
  return jnp.where(std > 0, centred / (std + eps), 0.0)


def ppo_clip_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                  clip_eps: float) -> tuple[jax.Array, jax.Array, dict]:
  """Token loss `max(-A r, -A clip(r, 1-eps, 1+eps))`, `r = exp(logp - old_logp)`.

  logp/old_logp/mask: [B, N]; advantages: [B]. Returns (sum over masked tokens, token count,
  metrics sums). With one update per batch old_logp = stop_gradient(logp), so r = 1 and the
  gradient is the plain policy gradient `-A * grad logp`.
  """
  ratio = jnp.exp(jnp.where(mask, logp - old_logp, 0.0))
  a = advantages[:, None]
  unclipped = -a * ratio
  clipped = -a * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  per_token = jnp.maximum(unclipped, clipped)
  m = mask.astype(jnp.float32)
  clip_frac = jnp.sum(jnp.where(mask, (clipped > unclipped).astype(jnp.float32), 0.0))
  return jnp.sum(jnp.where(mask, per_token, 0.0)), jnp.sum(m), {"clip_frac": clip_frac}


def nll_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
             clip_eps: float) -> tuple[jax.Array, jax.Array, dict]:
  """Supervised warm-up: `-logp` summed over masked tokens (advantages and clip unused)."""
  del old_logp, advantages, clip_eps
  return jnp.sum(jnp.where(mask, -logp, 0.0)), jnp.sum(mask.astype(jnp.float32)), {}


LOSSES = {"grpo": ppo_clip_loss, "sft": nll_loss}
