"""Off-policy corrections against the sampler's log-probs (`lp_gen`, "rollout_logprobs").

The sampler and the trainer never produce exactly the same distribution (other kernels, other
dtypes, stale params under lag), so the loss is re-weighted or masked by the behaviour ratio
`rho_t = exp(clip(lp_old - lp_gen, -20, 20))` (`lp_old`: the trainer's recompute). Everything
here is a constant for the gradient (`stop_gradient`).

A correction returns `Correction(weight [B, N], keep [B, N] bool, metrics)`; the loss becomes
`where(keep, weight * loss, 0)`. Several corrections compose by multiplying weights and
and-ing masks (`combine`). Reduction denominators are counted from the loss mask *before*
corrections, so a masked token contributes 0 without renormalising the others.

| name           | effect (row i, token t, m = loss mask, Delta = lp_old - lp_gen)              |
| -------------- | ---------------------------------------------------------------------------- |
| `token_tis`    | `w_t = min(rho_t, token_tis_cap)` (truncated importance sampling)             |
| `seq_tis`      | `w_i = min(exp(sum_t m Delta), seq_tis_cap)` for every token of row i         |
| `icepop`       | `w_t = rho_t * 1[icepop_low <= rho_t <= icepop_high]` (band mask)             |
| `seq_mask_tis` | `w_t = rho_t`; rows with `exp(mean_t Delta)` outside [seq_mask_low, _high]    |
|                | are masked whole                                                              |
| `geo_mask`     | rows with `exp(mean_t Delta)` outside [geo_mask_low, geo_mask_high] masked    |
| `product_mask` | rows with `exp(sum_t Delta)` outside [product_mask_low, _high] masked         |
| `outlier_mask` | rows with any valid `rho_t < outlier_low` or `> outlier_high` masked          |
| `dppo_tv`      | token masked when `A > 0` and `p - p_gen > dppo_delta_high`, or `A <= 0` and  |
|                | `p_gen - p > dppo_delta_low` (`p = exp(lp)`, current params; binary TV)       |

Means over tokens are `sum_t m x / max(1, sum_t m)`. Rows with no valid token are left alone.

References:
- `token_tis`, `seq_tis`: Yao et al. 2025, Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training, https://fengyao.notion.site/off-policy-rl.
- `icepop`: Ling Team (Ant Group) 2025, IcePop, https://ringtech.notion.site/icepop, and the
  Ring-1T report, https://arxiv.org/abs/2510.18855.
- `dppo_tv`: Qi et al. 2026, Rethinking the Trust Region in LLM Reinforcement Learning (DPPO,
  binary TV), https://arxiv.org/abs/2602.04879.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core.names import CORRECTION_KEYS, CORRECTIONS, WEIGHTING, check_registry
_LOG_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class CorrectionParams:
  """Thresholds of every correction (defaults from the literature; each one-line why)."""

  token_tis_cap: float = 2.0  # truncation of the token ratio
  seq_tis_cap: float = 5.0  # truncation of the sequence ratio (products grow fast)
  icepop_low: float = 0.5  # band of token ratios kept by icepop
  icepop_high: float = 2.0
  seq_mask_low: float = 0.5  # band of the geometric-mean sequence ratio for seq_mask_tis
  seq_mask_high: float = 2.0
  geo_mask_low: float = 0.99  # tight band: geometric means drift little when in sync
  geo_mask_high: float = 1.01
  product_mask_low: float = 0.5
  product_mask_high: float = 2.0
  outlier_low: float = 1e-4  # one token this far off marks the whole row as broken
  outlier_high: float = 100.0
  dppo_delta_low: float = 0.2  # allowed probability drop (A <= 0)
  dppo_delta_high: float = 0.2  # allowed probability rise (A > 0)


class Correction(NamedTuple):
  """A correction's output: the loss becomes `where(keep, weight * loss, 0)`.

  Attributes:
    weight: `[B, N]` float32 per-token weight, a constant.
    keep: `[B, N]` bool, False for the tokens the correction drops.
    metrics: name -> `(sum, count)` pair (e.g. the clipped or masked fraction).
  """
  weight: jax.Array  # [B, N] float32, constant
  keep: jax.Array  # [B, N] bool
  metrics: dict  # name -> (sum, count) pairs, already restricted to valid tokens / rows


# The config keys (`loss.<key>`, `core.names.CORRECTION_KEYS`) are `CorrectionParams`' fields,
# in order: a field added without its key fails at import, not when a run builds its step.
check_registry("CORRECTION_KEYS", CORRECTION_KEYS,
               [f.name for f in dataclasses.fields(CorrectionParams)])


def _delta(lp_old, lp_gen, mask):
  d = jax.lax.stop_gradient(jnp.asarray(lp_old, jnp.float32) - jnp.asarray(lp_gen, jnp.float32))
  return jnp.where(mask, jnp.clip(d, -_LOG_CLAMP, _LOG_CLAMP), 0.0)


def _row_stats(delta, mask):
  n = jnp.sum(mask, axis=-1).astype(jnp.float32)
  total = jnp.sum(delta, axis=-1)
  return n, total, total / jnp.maximum(n, 1.0)


def _frac(flags, over):
  """(sum, count) of boolean `flags` among the True entries of `over`."""
  return (jnp.sum(jnp.where(over, flags, False).astype(jnp.float32)),
          jnp.sum(over.astype(jnp.float32)))


def correction(name: str, lp: jax.Array, lp_old: jax.Array, lp_gen: jax.Array, adv: jax.Array,
               mask: jax.Array, params: CorrectionParams = CorrectionParams()) -> Correction:
  """One off-policy correction, by name, against the sampler's log-probs (see the module table).

  Args:
    name: one of `CORRECTIONS`: "token_tis", "seq_tis", "icepop", "seq_mask_tis", "geo_mask",
      "product_mask", "outlier_mask", "dppo_tv".
    lp: `[B, N]` log-probs under the current params; only "dppo_tv" reads it (no gradient).
    lp_old: `[B, N]` the trainer's recompute before the update.
    lp_gen: `[B, N]` the sampler's log-probs of the same tokens ("rollout_logprobs").
    adv: `[B]` or `[B, N]` advantages; only "dppo_tv" reads them (their sign).
    mask: `[B, N]` bool loss mask.
    params: the thresholds (`CorrectionParams`).

  Returns:
    `Correction(weight [B, N] float32, keep [B, N] bool, metrics)`; `metrics` maps one
    `"correction/..._frac"` name to a `(sum, count)` pair over the valid tokens or rows.

  Raises:
    ValueError: for an unknown correction name.

  References:
    "token_tis", "seq_tis": Yao et al. 2025, Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training (blog), https://fengyao.notion.site/off-policy-rl. "icepop": Ling
    Team 2025, Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
    Model (Ring-1T), arXiv:2510.18855. "dppo_tv": Qi et al. 2026, Rethinking the Trust Region in
    LLM Reinforcement Learning, arXiv:2602.04879. "seq_mask_tis", "geo_mask", "product_mask"
    and "outlier_mask" cite no paper here.
  """
  mask = jnp.asarray(mask, bool)
  delta = _delta(lp_old, lp_gen, mask)
  rho = jnp.where(mask, jnp.exp(delta), 1.0)
  ones = jnp.ones(mask.shape, jnp.float32)
  n, total, mean = _row_stats(delta, mask)
  rows = n > 0
  p = params
  if name == "token_tis":
    w = jnp.minimum(rho, p.token_tis_cap)
    return Correction(w, mask, {"correction/token_tis_clip_frac": _frac(rho > p.token_tis_cap,
                                                                        mask)})
  if name == "seq_tis":
    seq = jnp.exp(jnp.clip(total, -_LOG_CLAMP, _LOG_CLAMP))
    w = jnp.broadcast_to(jnp.minimum(seq, p.seq_tis_cap)[:, None], mask.shape)
    return Correction(w, mask, {"correction/seq_tis_clip_frac": _frac(seq > p.seq_tis_cap,
                                                                      rows)})
  if name == "icepop":
    inside = (rho >= p.icepop_low) & (rho <= p.icepop_high)
    return Correction(jnp.where(inside, rho, 0.0), mask & inside,
                      {"correction/icepop_masked_frac": _frac(~inside, mask)})
  if name in ("seq_mask_tis", "geo_mask", "product_mask"):
    if name == "product_mask":
      stat, lo, hi = jnp.exp(jnp.clip(total, -_LOG_CLAMP, _LOG_CLAMP)), p.product_mask_low, \
          p.product_mask_high
    elif name == "geo_mask":
      stat, lo, hi = jnp.exp(mean), p.geo_mask_low, p.geo_mask_high
    else:
      stat, lo, hi = jnp.exp(mean), p.seq_mask_low, p.seq_mask_high
    ok = (stat >= lo) & (stat <= hi)
    w = rho if name == "seq_mask_tis" else ones
    return Correction(w, mask & ok[:, None], {f"correction/{name}_masked_frac": _frac(~ok, rows)})
  if name == "outlier_mask":
    bad_tok = mask & ((rho < p.outlier_low) | (rho > p.outlier_high))
    bad = jnp.any(bad_tok, axis=-1)
    return Correction(ones, mask & ~bad[:, None],
                      {"correction/outlier_masked_frac": _frac(bad, rows)})
  if name == "dppo_tv":
    a = jnp.asarray(adv, jnp.float32)
    a = a[:, None] if a.ndim == 1 else a
    prob = jnp.exp(jax.lax.stop_gradient(jnp.where(mask, jnp.asarray(lp, jnp.float32), 0.0)))
    prob_gen = jnp.exp(jnp.where(mask, jnp.asarray(lp_gen, jnp.float32), 0.0))
    drop = jnp.where(a > 0, prob - prob_gen > p.dppo_delta_high,
                     prob_gen - prob > p.dppo_delta_low)
    return Correction(ones, mask & ~drop, {"correction/dppo_masked_frac": _frac(drop, mask)})
  raise ValueError(f"unknown correction {name!r}; expected one of {CORRECTIONS}")


def combine(names, lp, lp_old, lp_gen, adv, mask,
            params: CorrectionParams = CorrectionParams()) -> Correction:
  """Applies the corrections `names` in order: weights multiply, masks and, metrics merge.

  Args:
    names: sequence of correction names (e.g. from `parse_correction`); `()` is a no-op.
    lp: `[B, N]` log-probs under the current params; only "dppo_tv" reads it (no gradient).
    lp_old: `[B, N]` the trainer's recompute before the update.
    lp_gen: `[B, N]` the sampler's log-probs of the same tokens ("rollout_logprobs").
    adv: `[B]` or `[B, N]` advantages; only "dppo_tv" reads them (their sign).
    mask: `[B, N]` bool loss mask.
    params: the thresholds (`CorrectionParams`).

  Returns:
    A `Correction`: `keep` = `mask` and every correction's keep, `weight` = the product of the
    weights (0 where not kept), `metrics` = the union of theirs.

  Raises:
    ValueError: for an unknown correction name.

  References:
    Those of each correction: see `correction`.
  """
  mask = jnp.asarray(mask, bool)
  w, keep, metrics = jnp.ones(mask.shape, jnp.float32), mask, {}
  for name in names:
    c = correction(name, lp, lp_old, lp_gen, adv, mask, params)
    w, keep = w * c.weight, keep & c.keep
    metrics.update(c.metrics)
  return Correction(jnp.where(keep, w, 0.0), keep, metrics)


def parse_correction(text: str) -> tuple[str, ...]:
  """Parses a config string of correction names joined by `+`.

  `"none"` or `""` -> (); `"outlier_mask+token_tis"` -> ("outlier_mask", "token_tis").

  Args:
    text: the config value.

  Returns:
    The names in order, whitespace stripped (not validated: `correction` raises on an unknown
    one).
  """
  if text in ("", "none"):
    return ()
  return tuple(part.strip() for part in text.split("+"))
