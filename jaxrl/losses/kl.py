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

References: the k1/k2/k3 estimators are Schulman 2020, Approximating KL Divergence,
http://joschu.net/blog/kl-approx.html; k3 as GRPO's KL term: Shao et al. 2024,
https://arxiv.org/abs/2402.03300 (eq. 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.names import KL_ESTIMATORS


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
