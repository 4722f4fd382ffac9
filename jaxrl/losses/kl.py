"""Per-token KL estimators between the trained policy and a fixed base policy.

With `d = lp - lp_base` (lp: log-prob of the sampled token under the policy being trained, with
gradient; lp_base: reference-model or sampler log-prob, a constant), for tokens sampled from
(approximately) the trained policy:

| name  | value                 | estimates / why                                                |
| ----- | --------------------- | -------------------------------------------------------------- |
| `k1`  | `d`                   | KL(pi || base), unbiased; can be negative, high variance        |
| `abs` | `abs(d)`              | >= 0, heuristic                                                 |
| `k2`  | `d**2 / 2`            | biased as a value; its gradient `d * grad lp` is the "k2 in     |
|       |                       | loss" form (prime-rl's `kl_tau * d**2` = k2 with coef 2 kl_tau) |
| `k3`  | `exp(-d) - 1 + d`     | KL(pi || base), unbiased, >= 0, low variance                    |

Clamps (documented, applied only to `k3`, whose exponential overflows): `-d` is clamped to
`[-clamp_input, clamp_input]` (default 20) before `exp`, and the value to `[0, clamp_output]`
(default 10). Where a clamp is active the token's gradient is zero; a token that far from the
base (probability ratio above e^10) is an outlier that other terms must handle.

Only the base gets `stop_gradient`: the gradient flows through `lp` (a KL "loss" without a
gradient is a known upstream bug). Masking is `where(mask, x, 0)` so NaN/inf at masked positions
(e.g. placeholder log-probs) never reach a sum or a gradient.

Importance weighting (`importance_weighted_kl`): the estimators above assume tokens sampled from
the trained policy pi. When they were sampled from a behaviour policy mu (pi_old, the sampler),
`E_mu[(pi / mu) k] = E_pi[k]`, so `w * k` with `w = exp(lp - sg(lp_mu))` is again an unbiased
estimate of KL(pi || base). `w` is *not* detached: its gradient `w k grad lp` is the
score-function term that makes the gradient of `w k` unbiased too; on policy (`lp_mu = sg(lp)`)
`w = 1` in value and the gradient is `(k + dk/dlp) grad lp`. This is TRL's
`use_bias_correction_kl` (trl/trainer/grpo_trainer.py `_compute_loss`:
`per_token_kl = per_token_kl * coef_1`, `coef_1 = exp(per_token_logps - old_per_token_logps)`,
the policy loss's own ratio, with gradient; with `importance_sampling_level="sequence"` the
sequence ratio), after DeepSeek-V3.2 (https://arxiv.org/abs/2512.02556, the unbiased KL
estimate). TRL applies it to k3 without clamps; here any estimator may be weighted, k3 keeps its
clamps (identical inside them) and the log-ratio of `w` is clamped to `[-clamp_input,
clamp_input]` so `w` stays finite.

References: the k1/k2/k3 estimators are Schulman 2020, Approximating KL Divergence,
http://joschu.net/blog/kl-approx.html; k3 as GRPO's KL term: Shao et al. 2024,
https://arxiv.org/abs/2402.03300 (eq. 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core.names import KL_ESTIMATORS


def kl_estimate(lp: jax.Array, lp_base: jax.Array, estimator: str = "k2", mask=None, *,
                clamp_input: float = 20.0, clamp_output: float = 10.0) -> jax.Array:
  """Per-token estimate of KL(pi || base) from the sampled tokens' log-probs.

  With `d = lp - sg(lp_base)`: `k1 = d`, `abs = |d|`, `k2 = d**2 / 2`, `k3 = exp(-d) - 1 + d` (see
  the module table for bias and variance). Only `k3` is clamped: `-d` to `[-clamp_input,
  clamp_input]` before `exp`, the value to `[0, clamp_output]`; where a clamp is active the
  token's gradient is 0. The gradient flows through `lp` only.

  Args:
    lp: `[B, N]` (any shape) log-probs of the sampled tokens under the policy being trained,
      with gradient.
    lp_base: same shape, the base policy's log-probs (reference model or sampler); a constant.
    estimator: one of `KL_ESTIMATORS`: "k1", "k2", "k3", "abs".
    mask: same shape, bool; None means every position. Masked positions may hold NaN/inf.
    clamp_input: bound on `-d` before `k3`'s `exp`.
    clamp_output: upper bound on the `k3` value.

  Returns:
    Per-token estimates, the shape of `lp`, dtype at least float32; 0 where `mask` is False.
    Reduce them to `(sum, count)` with `reduce`.

  Raises:
    ValueError: for an unknown estimator name.

  References:
    Schulman 2020, Approximating KL Divergence (blog), http://joschu.net/blog/kl-approx.html
    (k1, k2, k3); k3 as GRPO's KL penalty: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300
    (eq. 4).
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
  lp = jnp.asarray(lp)
  dtype = jnp.result_type(lp.dtype, jnp.float32)
  lp = lp.astype(dtype)
  base = jax.lax.stop_gradient(jnp.asarray(lp_base).astype(dtype))
  if mask is not None:
    # Sanitise before the arithmetic: the backward pass of exp/abs at a NaN position would
    # otherwise produce NaN * 0 = NaN in the gradient even though the value is masked.
    lp = jnp.where(mask, lp, 0.0)
    base = jnp.where(mask, base, 0.0)
  d = lp - base
  if estimator == "k1":
    out = d
  elif estimator == "abs":
    out = jnp.abs(d)
  elif estimator == "k2":
    out = 0.5 * d * d
  else:
    neg = jnp.clip(-d, -clamp_input, clamp_input)
    out = jnp.clip(jnp.exp(neg) - 1.0 - neg, 0.0, clamp_output)
  if mask is not None:
    out = jnp.where(mask, out, 0.0)
  return out


def importance_weight(lp: jax.Array, lp_behaviour: jax.Array, mask=None, *,
                      level: str = "token", clamp: float = 20.0) -> jax.Array:
  """Importance weight `w = exp(lp - sg(lp_behaviour))`, per token or per sequence.

  "token": `w_t = exp(lp_t - sg(lp_behaviour_t))`. "sequence": the row's geometric-mean ratio
  `exp(sum_t m (lp - sg(lp_behaviour)) / sum_t m)`, shared by every token of the row (GSPO's
  sequence ratio). The log-ratio is clamped to `[-clamp, clamp]`. Not detached: the gradient
  flows through `lp`.

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the policy being trained, with gradient.
    lp_behaviour: `[B, N]` log-probs under the policy that sampled them (the trainer's
      recompute `lp_old` or the sampler's `lp_gen`); a constant.
    mask: `[B, N]` bool; None means every token.
    level: "token" or "sequence".
    clamp: bound on the log-ratio, so `w` stays finite.

  Returns:
    `[B, N]` weights, dtype at least float32; 1 where `mask` is False.

  Raises:
    ValueError: for a `level` other than "token" or "sequence".

  References:
    The sequence-level ratio is GSPO's: Zheng et al. 2025, Group Sequence Policy Optimization,
    arXiv:2507.18071.
  """
  if level not in ("token", "sequence"):
    raise ValueError(f"unknown importance level {level!r}; expected 'token' or 'sequence'")
  lp = jnp.asarray(lp)
  dtype = jnp.result_type(lp.dtype, jnp.float32)
  lp = lp.astype(dtype)
  mu = jax.lax.stop_gradient(jnp.asarray(lp_behaviour).astype(dtype))
  mask = jnp.ones(lp.shape, bool) if mask is None else jnp.asarray(mask, bool)
  d = jnp.where(mask, jnp.where(mask, lp, 0.0) - jnp.where(mask, mu, 0.0), 0.0)
  if level == "sequence":
    n = jnp.sum(mask, axis=-1, keepdims=True).astype(dtype)
    d = jnp.broadcast_to(jnp.sum(d, axis=-1, keepdims=True) / jnp.maximum(n, 1.0), d.shape)
  return jnp.where(mask, jnp.exp(jnp.clip(d, -clamp, clamp)), 1.0)


def importance_weighted_kl(lp: jax.Array, lp_base: jax.Array, lp_behaviour: jax.Array,
                           estimator: str = "k3", mask=None, *, level: str = "token",
                           clamp_input: float = 20.0, clamp_output: float = 10.0) -> jax.Array:
  """Importance-weighted per-token KL estimate `w * k` for tokens sampled off-policy.

  `w = importance_weight(lp, lp_behaviour)` (with its gradient) and `k = kl_estimate(lp,
  lp_base)`: since `E_mu[(pi / mu) k] = E_pi[k]`, `w k` estimates KL(pi || base) without bias for
  tokens sampled from the behaviour policy mu, and so does its gradient (see the module
  docstring).

  Golden (k3, token): `lp = -1`, base `-2`, behaviour `-1.5`: `w = e^0.5 = 1.6487`,
  `d = 1`, `k3 = e^-1 - 1 + 1 = 0.3679`, value 0.6065; gradient `w k3 + w (1 - e^-1)` = 0.6065
  + 1.0422 = 1.6487 = `w d` (k3 + dk3/dd = d: the weighted k3's gradient is k2's, times w).

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the policy being trained, with gradient.
    lp_base: `[B, N]` the base (reference) policy's log-probs; a constant.
    lp_behaviour: `[B, N]` log-probs under the policy that sampled the tokens; a constant.
    estimator: one of `KL_ESTIMATORS` (default "k3").
    mask: `[B, N]` bool; None means every token.
    level: "token" or "sequence" weight (see `importance_weight`).
    clamp_input: `k3`'s input clamp, also the clamp of the weight's log-ratio.
    clamp_output: `k3`'s output clamp.

  Returns:
    `[B, N]` weighted per-token estimates, 0 where `mask` is False.

  References:
    DeepSeek-AI 2025, DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models (the
    unbiased KL estimate), arXiv:2512.02556; as TRL's `use_bias_correction_kl`. The estimators:
    Schulman 2020, Approximating KL Divergence, http://joschu.net/blog/kl-approx.html.
  """
  k = kl_estimate(lp, lp_base, estimator, mask, clamp_input=clamp_input,
                  clamp_output=clamp_output)
  w = importance_weight(lp, lp_behaviour, mask, level=level, clamp=clamp_input)
  out = w * k
  return out if mask is None else jnp.where(mask, out, 0.0)
