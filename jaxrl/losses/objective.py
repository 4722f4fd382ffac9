"""The RL objective composed from the library's parts: one micro-batch's share of the loss.

    loss = [ reduce(where(keep, w * policy_loss, 0)) / C_policy ]
         + rollout_kl_coef * [ reduce(kl(lp, lp_gen)) / C_rollout_kl ]
         + ref_kl_coef     * [ reduce(kl(lp, lp_ref)) / C_ref_kl ]
         - entropy_coef    * [ reduce(entropy) / C_policy ]

With on-policy distillation (`distill_coef != 0`) the policy term's advantage is per token, from
the teacher's log-probs (`jaxrl.losses.distill`). `(w, keep)` come from the off-policy
corrections and the optional sequence masking by `seq_logprob_error_threshold`; each `C` is the
*global* count of its reduction over the whole batch (`global_counts`), so summing this
function over micro-batches gives the full-batch loss and gradient exactly, and a padding
micro-batch (mask all False) adds exactly 0.

Each KL term's reduction is `token_mean`, `seq_mean` (= `seq_mean_token_mean`) or `policy`: the
policy term's own `reduction` (with its `norm_len`), so e.g. under Dr. GRPO's constant normaliser
(`seq_mean_token_sum_norm`) the KL is normalised exactly like the policy term, as TRL does by
adding `beta * per_token_kl` to the per-token loss before its `loss_type` reduction. With
`ref_kl_importance_weighted` the reference KL is `w * kl(lp, lp_ref)` (`kl.importance_weighted_kl`,
TRL's `use_bias_correction_kl`), `w` the policy loss's ratio: `exp(lp - sg(base))` with the same
base (`ratio_base`), per sequence for `gspo`.

Metrics come back as a `Stats` partial (see `jaxrl.losses.stats`): `loss`, `loss/policy`,
`ratio/*`, `clip_frac`, `entropy`, `rollout_kl`, `ref_kl` (the weighted value when weighted),
`mismatch/*` and the corrections' fractions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.core.names import KL_REDUCTIONS as KL_REDUCTION_NAMES, check_registry
from jaxrl.losses import corrections as corr
from jaxrl.losses import stats as st
from jaxrl.losses.distill import reverse_kl, reverse_kl_advantages
from jaxrl.losses.kl import importance_weighted_kl, kl_estimate
from jaxrl.losses.mismatch import mismatch_metrics
from jaxrl.losses.policy import policy_loss
from jaxrl.losses.reductions import count, reduce

# KL reduction name -> the loss reduction it uses (None: the policy term's, `cfg.reduction`).
KL_REDUCTIONS = {"token_mean": "token_mean", "seq_mean": "seq_mean_token_mean", "policy": None}
check_registry("KL_REDUCTIONS", KL_REDUCTION_NAMES, KL_REDUCTIONS)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Static settings of the objective (hashable: part of the jitted step's identity)."""

  policy: str = "ppo"  # ppo | gspo | cispo | sapo | reinforce
  # The ratio's denominator: "trainer" = lp_old (the trainer's recompute before the update);
  # "rollout" = lp_gen (the behaviour policy that sampled the tokens), so with stale rollouts
  # (forced lag) the ratio and its clip span every update since sampling.
  ratio_base: str = "trainer"
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float | None = None  # c > 1 caps the loss of A < 0 tokens at -A c
  sapo_tau_pos: float = 1.0  # SAPO gate temperature where A > 0 (TRL's / verl's default)
  sapo_tau_neg: float = 1.05  # ... where A <= 0
  correction: tuple[str, ...] = ()  # names from jaxrl.losses.corrections, applied in order
  correction_params: corr.CorrectionParams = corr.CorrectionParams()
  reduction: str = "token_mean"
  norm_len: int | None = None  # seq_mean_token_sum_norm constant; None = completion length
  rollout_kl_coef: float = 0.0
  rollout_kl_estimator: str = "k2"
  rollout_kl_reduction: str = "token_mean"  # token_mean | seq_mean | policy
  ref_kl_coef: float = 0.0
  ref_kl_estimator: str = "k3"
  ref_kl_reduction: str = "token_mean"  # token_mean | seq_mean | policy
  # Weight the reference KL by the policy's ratio w = pi / pi_{ratio_base}, with its gradient:
  # unbiased for off-policy samples (TRL's use_bias_correction_kl).
  ref_kl_importance_weighted: bool = False
  entropy_coef: float = 0.0
  seq_logprob_error_threshold: float | None = None  # mask rows with E_i above it
  # On-policy distillation (`jaxrl.losses.distill`): with `distill_coef != 0` the policy term's
  # advantage is per token, distill_coef (lp_teacher - lp_gen) + distill_reward_weight A_seq.
  distill_coef: float = 0.0
  distill_reward_weight: float = 0.0

  def rollout_logprob_users(self) -> tuple[str, ...]:
    """The settings that need the sampler's log-probs (`lp_gen`), by their run-config key.

    Returns:
      A tuple of run-config keys (e.g. "loss.correction"); empty when `lp_gen` is not needed.
    """
    uses = (("loss.correction", bool(self.correction)),
            ("rollout_kl.coef", self.rollout_kl_coef != 0),
            ("loss.seq_logprob_error_threshold", self.seq_logprob_error_threshold is not None),
            ("loss.ratio_base", self.ratio_base == "rollout"))
    return tuple(key for key, on in uses if on)

  def kl_reduction(self, name: str) -> str:
    """The loss reduction a KL term with reduction `name` uses ("policy" = `self.reduction`).

    Args:
      name: one of `KL_REDUCTIONS`: "token_mean", "seq_mean", "policy".

    Returns:
      A name of `reductions.REDUCTIONS`.

    Raises:
      ValueError: for an unknown KL reduction name.
    """
    if name not in KL_REDUCTIONS:
      raise ValueError(f"unknown KL reduction {name!r}; expected one of {KL_REDUCTION_NAMES}")
    return KL_REDUCTIONS[name] or self.reduction

  def reductions(self) -> tuple[str, ...]:
    """Every reduction whose global count the objective divides by.

    Returns:
      The sorted tuple of distinct reduction names (the policy term's and both KL terms').
    """
    return tuple(sorted({self.reduction, self.kl_reduction(self.rollout_kl_reduction),
                         self.kl_reduction(self.ref_kl_reduction)}))


def global_counts(cfg: ObjectiveConfig, mask: jax.Array) -> dict[str, jax.Array]:
  """Whole-batch counts of every reduction the objective divides by (computed once per step).

  Args:
    cfg: the objective's settings.
    mask: `[B, N]` bool loss mask of the *whole* batch (every micro-batch and host).

  Returns:
    `{reduction name: float32 scalar count}` (`reductions.count`) for each of
    `cfg.reductions()`; pass it as `counts` to `objective`.
  """
  return {name: count(name, mask) for name in cfg.reductions()}


def _check_inputs(cfg: ObjectiveConfig, lp_gen, lp_ref, entropy, lp_teacher) -> None:
  """Raises ValueError naming an input `objective`'s settings need but did not get, or an
  unknown `ratio_base`."""
  users = cfg.rollout_logprob_users()
  if users and lp_gen is None:
    raise ValueError(f"this objective needs the sampler's log-probs (lp_gen) for "
                     f"{', '.join(users)}")
  if cfg.ref_kl_coef != 0 and lp_ref is None:
    raise ValueError("ref_kl_coef != 0 needs the reference log-probs (lp_ref)")
  if cfg.entropy_coef != 0 and entropy is None:
    raise ValueError("entropy_coef != 0 needs the per-token entropy")
  if cfg.distill_coef != 0 and lp_teacher is None:
    raise ValueError("distill_coef != 0 needs the teacher's log-probs (lp_teacher)")
  if cfg.ratio_base not in ("trainer", "rollout"):
    raise ValueError(f"unknown ratio_base {cfg.ratio_base!r}; expected 'trainer' or 'rollout'")


def objective(cfg: ObjectiveConfig, lp: jax.Array, lp_old: jax.Array, adv: jax.Array,
              mask: jax.Array, counts: dict[str, jax.Array], *, lp_gen: jax.Array | None = None,
              lp_ref: jax.Array | None = None, entropy: jax.Array | None = None,
              lp_teacher: jax.Array | None = None) -> tuple[jax.Array, st.Stats]:
  """This micro-batch's share of the RL loss, and its metric partials.

  The loss is composed as in the module docstring; summed over micro-batches it gives the
  full-batch loss and gradient exactly.

  Args:
    cfg: the static settings (`ObjectiveConfig`).
    lp: `[B, N]` log-probs of the sampled tokens under the params being trained, with gradient.
    lp_old: `[B, N]` the trainer's recompute before the update; a constant.
    adv: `[B]` per-sample advantages (or `[B, N]` per-token ones).
    mask: `[B, N]` bool loss mask (all False for a padding micro-batch).
    counts: `global_counts(cfg, mask_of_the_whole_batch)`.
    lp_gen: `[B, N]` the sampler's log-probs; required when a correction, the rollout-KL term,
      the error threshold or `ratio_base="rollout"` is on.
    lp_ref: `[B, N]` the reference model's log-probs; required when `ref_kl_coef != 0`.
    entropy: `[B, N]` per-token entropy; required when `entropy_coef != 0`.
    lp_teacher: `[B, N]` the teacher's log-probs; required when `distill_coef != 0`. Then `adv`
      (the task reward's `[B]` advantages) is replaced by the per-token distillation advantages
      of `jaxrl.losses.distill.reverse_kl_advantages`, against `lp_gen` (or `lp_old` without
      it), and the metric `distill/reverse_kl` is the row mean of the summed `lp - lp_teacher`.

  Returns:
    `(loss, stats)`: the float32 scalar loss of this micro-batch, and a `Stats` partial of its
    metrics (combine with `stats.merge`, then `stats.finalize`).

  Raises:
    ValueError: when an input the settings need is missing, or `ratio_base` is unknown.

  References:
    Those of its parts: see `policy_loss`, `kl_estimate`, `importance_weighted_kl`,
    `correction`, `reduce` and `reverse_kl_advantages`.
  """
  _check_inputs(cfg, lp_gen, lp_ref, entropy, lp_teacher)
  mask = jnp.asarray(mask, bool)
  div = lambda s, red: s / jnp.maximum(counts[red], 1.0)
  distill_parts = []
  if cfg.distill_coef != 0:
    behaviour = jax.lax.stop_gradient(lp_gen if lp_gen is not None else lp_old)
    adv = reverse_kl_advantages(lp_teacher, behaviour, mask, coef=cfg.distill_coef,
                                seq_advantages=adv, reward_weight=cfg.distill_reward_weight)
    distill_parts.append(st.Stats(
        {"distill/reverse_kl": reverse_kl(jax.lax.stop_gradient(lp), lp_teacher, mask)},
        {}, {}, {}))

  kw = dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip)
  if cfg.policy == "sapo":
    kw.update(tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
  ratio_base = lp_gen if cfg.ratio_base == "rollout" else lp_old
  pol = policy_loss(cfg.policy, lp, ratio_base, adv, mask, **kw)
  parts = distill_parts
  weight, keep = jnp.ones(mask.shape, jnp.float32), mask
  if lp_gen is not None:
    mm, keep_rows = mismatch_metrics(lp_old, lp_gen, mask, cfg.seq_logprob_error_threshold)
    parts.append(mm)
    keep = keep & keep_rows[:, None]
    if cfg.correction:
      c = corr.combine(cfg.correction, lp, lp_old, lp_gen, adv, mask, cfg.correction_params)
      weight, keep = c.weight, keep & c.keep
      parts.append(st.Stats(dict(c.metrics), {}, {}, {}))
  pg_sum, pg_n = reduce(cfg.reduction, jnp.where(keep, weight * pol.loss, 0.0), mask,
                        cfg.norm_len)
  loss = div(pg_sum, cfg.reduction)

  means = {
      "loss/policy": (pg_sum, pg_n),
      "ratio/mean": st.masked_mean(pol.ratio, mask),
      "clip_frac": st.masked_mean(pol.clipped, mask),
      "keep_frac": st.masked_mean(keep.astype(jnp.float32), mask),
  }
  maxes = {"ratio/max": st.masked_max(pol.ratio, mask)}
  mins = {"ratio/min": st.masked_min(pol.ratio, mask)}
  kl_terms = (("rollout_kl", lp_gen, cfg.rollout_kl_estimator, cfg.rollout_kl_reduction,
               cfg.rollout_kl_coef, False),
              ("ref_kl", lp_ref, cfg.ref_kl_estimator, cfg.ref_kl_reduction, cfg.ref_kl_coef,
               cfg.ref_kl_importance_weighted))
  for name, base, estimator, reduction, coef, weighted in kl_terms:
    if base is None:
      continue
    red = cfg.kl_reduction(reduction)
    if weighted:
      level = "sequence" if cfg.policy == "gspo" else "token"
      kl = importance_weighted_kl(lp, base, ratio_base, estimator, mask, level=level)
    else:
      kl = kl_estimate(lp, base, estimator, mask)
    kl_sum, kl_n = reduce(red, kl, mask, cfg.norm_len)
    means[name] = (kl_sum, kl_n)
    if coef != 0:
      loss = loss + coef * div(kl_sum, red)
  if entropy is not None:
    ent_sum, _ = reduce(cfg.reduction, entropy, mask, cfg.norm_len)
    means["entropy"] = st.masked_mean(entropy, mask)
    if cfg.entropy_coef != 0:
      loss = loss - cfg.entropy_coef * div(ent_sum, cfg.reduction)
  parts.append(st.Stats(means, {"loss": loss}, maxes, mins))
  return loss, st.union(*parts)
