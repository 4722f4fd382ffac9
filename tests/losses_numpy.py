"""Independent float64 NumPy references for `jaxrl.losses`, written from the formulas only.

Nothing here imports jaxrl: configs are read by attribute (duck typing), so the tests can pass
jaxrl's dataclasses or any object with the same fields. Values at masked positions are replaced
by 0 first, so the references never see NaN/inf; loops favour plainness over speed.
`lp_sg` is the value of `lp` seen under a stop-gradient (CISPO's weight, DPPO's probability):
finite differences perturb `lp` only and hold `lp_sg` fixed.
"""

from __future__ import annotations

import numpy as np

CLAMP = 20.0


def f64(x):
  return np.asarray(x, np.float64)


def _clean(x, mask):
  return np.where(mask, f64(np.where(mask, x, 0.0)), 0.0)


# --- advantages -----------------------------------------------------------------------------


def advantages(estimator, rewards, group_id, valid=None, eps=1e-6, ddof=0, clip_low=None,
               clip_high=None):
  r = f64(rewards)
  gid = np.asarray(group_id)
  b = r.shape[0]
  valid = np.ones(b, bool) if valid is None else np.asarray(valid, bool)
  out = np.zeros(b)
  batch = r[valid]
  for g in set(gid.tolist()):
    idx = [i for i in range(b) if gid[i] == g and valid[i]]
    vals = r[idx]
    n = len(idx)
    for i in idx:
      if estimator == "grpo":
        if n <= ddof or vals.max() == vals.min():
          continue  # no spread: exactly 0
        mean = vals.sum() / n
        std = np.sqrt(((vals - mean) ** 2).sum() / (n - ddof))
        out[i] = (r[i] - mean) / (std + eps)
      elif estimator == "grpo_batch_std":
        # Group mean, std of every valid reward of the batch (0 without spread in either).
        nb = len(batch)
        if vals.max() == vals.min() or nb <= ddof or batch.max() == batch.min():
          continue
        std = np.sqrt(((batch - batch.mean()) ** 2).sum() / (nb - ddof))
        out[i] = (r[i] - vals.sum() / n) / (std + eps)
      elif estimator == "dr_grpo":
        out[i] = r[i] - vals.sum() / n
      elif estimator == "rloo":
        if n > 1:
          out[i] = r[i] - (vals.sum() - r[i]) / (n - 1)
      else:
        raise ValueError(estimator)
  if clip_low is not None:
    out = np.maximum(out, clip_low)
  if clip_high is not None:
    out = np.minimum(out, clip_high)
  return out


# --- KL estimators --------------------------------------------------------------------------


def importance_weighted_kl(lp, base, behaviour, estimator, mask, level="token", clamp=20.0):
  """`w * k`, `w = exp(lp - behaviour)` per token or the row's exp(mean over valid tokens)
  (log-ratio clamped to +-clamp); the value only (its gradient by `fd_grad`)."""
  mask = np.asarray(mask, bool)
  d = _clean(lp, mask) - _clean(behaviour, mask)
  if level == "sequence":
    n = np.maximum(mask.sum(axis=1, keepdims=True), 1)
    d = np.repeat(d.sum(axis=1, keepdims=True) / n, d.shape[1], axis=1)
  w = np.exp(np.clip(d, -clamp, clamp))
  return np.where(mask, w * kl(lp, base, estimator, mask)[0], 0.0)


def kl(lp, base, estimator, mask=None, clamp_input=20.0, clamp_output=10.0):
  """Per-token value and its analytic derivative with respect to `lp`."""
  lp = f64(lp)
  mask = np.ones(lp.shape, bool) if mask is None else np.asarray(mask, bool)
  d = _clean(lp, mask) - _clean(base, mask)
  if estimator == "k1":
    v, g = d, np.ones_like(d)
  elif estimator == "abs":
    v, g = np.abs(d), np.sign(d)
  elif estimator == "k2":
    v, g = d * d / 2, d
  elif estimator == "k3":
    v = np.exp(-d) - 1 + d
    g = 1 - np.exp(-d)
    # -d beyond +-clamp_input: the exponent is frozen, so the token has no gradient.
    frozen = np.abs(d) > clamp_input
    neg = np.clip(-d, -clamp_input, clamp_input)
    v = np.where(frozen, np.exp(neg) - 1 - neg, v)
    over = v > clamp_output
    v = np.minimum(v, clamp_output)
    g = np.where(frozen | over, 0.0, g)
  else:
    raise ValueError(estimator)
  return np.where(mask, v, 0.0), np.where(mask, g, 0.0)


# --- policy losses --------------------------------------------------------------------------


def policy(name, lp, lp_old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip=None, lp_sg=None,
           tau_pos=1.0, tau_neg=1.05):
  """(loss, ratio, clipped) per token, float64."""
  mask = np.asarray(mask, bool)
  b, n = mask.shape
  lp_sg = lp if lp_sg is None else lp_sg
  lp, lp_sg, lp_old = _clean(lp, mask), _clean(lp_sg, mask), _clean(lp_old, mask)
  a = f64(adv)
  a = np.repeat(a[:, None], n, axis=1) if a.ndim == 1 else a
  a = np.where(mask, a, 0.0)
  loss = np.zeros((b, n))
  ratio = np.ones((b, n))
  clipped = np.zeros((b, n))
  lo, hi = 1 - eps_low, 1 + eps_high
  for i in range(b):
    valid = [t for t in range(n) if mask[i, t]]
    if name == "gspo" and valid:
      seq = np.exp(sum(lp[i, t] - lp_old[i, t] for t in valid) / len(valid))
    for t in valid:
      if name == "reinforce":
        loss[i, t] = -a[i, t] * lp[i, t]
        continue
      if name == "sapo":
        r = np.exp(lp[i, t] - lp_old[i, t])
        tau = tau_pos if a[i, t] > 0 else tau_neg
        ratio[i, t] = r
        loss[i, t] = -a[i, t] * 4.0 / tau / (1.0 + np.exp(-tau * (r - 1.0)))
        continue
      if name == "cispo":
        r_sg = np.exp(lp_sg[i, t] - lp_old[i, t])
        ratio[i, t] = r_sg
        loss[i, t] = -a[i, t] * min(max(r_sg, lo), hi) * lp[i, t]
        clipped[i, t] = float(r_sg < lo or r_sg > hi)
        continue
      r = seq if name == "gspo" else np.exp(lp[i, t] - lp_old[i, t])
      ratio[i, t] = r
      plain, capped = -a[i, t] * r, -a[i, t] * min(max(r, lo), hi)
      value, was_clipped = max(plain, capped), capped > plain
      if dual_clip is not None and a[i, t] < 0 and value > -a[i, t] * dual_clip:
        value, was_clipped = -a[i, t] * dual_clip, True
      loss[i, t], clipped[i, t] = value, float(was_clipped)
  return loss, ratio, clipped


# --- reductions -----------------------------------------------------------------------------


def reduce(name, x, mask, norm_len=None):
  mask = np.asarray(mask, bool)
  x = _clean(x, mask)
  b, n = mask.shape
  total, cnt = 0.0, 0.0
  for i in range(b):
    ni = int(mask[i].sum())
    row = sum(x[i, t] for t in range(n) if mask[i, t])
    if name == "token_mean":
      total, cnt = total + row, cnt + ni
      continue
    if ni == 0:
      continue
    cnt += 1
    if name == "seq_mean_token_mean":
      total += row / ni
    elif name == "seq_mean_token_sum":
      total += row
    elif name == "seq_mean_token_sum_norm":
      total += row / (n if norm_len is None else norm_len)
    else:
      raise ValueError(name)
  return total, cnt


def count(name, mask):
  return reduce(name, np.zeros(np.shape(mask)), mask)[1]


# --- off-policy corrections -----------------------------------------------------------------


def correction(name, lp, lp_old, lp_gen, adv, mask, p):
  """(weight, keep, metrics {name: (sum, count)}) of one correction; `p` has the thresholds."""
  mask = np.asarray(mask, bool)
  b, n = mask.shape
  delta = np.clip(_clean(lp_old, mask) - _clean(lp_gen, mask), -CLAMP, CLAMP)
  rho = np.where(mask, np.exp(delta), 1.0)
  a = f64(adv)
  a = np.repeat(a[:, None], n, axis=1) if a.ndim == 1 else a
  w = np.ones((b, n))
  keep = mask.copy()
  flags = []  # flag per counted token or row, for the metric
  for i in range(b):
    valid = [t for t in range(n) if mask[i, t]]
    if not valid:
      continue
    total = sum(delta[i, t] for t in valid)
    geo = np.exp(total / len(valid))
    prod = np.exp(np.clip(total, -CLAMP, CLAMP))
    if name == "token_tis":
      for t in valid:
        w[i, t] = min(rho[i, t], p.token_tis_cap)
        flags.append(rho[i, t] > p.token_tis_cap)
    elif name == "seq_tis":
      w[i, :] = min(prod, p.seq_tis_cap)
      flags.append(prod > p.seq_tis_cap)
    elif name == "icepop":
      for t in valid:
        inside = p.icepop_low <= rho[i, t] <= p.icepop_high
        w[i, t] = rho[i, t] if inside else 0.0
        keep[i, t] = inside
        flags.append(not inside)
    elif name in ("seq_mask_tis", "geo_mask", "product_mask"):
      stat, lo, hi = {"seq_mask_tis": (geo, p.seq_mask_low, p.seq_mask_high),
                      "geo_mask": (geo, p.geo_mask_low, p.geo_mask_high),
                      "product_mask": (prod, p.product_mask_low, p.product_mask_high)}[name]
      inside = lo <= stat <= hi
      for t in valid:
        if name == "seq_mask_tis":
          w[i, t] = rho[i, t]
        keep[i, t] = inside
      flags.append(not inside)
    elif name == "outlier_mask":
      bad = any(rho[i, t] < p.outlier_low or rho[i, t] > p.outlier_high for t in valid)
      for t in valid:
        keep[i, t] = not bad
      flags.append(bad)
    elif name == "dppo_tv":
      for t in valid:
        prob, prob_gen = np.exp(f64(lp)[i, t]), np.exp(f64(lp_gen)[i, t])
        if a[i, t] > 0:
          drop = prob - prob_gen > p.dppo_delta_high
        else:
          drop = prob_gen - prob > p.dppo_delta_low
        keep[i, t] = not drop
        flags.append(drop)
    else:
      raise ValueError(name)
  key = {"token_tis": "token_tis_clip_frac", "seq_tis": "seq_tis_clip_frac",
         "icepop": "icepop_masked_frac", "outlier_mask": "outlier_masked_frac",
         "dppo_tv": "dppo_masked_frac"}.get(name, f"{name}_masked_frac")
  metrics = {f"correction/{key}": (float(sum(flags)), float(len(flags)))}
  return np.where(keep, w, 0.0), keep, metrics


def combine(names, lp, lp_old, lp_gen, adv, mask, p):
  mask = np.asarray(mask, bool)
  w, keep, metrics = np.ones(mask.shape), mask.copy(), {}
  for name in names:
    cw, ck, cm = correction(name, lp, lp_old, lp_gen, adv, mask, p)
    w, keep = w * cw, keep & ck
    metrics.update(cm)
  return np.where(keep, w, 0.0), keep, metrics


# --- mismatch metrics -----------------------------------------------------------------------


def mismatch(lp_old, lp_gen, mask, seq_threshold=None):
  """(finalised metric dict, keep_rows)."""
  mask = np.asarray(mask, bool)
  b, n = mask.shape
  delta = np.clip(_clean(lp_old, mask) - _clean(lp_gen, mask), -CLAMP, CLAMP)
  toks = [(i, t) for i in range(b) for t in range(n) if mask[i, t]]
  err = [abs(delta[i, t]) for i, t in toks]
  rho = [np.exp(delta[i, t]) for i, t in toks]
  gen_kl = [np.exp(delta[i, t]) - 1 - delta[i, t] for i, t in toks]
  seq = {i: np.mean([np.exp(abs(delta[i, t])) for t in range(n) if mask[i, t]])
         for i in range(b) if mask[i].any()}
  mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0
  ext = lambda f, xs: float(f(xs)) if len(xs) else 0.0
  out = {
      "mismatch/token_mult_prob_error": mean(np.exp(err)),
      "mismatch/seq_mult_prob_error/mean": mean(list(seq.values())),
      "mismatch/seq_mult_prob_error/max": ext(max, list(seq.values())),
      "mismatch/seq_mult_prob_error/min": ext(min, list(seq.values())),
      "mismatch/gen_kl": mean(gen_kl),
      "mismatch/abs_diff/mean": mean(err),
      "mismatch/abs_diff/max": ext(max, err),
      "mismatch/is_ratio/mean": mean(rho),
      "mismatch/is_ratio/max": ext(max, rho),
      "mismatch/is_ratio/min": ext(min, rho),
  }
  keep_rows = np.ones(b, bool)
  if seq_threshold is not None:
    for i, e in seq.items():
      keep_rows[i] = e <= seq_threshold
    out["mismatch/num_masked_seqs"] = float((~keep_rows).sum())
  return out, keep_rows


# --- the composed objective -----------------------------------------------------------------

KL_RED = {"token_mean": "token_mean", "seq_mean": "seq_mean_token_mean", "policy": None}


def kl_red(cfg, name):
  return KL_RED[name] or cfg.reduction


def reductions_of(cfg):
  return sorted({cfg.reduction, kl_red(cfg, cfg.rollout_kl_reduction),
                 kl_red(cfg, cfg.ref_kl_reduction)})


def counts(cfg, mask):
  return {name: count(name, mask) for name in reductions_of(cfg)}


def distill_advantages(lp_teacher, lp_behaviour, mask, coef=1.0, seq_adv=None,
                       reward_weight=0.0):
  """A[b, t] = coef (lp_teacher - lp_behaviour) + reward_weight seq_adv[b] on masked-in tokens,
  0 elsewhere (on-policy distillation's per-token reverse-KL advantage)."""
  mask = np.asarray(mask, bool)
  out = np.zeros(mask.shape)
  for b, t in zip(*np.nonzero(mask)):
    out[b, t] = coef * (f64(lp_teacher)[b, t] - f64(lp_behaviour)[b, t])
    if seq_adv is not None:
      out[b, t] += reward_weight * f64(seq_adv)[b]
  return out


def reverse_kl(lp, lp_teacher, mask):
  """Row mean over rows with a token of sum_t (lp - lp_teacher)."""
  mask = np.asarray(mask, bool)
  rows = [(_clean(lp, mask)[b] - _clean(lp_teacher, mask)[b]).sum()
          for b in range(mask.shape[0]) if mask[b].any()]
  return float(np.mean(rows)) if rows else 0.0


def objective(cfg, lp, lp_old, adv, mask, cnt, lp_gen=None, lp_ref=None, entropy=None,
              lp_sg=None, lp_teacher=None):
  """(loss, finalised metrics) of one micro-batch; `cnt` are the global counts."""
  mask = np.asarray(mask, bool)
  lp_sg = lp if lp_sg is None else lp_sg
  distill = {}
  if getattr(cfg, "distill_coef", 0.0) != 0:
    behaviour = lp_gen if lp_gen is not None else lp_old
    adv = distill_advantages(lp_teacher, behaviour, mask, cfg.distill_coef, adv,
                             cfg.distill_reward_weight)
    distill["distill/reverse_kl"] = reverse_kl(lp_sg, lp_teacher, mask)
  div = lambda s, red: s / max(cnt[red], 1.0)
  pol, ratio, clipped = policy(cfg.policy, lp, lp_old, adv, mask, cfg.eps_low, cfg.eps_high,
                               cfg.dual_clip, lp_sg=lp_sg,
                               tau_pos=getattr(cfg, "sapo_tau_pos", 1.0),
                               tau_neg=getattr(cfg, "sapo_tau_neg", 1.05))
  keep, w, metrics = mask.copy(), np.ones(mask.shape), {}
  if lp_gen is not None:
    mm, keep_rows = mismatch(lp_old, lp_gen, mask, cfg.seq_logprob_error_threshold)
    metrics.update(mm)
    keep &= keep_rows[:, None]
    if cfg.correction:
      cw, ck, cm = combine(cfg.correction, lp_sg, lp_old, lp_gen, adv, mask,
                           cfg.correction_params)
      w, keep = cw, keep & ck
      metrics.update({k: s / c if c else 0.0 for k, (s, c) in cm.items()})
  pg_sum, _ = reduce(cfg.reduction, np.where(keep, w * pol, 0.0), mask, cfg.norm_len)
  loss = div(pg_sum, cfg.reduction)
  local = count(cfg.reduction, mask)
  sel = mask.ravel()
  metrics["loss/policy"] = pg_sum / local if local else 0.0
  metrics["ratio/mean"] = ratio.ravel()[sel].mean() if sel.any() else 0.0
  metrics["ratio/max"] = ratio.ravel()[sel].max() if sel.any() else 0.0
  metrics["ratio/min"] = ratio.ravel()[sel].min() if sel.any() else 0.0
  metrics["clip_frac"] = clipped.ravel()[sel].mean() if sel.any() else 0.0
  metrics["keep_frac"] = keep.ravel()[sel].mean() if sel.any() else 0.0
  behaviour = lp_gen if getattr(cfg, "ratio_base", "trainer") == "rollout" else lp_old
  for key, base, coef, est, red, weighted in (
      ("rollout_kl", lp_gen, cfg.rollout_kl_coef, cfg.rollout_kl_estimator,
       cfg.rollout_kl_reduction, False),
      ("ref_kl", lp_ref, cfg.ref_kl_coef, cfg.ref_kl_estimator, cfg.ref_kl_reduction,
       getattr(cfg, "ref_kl_importance_weighted", False))):
    if base is None:
      continue
    red = kl_red(cfg, red)
    if weighted:
      level = "sequence" if cfg.policy == "gspo" else "token"
      x = importance_weighted_kl(lp, base, behaviour, est, mask, level)
    else:
      x = kl(lp, base, est, mask)[0]
    s, c = reduce(red, x, mask, cfg.norm_len)
    metrics[key] = s / c if c else 0.0
    loss += coef * div(s, red)
  if entropy is not None:
    s, _ = reduce(cfg.reduction, entropy, mask, cfg.norm_len)
    ent = _clean(entropy, mask)
    metrics["entropy"] = ent.ravel()[sel].mean() if sel.any() else 0.0
    loss -= cfg.entropy_coef * div(s, cfg.reduction)
  metrics["loss"] = loss
  metrics.update(distill)
  return loss, metrics


def fd_grad(f, x, h=1e-6):
  """Central finite differences of the scalar `f` at `x` (float64)."""
  x = f64(x).copy()
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    old = x[idx]
    x[idx] = old + h
    up = f(x)
    x[idx] = old - h
    down = f(x)
    x[idx] = old
    g[idx] = (up - down) / (2 * h)
  return g
