"""Staleness of a consumed batch, from per-token policy-version stamps. Pure, host-side numpy.

Staleness is computed at consumption, `consumer_version - policy_version` per token, so time spent
queued in the ring counts (counting only in-engine updates would under-report it).
"""

from __future__ import annotations

import numpy as np

_KINDS = ("first_token", "last_token", "token_mean")


def staleness_metrics(policy_version, mask, consumer_version) -> dict:
  """Staleness summary of a batch.

  policy_version: [B, N] ints, the params version that produced each token; mask: [B, N] bool,
  the tokens that count (generated tokens); consumer_version: the version being trained.

  Returns floats `staleness/{first_token,last_token,token_mean}/{min,mean,max}`: per row with at
  least one masked token, the staleness of its first / last masked token and its token-mean
  staleness, then min/mean/max over those rows. Rows without masked tokens are ignored; a batch
  with none at all reports 0 everywhere. Accepts numpy or jax arrays (copied to host).
  """
  pv = np.asarray(policy_version)
  m = np.asarray(mask).astype(bool)
  if pv.ndim != 2 or pv.shape != m.shape:
    raise ValueError(f"policy_version {pv.shape} and mask {m.shape} must both be [B, N]")
  stale = consumer_version - pv.astype(np.int64)
  rows = m.any(axis=1)
  out = {}
  if not rows.any():
    return {f"staleness/{k}/{s}": 0.0 for k in _KINDS for s in ("min", "mean", "max")}
  stale, m = stale[rows], m[rows]
  idx = np.arange(stale.shape[0])
  first = stale[idx, np.argmax(m, axis=1)]
  last = stale[idx, m.shape[1] - 1 - np.argmax(m[:, ::-1], axis=1)]
  token_mean = np.where(m, stale, 0).sum(axis=1) / m.sum(axis=1)
  for kind, v in zip(_KINDS, (first, last, token_mean)):
    out[f"staleness/{kind}/min"] = float(v.min())
    out[f"staleness/{kind}/mean"] = float(v.mean())
    out[f"staleness/{kind}/max"] = float(v.max())
  return out
