"""Outcome advantages over explicit groups: one scalar per sample, broadcast to its tokens.

Every estimator takes `rewards [B]`, `group_id [B]` (any ints; groups are never inferred from
equal prompts) and `valid [B]` (False for failed or placeholder samples). Statistics use only
valid members; invalid samples get advantage exactly 0 and their rewards may be NaN/inf.
No group count is static: ids are densified inside, so any ints work under jit.

| name             | A_i for a valid member of group g with n valid members              |
| ---------------- | ------------------------------------------------------------------- |
| `grpo`           | `(r_i - mean_g) / (std_g + eps)`; std with `ddof` (default 0,        |
|                  | population; 1 = sample std, as TRL)                                  |
| `grpo_batch_std` | `(r_i - mean_g) / (std_batch + eps)`: the group mean, but the std of |
|                  | every valid reward of the batch (with `ddof`)                        |
| `dr_grpo`        | `r_i - mean_g` (no std division: Dr. GRPO)                           |
| `rloo`           | `r_i - (sum_g - r_i) / (n - 1)`, the leave-one-out mean; 0 when n = 1|

`grpo` gives exactly 0 to a zero-variance group (also with eps = 0, where 0/0 would be NaN) and
to a group with `n <= ddof` members; `grpo_batch_std` gives exactly 0 to a zero-variance group
and to every sample when the whole batch has no spread (or `<= ddof` valid samples). `rloo` with
G members equals `G / (G - 1)` times `dr_grpo`. Clipping (`clip_advantages`) is applied after
the estimator.

TRL's `GRPOConfig.scale_rewards` (trl/trainer/grpo_trainer.py, `_generate_and_score_completions`)
maps as: `"group"` = `grpo` with `ddof=1`, `"batch"` = `grpo_batch_std` with `ddof=1`, `"none"` =
`dr_grpo`; TRL's eps is 1e-4 (jaxrl's config default `advantage.eps`) and its `nanstd` is the
sample (Bessel) std.

References:
- `grpo`: Shao et al. 2024, DeepSeekMath (section 4.1), https://arxiv.org/abs/2402.03300.
- `grpo_batch_std`: group-level mean, batch-level std, the "Lite PPO" normalisation of Liu et
  al. 2025, Tricks or Traps? A Deep Dive into RL for LLM Reasoning,
  https://arxiv.org/abs/2508.08221 (TRL `scale_rewards="batch"`).
- `dr_grpo`: Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective,
  https://arxiv.org/abs/2503.20783.
- `rloo`: Kool et al. 2019, Buy 4 REINFORCE Samples, Get a Baseline for Free! (ICLR 2019
  workshop); for LLMs, Ahmadian et al. 2024, Back to Basics, https://arxiv.org/abs/2402.14740.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core.names import ADVANTAGE_ESTIMATORS


def _stats(rewards, group_id, valid):
  """(r, valid, per-sample valid count n, per-sample group sum) with invalid rewards zeroed."""
  b = rewards.shape[0]
  # Segment ops silently drop ids >= num_segments, so any ints are densified to [0, B) first.
  _, dense = jnp.unique(group_id, size=b, return_inverse=True)
  dense = dense.reshape(b)
  valid = jnp.ones((b,), bool) if valid is None else jnp.asarray(valid, bool)
  r = jnp.where(valid, jnp.asarray(rewards, jnp.float32), 0.0)
  v = valid.astype(jnp.float32)
  n = jax.ops.segment_sum(v, dense, num_segments=b)[dense]
  total = jax.ops.segment_sum(r, dense, num_segments=b)[dense]
  return r, valid, dense, n, total


def grpo(rewards: jax.Array, group_id: jax.Array, valid: jax.Array | None = None, *,
         eps: float = 1e-6, ddof: int = 0) -> jax.Array:
  """GRPO's group-normalised advantage `A_i = (r_i - mean_g) / (std_g + eps)`.

  `std_g = sqrt(sum_(j in g) (r_j - mean_g)^2 / (n - ddof))` over the `n` valid members of group
  `g`. A zero-variance group (also with `eps = 0`, where 0/0 would be NaN) and a group with
  `n <= ddof` valid members get exactly 0.

  Golden: rewards [1, 0, 0, 0] (eps 0, ddof 0) -> mean 1/4, std sqrt(1/4 * 3/4) = 0.4330,
  A = [0.75, -0.25, -0.25, -0.25] / 0.4330 = [1.732, -0.577, -0.577, -0.577].

  Args:
    rewards: `[B]` one scalar reward per sample; may be NaN/inf where `valid` is False.
    group_id: `[B]` int group of each sample (e.g. its prompt's index); any ints, groups are
      never inferred from equal prompts.
    valid: `[B]` bool, False for failed or placeholder samples; None means all valid.
    eps: added to the group std before dividing.
    ddof: delta degrees of freedom of the std: 0 = population std, 1 = sample (Bessel) std, as
      TRL.

  Returns:
    `[B]` float32 advantages, one per sample (exactly 0 for invalid samples); the policy loss
    broadcasts each over its sample's tokens.

  References:
    Shao et al. 2024, DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models (section 4.1), arXiv:2402.03300.
  """
  r, valid, dense, n, total = _stats(rewards, group_id, valid)
  b = r.shape[0]
  mean = total / jnp.maximum(n, 1.0)
  centred = jnp.where(valid, r - mean, 0.0)
  ss = jax.ops.segment_sum(centred * centred, dense, num_segments=b)[dense]
  # Zero variance is decided on the rewards themselves: for equal rewards that are not exact in
  # float32 (0.3, say), `r - mean` is a rounding residue and residue / residue would be ~1.
  hi = jax.ops.segment_max(jnp.where(valid, r, -jnp.inf), dense, num_segments=b)[dense]
  lo = jax.ops.segment_min(jnp.where(valid, r, jnp.inf), dense, num_segments=b)[dense]
  spread = (hi > lo) & (ss > 0)
  # sqrt'(0) is inf, and inf * 0 would put NaN in the gradient of zero-variance groups.
  std = jnp.sqrt(jnp.where(spread, ss, 1.0) / jnp.maximum(n - ddof, 1.0))
  ok = valid & spread & (n > ddof)
  return jnp.where(ok, centred / jnp.where(ok, std + eps, 1.0), 0.0)


def grpo_batch_std(rewards: jax.Array, group_id: jax.Array, valid: jax.Array | None = None, *,
                   eps: float = 1e-6, ddof: int = 0) -> jax.Array:
  """Group-mean, batch-std advantage `A_i = (r_i - mean_g) / (std_batch + eps)`.

  `std_batch = sqrt(sum_j (r_j - mean_batch)^2 / (n_batch - ddof))` over every valid reward of
  the batch. A zero-variance group gets exactly 0, and so does every sample when the whole batch
  has no spread (or `<= ddof` valid samples).

  Golden: groups [1, 0] and [3, 3] (eps 0, ddof 0): group means 1/2 and 3, batch mean 7/4,
  batch std sqrt((9/16 + 49/16 + 25/16 + 25/16) / 4) = sqrt(108/64) = 1.2990;
  A = [0.5, -0.5, 0, 0] / 1.2990 = [0.3849, -0.3849, 0, 0] (grpo would give [1, -1, 0, 0]).

  Args:
    rewards: `[B]` one scalar reward per sample; may be NaN/inf where `valid` is False.
    group_id: `[B]` int group of each sample (e.g. its prompt's index); any ints, groups are
      never inferred from equal prompts.
    valid: `[B]` bool, False for failed or placeholder samples; None means all valid.
    eps: added to the batch std before dividing.
    ddof: delta degrees of freedom of the batch std (0 = population, 1 = sample std, as TRL).

  Returns:
    `[B]` float32 advantages, one per sample (exactly 0 for invalid samples); the policy loss
    broadcasts each over its sample's tokens.

  References:
    Liu et al. 2025, Tricks or Traps? A Deep Dive into RL for LLM Reasoning ("Lite PPO":
    group-level mean, batch-level std), arXiv:2508.08221; TRL's `scale_rewards="batch"`.
    Compare REINFORCE++ (Hu 2025, REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models, arXiv:2501.03262), whose baseline variant likewise subtracts the group
    mean and normalises by a batch-level std.
  """
  r, valid, dense, n, total = _stats(rewards, group_id, valid)
  mean = total / jnp.maximum(n, 1.0)
  b = r.shape[0]
  hi = jax.ops.segment_max(jnp.where(valid, r, -jnp.inf), dense, num_segments=b)[dense]
  lo = jax.ops.segment_min(jnp.where(valid, r, jnp.inf), dense, num_segments=b)[dense]
  # Exact 0 for a zero-variance group, as in `grpo` (`r - mean` is a rounding residue there).
  centred = jnp.where(valid & (hi > lo), r - mean, 0.0)
  nb = jnp.sum(valid.astype(jnp.float32))
  mean_b = jnp.sum(r) / jnp.maximum(nb, 1.0)
  dev = jnp.where(valid, r - mean_b, 0.0)
  ss = jnp.sum(dev * dev)
  spread = (jnp.max(jnp.where(valid, r, -jnp.inf)) > jnp.min(jnp.where(valid, r, jnp.inf))) & (
      ss > 0) & (nb > ddof)
  # sqrt'(0) is inf: a batch without spread must not put NaN in the gradient.
  std = jnp.sqrt(jnp.where(spread, ss, 1.0) / jnp.maximum(nb - ddof, 1.0))
  return jnp.where(spread, centred / jnp.where(spread, std + eps, 1.0), 0.0)


def dr_grpo(rewards: jax.Array, group_id: jax.Array, valid: jax.Array | None = None
            ) -> jax.Array:
  """Dr. GRPO's advantage `A_i = r_i - mean_g`: GRPO's group mean without the std division.

  Dropping the std removes GRPO's question-level difficulty bias (low-spread groups weighted up).

  Args:
    rewards: `[B]` one scalar reward per sample; may be NaN/inf where `valid` is False.
    group_id: `[B]` int group of each sample (e.g. its prompt's index); any ints, groups are
      never inferred from equal prompts.
    valid: `[B]` bool, False for failed or placeholder samples; None means all valid.

  Returns:
    `[B]` float32 advantages, one per sample (exactly 0 for invalid samples); the policy loss
    broadcasts each over its sample's tokens.

  References:
    Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective,
    arXiv:2503.20783.
  """
  r, valid, _, n, total = _stats(rewards, group_id, valid)
  return jnp.where(valid, r - total / jnp.maximum(n, 1.0), 0.0)


def rloo(rewards: jax.Array, group_id: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """RLOO's leave-one-out advantage `A_i = r_i - (sum_g - r_i) / (n - 1)`.

  The baseline is the mean of the *other* valid members of the group, so it does not depend on
  `r_i`. A group with a single valid member has no baseline and gets 0. With `G` valid members
  it equals `G / (G - 1)` times `dr_grpo`.

  Args:
    rewards: `[B]` one scalar reward per sample; may be NaN/inf where `valid` is False.
    group_id: `[B]` int group of each sample (e.g. its prompt's index); any ints, groups are
      never inferred from equal prompts.
    valid: `[B]` bool, False for failed or placeholder samples; None means all valid.

  Returns:
    `[B]` float32 advantages, one per sample (exactly 0 for invalid samples); the policy loss
    broadcasts each over its sample's tokens.

  References:
    Kool et al. 2019, Buy 4 REINFORCE Samples, Get a Baseline for Free! (ICLR 2019 workshop);
    for LLMs, Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs, arXiv:2402.14740.
  """
  r, valid, _, n, total = _stats(rewards, group_id, valid)
  ok = valid & (n > 1)
  return jnp.where(ok, r - (total - r) / jnp.where(ok, n - 1.0, 1.0), 0.0)


def clip_advantages(advantages: jax.Array, low: float | None = None,
                    high: float | None = None) -> jax.Array:
  """Clips advantages elementwise: `clip(A, low, high)`, None leaving that side open.

  Args:
    advantages: `[B]` (or `[B, N]`, any shape) advantages.
    low: lower bound, or None for none.
    high: upper bound, or None for none.

  Returns:
    The clipped advantages, same shape; `advantages` itself when both bounds are None.
  """
  if low is None and high is None:
    return advantages
  return jnp.clip(advantages, low, high)


def compute_advantages(estimator: str, rewards: jax.Array, group_id: jax.Array,
                       valid: jax.Array | None = None, *, eps: float = 1e-6, ddof: int = 0,
                       clip_low: float | None = None, clip_high: float | None = None
                       ) -> jax.Array:
  """Advantages by the estimator named `estimator` (see the module table), then clipping.

  Args:
    estimator: one of `ADVANTAGE_ESTIMATORS`: "grpo", "grpo_batch_std", "dr_grpo", "rloo".
    rewards: `[B]` one scalar reward per sample; may be NaN/inf where `valid` is False.
    group_id: `[B]` int group of each sample (e.g. its prompt's index); any ints, groups are
      never inferred from equal prompts.
    valid: `[B]` bool, False for failed or placeholder samples; None means all valid.
    eps: std offset; used by "grpo" and "grpo_batch_std" only.
    ddof: delta degrees of freedom of the std; used by "grpo" and "grpo_batch_std" only.
    clip_low: lower clip of the advantages (`clip_advantages`), or None.
    clip_high: upper clip of the advantages, or None.

  Returns:
    `[B]` float32 advantages, one per sample (exactly 0 for invalid samples); the policy loss
    broadcasts each over its sample's tokens.

  Raises:
    ValueError: for an unknown estimator name.

  References:
    Those of the chosen estimator: see `grpo`, `grpo_batch_std`, `dr_grpo` and `rloo`.
  """
  if estimator == "grpo":
    a = grpo(rewards, group_id, valid, eps=eps, ddof=ddof)
  elif estimator == "grpo_batch_std":
    a = grpo_batch_std(rewards, group_id, valid, eps=eps, ddof=ddof)
  elif estimator == "dr_grpo":
    a = dr_grpo(rewards, group_id, valid)
  elif estimator == "rloo":
    a = rloo(rewards, group_id, valid)
  else:
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of "
                     f"{ADVANTAGE_ESTIMATORS}")
  return clip_advantages(a, clip_low, clip_high)
