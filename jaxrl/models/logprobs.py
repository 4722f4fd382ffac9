"""What the sampler and the trainer must compute alike, defined once: the positions of tokens in
left-padded rows (and of continuations after their prompts), temperature-scaled logits, and the
per-token log-probs taken from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """float32 `logits / T`; `temperature <= 0` (greedy) scales by 1. T is a scalar or one per
  row of `logits[..., :]`."""
  t = jnp.asarray(temperature, jnp.float32)
  return logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[..., None]


def continuation_positions(prompt_valid: jax.Array, valid: jax.Array, group: int) -> jax.Array:
  """Positions [B, T] of continuation tokens `valid` [B, T] after left-padded prompts
  `prompt_valid` [B / group, Lp], each continuing `group` consecutive rows: counted on from the
  prompt's valid tokens, advancing at valid tokens only (never below 0)."""
  before = jnp.repeat(jnp.sum(prompt_valid, axis=-1, dtype=jnp.int32), group)[:, None]
  return jnp.maximum(before + jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def left_positions(valid: jax.Array) -> jax.Array:
  """Positions counted from each row's first real token (left padding gets 0)."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def segment_positions(segment: jax.Array) -> jax.Array:
  """Positions [B, T] of rows holding several causal sequences one after another: `segment`
  [B, T] int32 is each token's sequence (-1: padding; the ids of real tokens never decrease
  along a row), and each sequence counts its positions from 0 at its first real token
  (padding gets 0). A row of one segment gets `left_positions` at its real tokens."""
  real = segment >= 0
  count = jnp.cumsum(real.astype(jnp.int32), axis=-1)  # real tokens up to and including i
  seen = jax.lax.cummax(jnp.where(real, segment, -1), axis=segment.ndim - 1)
  before = jnp.concatenate([jnp.full_like(seen[..., :1], -1), seen[..., :-1]], axis=-1)
  starts = real & (segment != before)  # the first real token of its sequence
  base = jax.lax.cummax(jnp.where(starts, count - 1, 0), axis=segment.ndim - 1)
  return jnp.where(real, count - 1 - base, 0)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array) -> jax.Array:
  """The one log-prob definition: `log_softmax(logits / T)[target]` over the full vocabulary, f32.

  Used by the sampler, the trainer's recompute and (later) the reference model, so they agree by
  construction. `temperature <= 0` means greedy decoding; its log-probs are taken at T = 1.
  """
  z = scale_logits(logits, temperature)
  picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(z, axis=-1)
