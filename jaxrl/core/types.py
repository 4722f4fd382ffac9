"""Pytrees that cross jit boundaries. Leading axis = rows (samples); fixed shapes per run."""

from __future__ import annotations

from typing import NamedTuple

import jax


class TrainBatch(NamedTuple):
  """One training batch: B rows of left-padded prompt + completion.

  Groups are explicit (`group_id`), never inferred from equal prompts. Every leaf has the row
  axis first, so micro-batching and data-parallel sharding split all fields the same way.
  """

  prompt_tokens: jax.Array  # [B, Lp] int32, left-padded
  prompt_valid: jax.Array  # [B, Lp] bool
  tokens: jax.Array  # [B, N] int32 completion, pad after EOS
  mask: jax.Array  # [B, N] bool loss mask (generated tokens up to and including EOS)
  # [B, N] float32 sampler log-probs (anything where masked), or None when the sampler did not
  # return them (then corrections, rollout KL and mismatch metrics are unavailable).
  rollout_logprobs: jax.Array | None
  rewards: jax.Array  # [B] float32
  group_id: jax.Array  # [B] int32
  temperature: jax.Array  # [B] float32 sampling temperature (logprobs use logits / T)
  # [B, N] bool: completion tokens the model attends to, when they are more than the loss mask
  # (multi-turn rows: environment observations are context but not trained). None = `mask`.
  completion_valid: jax.Array | None = None
  # [B, N, L, k] int16: mixture-of-experts models, the experts each generated token went to in
  # every layer in the sampler (-1: none recorded), for routing replay and `moe/routing_mismatch`;
  # None for a dense model.
  routing: jax.Array | None = None
  # [B, N] int32: the causal sequence of each completion token, for rows that hold several (an
  # agent episode whose later request does not extend the one before, `jaxrl.serving.agents`):
  # 0 continues the row's prompt; k >= 1 is a later sequence (its own prompt as context, then
  # its trained reply) that attends only to its own tokens, with positions from 0. Ids never
  # decrease along a row. None: each row is one sequence.
  completion_segment: jax.Array | None = None


class TrainState(NamedTuple):
  params: object  # nnx.State of the model (with LoRA: of its adapters, the trained params)
  opt_state: object
  step: jax.Array  # int32 count of applied updates (the published policy version)
  ref_params: object = None  # frozen reference policy; only when a reference-KL term is on
  # With LoRA: the frozen base model's nnx.State (`jaxrl.models.lora`); the model is
  # `join(frozen, params)`. Never updated nor donated by the step. None without LoRA.
  frozen: object = None
