"""On-policy distillation: a teacher's per-token log-probs as a dense, per-token advantage.

The student samples completions; a frozen teacher with the same tokenizer scores every sampled
token; the student minimises the reverse KL to the teacher on its own samples,

    KL(pi || pi_T) = E_{y ~ pi} [ sum_t log pi(y_t | y_<t) - log pi_T(y_t | y_<t) ].

Its policy gradient, with the per-token reverse-KL estimate as a (negative) reward on each token
and no credit carried to other tokens, is the policy-gradient loss of the per-token advantage

    A_t = coef * (log pi_T(y_t) - log mu(y_t))            (mu: the policy that sampled y)

which is what `reverse_kl_advantages` returns; optionally mixed with the task reward's sequence
advantage, `A_t += reward_weight * A_seq`. The advantage is a constant (no gradient): the
gradient flows through the policy loss's ratio, so the usual clipping, off-policy corrections
and forced lag apply unchanged, and `mu` is the sampler's log-probs (`lp_gen`; the trainer's
recompute `lp_old` when the sampler's are not kept). Masked tokens (padding, observation tokens
of multi-turn rows) get 0 and never carry a NaN.

References: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), https://arxiv.org/abs/2306.13649; Gu et al. 2024, "MiniLLM:
Knowledge Distillation of Large Language Models" (reverse KL on student samples),
https://arxiv.org/abs/2306.08543; the per-token reverse-KL advantage of Lu & Thinking Machines
Lab 2025, "On-Policy Distillation", https://thinkingmachines.ai/blog/on-policy-distillation/.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reverse_kl_advantages(lp_teacher: jax.Array, lp_behaviour: jax.Array, mask: jax.Array, *,
                          coef: float = 1.0, seq_advantages: jax.Array | None = None,
                          reward_weight: float = 0.0) -> jax.Array:
  """Per-token on-policy distillation advantages `coef (lp_teacher - lp_behaviour) + w A_seq`.

  `w` is `reward_weight`. 0 where `mask` is False, with no gradient (see the module docstring).

  Args:
    lp_teacher: `[B, N]` the teacher's log-probs of the sampled tokens.
    lp_behaviour: `[B, N]` the sampling policy's log-probs of the same tokens.
    mask: `[B, N]` bool, the completion tokens the loss sees.
    coef: weight of the reverse-KL term.
    seq_advantages: `[B]` the task reward's advantages (e.g. `compute_advantages`), or None.
    reward_weight: their weight (ignored when `seq_advantages` is None).

  Returns:
    `[B, N]` float32 per-token advantages (a constant), 0 at masked tokens; pass them as `adv`
    to a policy loss.

  References:
    Agarwal et al. 2024, On-Policy Distillation of Language Models: Learning from Self-Generated
    Mistakes (GKD), arXiv:2306.13649; Gu et al. 2024, MiniLLM: Knowledge Distillation of Large
    Language Models (reverse KL on student samples), arXiv:2306.08543; the per-token
    reverse-KL advantage: Lu and Thinking Machines Lab 2025, On-Policy Distillation (blog),
    https://thinkingmachines.ai/blog/on-policy-distillation/.
  """
  mask = jnp.asarray(mask, bool)
  lp_teacher = jnp.asarray(lp_teacher, jnp.float32)
  lp_behaviour = jnp.asarray(lp_behaviour, jnp.float32)
  # where() before the subtraction: NaN/inf log-probs at masked tokens never reach the result.
  gap = jnp.where(mask, lp_teacher, 0.0) - jnp.where(mask, lp_behaviour, 0.0)
  adv = coef * gap
  if seq_advantages is not None and reward_weight != 0:
    seq = jnp.where(jnp.any(mask, axis=-1), jnp.asarray(seq_advantages, jnp.float32), 0.0)
    adv = adv + reward_weight * seq[:, None]
  return jax.lax.stop_gradient(jnp.where(mask, adv, 0.0))


def reverse_kl(lp_student: jax.Array, lp_teacher: jax.Array, mask: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """Sampled estimate of the per-sequence reverse KL(student || teacher), as `(sum, count)`.

  Per row, `sum_t m (lp_student - lp_teacher)`; the row mean of these is the
  `distill/reverse_kl` metric.

  Args:
    lp_student: `[B, N]` the student's log-probs of its own sampled tokens.
    lp_teacher: `[B, N]` the teacher's log-probs of the same tokens.
    mask: `[B, N]` bool completion mask.

  Returns:
    `(sum, count)`: float32 scalars, the per-row sums added over the batch and the number of
    rows with at least one valid token.

  References:
    Agarwal et al. 2024, On-Policy Distillation of Language Models: Learning from Self-Generated
    Mistakes (GKD), arXiv:2306.13649; Gu et al. 2024, MiniLLM: Knowledge Distillation of Large
    Language Models (reverse KL on student samples), arXiv:2306.08543; the per-token
    reverse-KL advantage: Lu and Thinking Machines Lab 2025, On-Policy Distillation (blog),
    https://thinkingmachines.ai/blog/on-policy-distillation/.
  """
  mask = jnp.asarray(mask, bool)
  per_token = jnp.where(mask, jnp.asarray(lp_student, jnp.float32), 0.0) - \
      jnp.where(mask, jnp.asarray(lp_teacher, jnp.float32), 0.0)
  rows = jnp.any(mask, axis=-1)
  return jnp.sum(jnp.where(rows, per_token.sum(-1), 0.0)), jnp.sum(rows).astype(jnp.float32)
