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
  """Per-token KL estimate (see the module docstring); 0 where `mask` is False."""
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
  """`w = exp(lp - sg(lp_behaviour))` per token ("token"), or the row's
  `exp(sum_t m (lp - sg(lp_behaviour)) / sum_t m)` shared by its tokens ("sequence", GSPO's
  ratio); the log-ratio clamped to `[-clamp, clamp]`. Gradient through `lp`; 1 where masked."""
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
  """`importance_weight(lp, lp_behaviour) * kl_estimate(lp, lp_base)` per token: the KL estimate
  for tokens sampled from the behaviour policy (see the module docstring); 0 where masked.

  Golden (k3, token): `lp = -1`, base `-2`, behaviour `-1.5`: `w = e^0.5 = 1.6487`,
  `d = 1`, `k3 = e^-1 - 1 + 1 = 0.3679`, value 0.6065; gradient `w k3 + w (1 - e^-1)` = 0.6065
  + 1.0422 = 1.6487 = `w d` (k3 + dk3/dd = d: the weighted k3's gradient is k2's, times w).
  """
  k = kl_estimate(lp, lp_base, estimator, mask, clamp_input=clamp_input,
                  clamp_output=clamp_output)
  w = importance_weight(lp, lp_behaviour, mask, level=level, clamp=clamp_input)
  out = w * k
  return out if mask is None else jnp.where(mask, out, 0.0)
