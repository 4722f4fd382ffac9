"""Per-token policy-gradient losses.

Inputs, per token of a `[B, N]` batch: `lp` (log-prob under the params being trained, with
gradient), `lp_old` (the trainer's recompute before the update; a constant), advantages `adv`
(`[B]`, broadcast over tokens, or `[B, N]`) and the loss `mask`. Each loss returns a `PolicyLoss`
of per-token arrays; a reduction (`jaxrl.losses.reductions`) turns the loss into `(sum, count)`.
`r = exp(lp - lp_old)`, `clip(r) = clip(r, 1 - eps_low, 1 + eps_high)`.

| name        | per-token loss                                                              |
| ----------- | --------------------------------------------------------------------------- |
| `ppo`       | `max(-A r, -A clip(r))`; with dual clip `c > 1`, where `A < 0`:              |
|             | `min(max(-A r, -A clip(r)), -A c)`                                           |
| `gspo`      | as `ppo` with the sequence ratio `s_i = exp(masked_mean_t(lp - lp_old))`     |
|             | shared by every token of row i (pair it with a sequence-mean reduction)     |
| `cispo`     | `-A sg(clip(r)) lp`: the clipped ratio only weights the REINFORCE gradient,  |
|             | so clipped tokens still get a gradient                                      |
| `sapo`      | `-A f_tau(r)`, `f_tau(r) = (4 / tau) sigmoid(tau (r - 1))`, `tau = tau_pos`  |
|             | where `A > 0` else `tau_neg`: a smooth gate in place of the hard clip        |
| `reinforce` | `-A lp`                                                                      |

With one update per batch (`lp_old = sg(lp)`), `r = 1` and `ppo`, `gspo`, `cispo`, `sapo` and
`reinforce` all have the gradient `-A grad lp` (SAPO: `f_tau'(1) = 4 sigmoid'(0) = 1`). Values at
masked positions are sanitised with `where`, so a NaN in a masked `lp_old` never reaches a value
or a gradient.

CISPO's clip keys: jaxrl clips the detached weight to `[1 - eps_low, 1 + eps_high]`, the
paper's `clip(r, 1 - eps_low^IS, 1 + eps_high^IS)` (MiniMax-M1, eq. 5) with the same names as
verl's `clip_ratio_low` / `clip_ratio_high`. MiniMax-M1 sets no lower bound in practice and tunes
only `eps_high^IS`: `eps_low = 1` here (the weight `r > 0` is then never clipped below). TRL's
`loss_type="cispo"` clamps `min(r, epsilon_high)` with no lower bound, so its `epsilon_high` is an
upper bound on the *ratio* (ScaleRL's `eps_max`, recommended 5.0): TRL `epsilon_high = E` is
jaxrl `eps_low = 1, eps_high = E - 1` (e.g. 1.0 and 4.0 for E = 5).

References:
- `ppo`: Schulman et al. 2017, Proximal Policy Optimization Algorithms,
  https://arxiv.org/abs/1707.06347. Asymmetric bounds (`eps_high > eps_low`, "clip-higher"):
  DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476. Dual clip: Ye et al. 2020, Mastering
  Complex Control in MOBA Games with Deep Reinforcement Learning, https://arxiv.org/abs/1912.09729.
- `gspo`: Zheng et al. 2025, Group Sequence Policy Optimization,
  https://arxiv.org/abs/2507.18071.
- `cispo`: MiniMax 2025, MiniMax-M1 (section 3), https://arxiv.org/abs/2506.13585.
- `sapo`: Gao et al. (Qwen team) 2025, Soft Adaptive Policy Optimization,
  https://arxiv.org/abs/2511.20347 (the token gate `f_{i,t}` and the advantage-sign temperature;
  defaults `tau_pos = 1.0`, `tau_neg = 1.05` are TRL's `sapo_temperature_pos/neg` and verl's
  `tau_pos/tau_neg`, both citing the paper; `tau_neg > tau_pos` damps negative-advantage updates
  faster, the side the paper argues is less stable). Same formula as TRL
  (trl/trainer/grpo_trainer.py `_compute_loss`, `loss_type == "sapo"`) and verl
  (verl/trainer/ppo/core_algos.py `compute_policy_loss_sapo`).
- `reinforce`: Williams 1992, Simple statistical gradient-following algorithms for connectionist
  reinforcement learning, Machine Learning 8.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core.names import POLICY_LOSSES, check_registry


class PolicyLoss(NamedTuple):
  loss: jax.Array  # [B, N] per-token loss (0 where masked)
  ratio: jax.Array  # [B, N] the importance ratio the loss used (1 for reinforce)
  clipped: jax.Array  # [B, N] float 1 where a clip bound (or the dual clip) was active


def _broadcast_adv(adv: jax.Array, like: jax.Array) -> jax.Array:
  adv = jnp.asarray(adv, jnp.float32)
  return adv[:, None] if adv.ndim == 1 else adv


def _log_ratio(lp, lp_old, mask):
  # At least float32, as in `kl_estimate`: a bf16 ratio cannot resolve 1 +- 4e-3, so exp in bf16
  # would blur every clip decision (GSPO's clip range is ~3e-4).
  lp = jnp.asarray(lp)
  dtype = jnp.result_type(lp.dtype, jnp.float32)
  return jnp.where(mask, lp.astype(dtype) - jax.lax.stop_gradient(jnp.asarray(lp_old, dtype)),
                   0.0)


def _clipped_objective(ratio, a, mask, eps_low, eps_high, dual_clip):
  # A NaN advantage at a masked token would reach GSPO's shared row ratio as 0 * NaN.
  a = jnp.where(mask, a, 0.0)
  clamped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  unclipped_loss = -a * ratio
  clipped_loss = -a * clamped
  loss = jnp.maximum(unclipped_loss, clipped_loss)
  clipped = clipped_loss > unclipped_loss
  if dual_clip is not None:
    # For A < 0 a huge ratio makes -A r unbounded; the dual clip caps the loss at -A c.
    dual = (a < 0) & (loss > -a * dual_clip)
    loss = jnp.where(dual, -a * dual_clip, loss)
    clipped = clipped | dual
  return PolicyLoss(jnp.where(mask, loss, 0.0), jnp.where(mask, ratio, 1.0),
                    jnp.where(mask, clipped, False).astype(jnp.float32))


def ppo(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
        eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
        ) -> PolicyLoss:
  """PPO clip with asymmetric bounds and optional dual clip (see the module table)."""
  ratio = jnp.exp(_log_ratio(lp, lp_old, mask))
  return _clipped_objective(ratio, _broadcast_adv(adv, lp), mask, eps_low, eps_high, dual_clip)


def gspo(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
         eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
         ) -> PolicyLoss:
  """GSPO: `s_i = exp(sum_t m (lp - lp_old) / sum_t m)` replaces the token ratio.

  `d s_i / d lp_t = s_i m_t / n_i`: every token of a row shares one ratio and one clip decision.
  """
  log_ratio = _log_ratio(lp, lp_old, mask)
  n = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  seq = jnp.sum(log_ratio, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
  ratio = jnp.broadcast_to(jnp.exp(seq), lp.shape)
  return _clipped_objective(ratio, _broadcast_adv(adv, lp), mask, eps_low, eps_high, dual_clip)


def cispo(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
          eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
          ) -> PolicyLoss:
  """CISPO: `-A sg(clip(r, 1 - eps_low, 1 + eps_high)) lp` (no dual clip); for the mapping of
  `eps_low` / `eps_high` to MiniMax's, TRL's and verl's parameters see the module docstring."""
  if dual_clip is not None:
    raise ValueError("cispo does not take a dual clip")
  a = _broadcast_adv(adv, lp)
  ratio = jnp.exp(_log_ratio(lp, lp_old, mask))
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  lp_safe = jnp.where(mask, lp, 0.0)
  clipped = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
  return PolicyLoss(jnp.where(mask, -a * weight * lp_safe, 0.0), jnp.where(mask, ratio, 1.0),
                    jnp.where(mask, clipped, False).astype(jnp.float32))


def sapo(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
         tau_pos: float = 1.0, tau_neg: float = 1.05, eps_low: float = 0.2, eps_high: float = 0.2,
         dual_clip: float | None = None) -> PolicyLoss:
  """SAPO: `-A (4 / tau) sigmoid(tau (r - 1))`, `tau = tau_pos` where `A > 0` else `tau_neg`.

  `d loss / d lp = -A 4 s (1 - s) r` with `s = sigmoid(tau (r - 1))`: `-A` at `r = 1`, decaying
  smoothly (never to exactly 0, unlike the hard clip) as r leaves 1; a larger tau narrows the
  trust region. The log-ratio is clamped to [-20, 20] inside the gate as verl does (the gate is
  flat there; it keeps `r` finite). `eps_low` / `eps_high` are unused (no clip: `clipped` is 0).
  Golden (tau 1): `A = 1, r = 2`: loss `-4 sigmoid(1) = -2.9242`, gradient
  `-4 * 0.7311 * 0.2689 * 2 = -1.5729`.
  """
  del eps_low, eps_high
  if dual_clip is not None:
    raise ValueError("sapo does not take a dual clip")
  a = jnp.where(mask, _broadcast_adv(adv, lp), 0.0)
  log_ratio = _log_ratio(lp, lp_old, mask)
  tau = jnp.where(a > 0, tau_pos, tau_neg).astype(log_ratio.dtype)
  gate = jax.nn.sigmoid(tau * (jnp.exp(jnp.clip(log_ratio, -20.0, 20.0)) - 1.0)) * (4.0 / tau)
  return PolicyLoss(jnp.where(mask, -a * gate, 0.0), jnp.where(mask, jnp.exp(log_ratio), 1.0),
                    jnp.zeros(log_ratio.shape, jnp.float32))


def reinforce(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
              eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
              ) -> PolicyLoss:
  """REINFORCE: `-A lp` (lp_old and the clip settings are unused)."""
  del lp_old, eps_low, eps_high, dual_clip
  a = _broadcast_adv(adv, lp)
  loss = jnp.where(mask, -a * jnp.where(mask, lp, 0.0), 0.0)
  return PolicyLoss(loss, jnp.ones_like(loss), jnp.zeros_like(loss))


POLICIES = {"ppo": ppo, "gspo": gspo, "cispo": cispo, "sapo": sapo, "reinforce": reinforce}
check_registry("POLICY_LOSSES", POLICY_LOSSES, POLICIES)


def policy_loss(name: str, lp, lp_old, adv, mask, **kw) -> PolicyLoss:
  """The loss named `name` (a key of `POLICIES`)."""
  if name not in POLICIES:
    raise ValueError(f"unknown policy loss {name!r}; expected one of {POLICY_LOSSES}")
  return POLICIES[name](lp, lp_old, adv, mask, **kw)
