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
  """Per-token output of a policy loss; every field is `[B, N]`.

  Attributes:
    loss: per-token loss, 0 where masked.
    ratio: the importance ratio the loss used (1 where masked, and for `reinforce`).
    clipped: float 1 where a clip bound (or the dual clip) was active, else 0.
  """
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
  """PPO's clipped surrogate per token, with asymmetric bounds and an optional dual clip.

  `loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))` with `r = exp(lp - lp_old)`; with a
  dual clip `c`, where `A < 0`: `min(loss, -A c)`.

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: `[B, N]` log-probs the ratio is taken against (the trainer's recompute before the
      update, or the sampler's); a constant (`stop_gradient` inside).
    adv: `[B]` per-sample advantages (broadcast over tokens) or `[B, N]` per-token ones.
    mask: `[B, N]` bool loss mask; `lp` and `lp_old` may hold NaN where it is False.
    eps_low: the ratio's lower clip bound is `1 - eps_low`.
    eps_high: the ratio's upper clip bound is `1 + eps_high` (`eps_high > eps_low`: DAPO's
      clip-higher).
    dual_clip: `c > 1` caps the loss of `A < 0` tokens at `-A c`; None for no dual clip.

  Returns:
    `PolicyLoss(loss, ratio, clipped)`, each `[B, N]`; where `mask` is False the loss is 0, the
    ratio 1 and `clipped` 0. Reduce `loss` with `reductions.reduce`.

  References:
    Schulman et al. 2017, Proximal Policy Optimization Algorithms, arXiv:1707.06347.
    Clip-higher (`eps_high > eps_low`): Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale, arXiv:2503.14476. Dual clip: Ye et al. 2020, Mastering Complex
    Control in MOBA Games with Deep Reinforcement Learning, arXiv:1912.09729.
  """
  ratio = jnp.exp(_log_ratio(lp, lp_old, mask))
  return _clipped_objective(ratio, _broadcast_adv(adv, lp), mask, eps_low, eps_high, dual_clip)


def gspo(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
         eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
         ) -> PolicyLoss:
  """GSPO: PPO's clip on a sequence-level ratio shared by every token of a row.

  `s_i = exp(sum_t m (lp - lp_old) / sum_t m)` replaces the token ratio, so
  `d s_i / d lp_t = s_i m_t / n_i`: every token of a row shares one ratio and one clip decision.
  Pair it with a sequence-mean reduction.

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: `[B, N]` log-probs the ratio is taken against (the trainer's recompute before the
      update, or the sampler's); a constant (`stop_gradient` inside).
    adv: `[B]` per-sample advantages (broadcast over tokens) or `[B, N]` per-token ones.
    mask: `[B, N]` bool loss mask; `lp` and `lp_old` may hold NaN where it is False.
    eps_low: the ratio's lower clip bound is `1 - eps_low`.
    eps_high: the ratio's upper clip bound is `1 + eps_high` (`eps_high > eps_low`: DAPO's
      clip-higher).
    dual_clip: `c > 1` caps the loss of `A < 0` tokens at `-A c`; None for no dual clip.

  Returns:
    `PolicyLoss(loss, ratio, clipped)`, each `[B, N]`; where `mask` is False the loss is 0, the
    ratio 1 and `clipped` 0. Reduce `loss` with `reductions.reduce`.
    `ratio` holds `s_i` on each valid token of row i.

  References:
    Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071.
  """
  log_ratio = _log_ratio(lp, lp_old, mask)
  n = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  seq = jnp.sum(log_ratio, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
  ratio = jnp.broadcast_to(jnp.exp(seq), lp.shape)
  return _clipped_objective(ratio, _broadcast_adv(adv, lp), mask, eps_low, eps_high, dual_clip)


def cispo(lp: jax.Array, lp_old: jax.Array, adv: jax.Array, mask: jax.Array, *,
          eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
          ) -> PolicyLoss:
  """CISPO: REINFORCE weighted by the clipped, detached importance ratio.

  `loss = -A sg(clip(r, 1 - eps_low, 1 + eps_high)) lp`: the clip only bounds the weight, so
  clipped tokens still get a gradient. For the mapping of `eps_low` / `eps_high` to MiniMax's,
  TRL's and verl's parameters see the module docstring.

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: `[B, N]` log-probs the ratio is taken against (the trainer's recompute before the
      update, or the sampler's); a constant (`stop_gradient` inside).
    adv: `[B]` per-sample advantages (broadcast over tokens) or `[B, N]` per-token ones.
    mask: `[B, N]` bool loss mask; `lp` and `lp_old` may hold NaN where it is False.
    eps_low: the ratio's lower clip bound is `1 - eps_low`.
    eps_high: the ratio's upper clip bound is `1 + eps_high` (`eps_high > eps_low`: DAPO's
      clip-higher).
    dual_clip: must be None (CISPO has no dual clip).

  Returns:
    `PolicyLoss(loss, ratio, clipped)`, each `[B, N]`; where `mask` is False the loss is 0, the
    ratio 1 and `clipped` 0. Reduce `loss` with `reductions.reduce`.
    `clipped` marks tokens whose ratio left the band.

  Raises:
    ValueError: if `dual_clip` is not None.

  References:
    MiniMax 2025, MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention
    (section 3), arXiv:2506.13585.
  """
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

  A smooth gate in place of the hard clip. `d loss / d lp = -A 4 s (1 - s) r` with
  `s = sigmoid(tau (r - 1))`: `-A` at `r = 1`, decaying smoothly (never to exactly 0, unlike the
  hard clip) as r leaves 1; a larger tau narrows the trust region. The log-ratio is clamped to
  [-20, 20] inside the gate as verl does (the gate is flat there; it keeps `r` finite).
  Golden (tau 1): `A = 1, r = 2`: loss `-4 sigmoid(1) = -2.9242`, gradient
  `-4 * 0.7311 * 0.2689 * 2 = -1.5729`.

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: `[B, N]` log-probs the ratio is taken against (the trainer's recompute before the
      update, or the sampler's); a constant (`stop_gradient` inside).
    adv: `[B]` per-sample advantages (broadcast over tokens) or `[B, N]` per-token ones.
    mask: `[B, N]` bool loss mask; `lp` and `lp_old` may hold NaN where it is False.
    tau_pos: gate temperature where `A > 0`.
    tau_neg: gate temperature where `A <= 0` (larger: negative updates damped faster).
    eps_low: unused (no clip).
    eps_high: unused (no clip).
    dual_clip: must be None.

  Returns:
    `PolicyLoss(loss, ratio, clipped)`, each `[B, N]`; where `mask` is False the loss is 0, the
    ratio 1 and `clipped` 0. Reduce `loss` with `reductions.reduce`.
    `clipped` is all 0; `ratio` is the unclamped `r`.

  Raises:
    ValueError: if `dual_clip` is not None.

  References:
    Gao et al. 2025, Soft Adaptive Policy Optimization, arXiv:2511.20347.
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
  """REINFORCE: the score-function loss `-A lp`.

  Args:
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: unused (kept for the common signature).
    adv: `[B]` per-sample advantages (broadcast over tokens) or `[B, N]` per-token ones.
    mask: `[B, N]` bool loss mask; `lp` and `lp_old` may hold NaN where it is False.
    eps_low: unused.
    eps_high: unused.
    dual_clip: unused.

  Returns:
    `PolicyLoss(loss, ratio, clipped)`, each `[B, N]`; where `mask` is False the loss is 0, the
    ratio 1 and `clipped` 0. Reduce `loss` with `reductions.reduce`.
    `ratio` is all 1 and `clipped` all 0.

  References:
    Williams 1992, Simple Statistical Gradient-Following Algorithms for Connectionist
    Reinforcement Learning, Machine Learning 8.
  """
  del lp_old, eps_low, eps_high, dual_clip
  a = _broadcast_adv(adv, lp)
  loss = jnp.where(mask, -a * jnp.where(mask, lp, 0.0), 0.0)
  return PolicyLoss(loss, jnp.ones_like(loss), jnp.zeros_like(loss))


POLICIES = {"ppo": ppo, "gspo": gspo, "cispo": cispo, "sapo": sapo, "reinforce": reinforce}
check_registry("POLICY_LOSSES", POLICY_LOSSES, POLICIES)


def policy_loss(name: str, lp, lp_old, adv, mask, **kw) -> PolicyLoss:
  """The policy loss named `name` (a key of `POLICIES`), applied to the arrays.

  Args:
    name: one of `POLICY_LOSSES`: "ppo", "gspo", "cispo", "sapo", "reinforce".
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: `[B, N]` log-probs the ratio is taken against (the trainer's recompute before the
      update, or the sampler's); a constant (`stop_gradient` inside).
    adv: `[B]` per-sample advantages (broadcast over tokens) or `[B, N]` per-token ones.
    mask: `[B, N]` bool loss mask; `lp` and `lp_old` may hold NaN where it is False.
    **kw: that loss's keyword settings: `eps_low`, `eps_high`, `dual_clip`, and for "sapo"
      also `tau_pos`, `tau_neg`.

  Returns:
    `PolicyLoss(loss, ratio, clipped)`, each `[B, N]`; where `mask` is False the loss is 0, the
    ratio 1 and `clipped` 0. Reduce `loss` with `reductions.reduce`.

  Raises:
    ValueError: for an unknown loss name.

  References:
    Those of the chosen loss: see `ppo`, `gspo`, `cispo`, `sapo` and `reinforce`.
  """
  if name not in POLICIES:
    raise ValueError(f"unknown policy loss {name!r}; expected one of {POLICY_LOSSES}")
  return POLICIES[name](lp, lp_old, adv, mask, **kw)
