"""Staleness of a consumed batch, from per-token policy-version stamps. Pure, host-side numpy.

Staleness is computed at consumption, `consumer_version - policy_version` per token, so time spent
queued in the ring counts (counting only in-engine updates would under-report it).
"""

from __future__ import annotations

import numpy as np

_KINDS = ("first_token", "last_token", "token_mean")


def row_versions(policy_version, mask) -> dict[str, np.ndarray]:
  """Per-row version summary `{"first", "last", "mean"}` (float64 [B]; NaN for a row with no
  masked token): the version stamped on each row's first and last masked token and its token
  mean. Staleness is linear in these, so a batch's rows can carry them as host metadata and the
  staleness metrics need no per-token array at consumption."""
  pv = np.asarray(policy_version)
  m = np.asarray(mask).astype(bool)
  if pv.ndim != 2 or pv.shape != m.shape:
    raise ValueError(f"policy_version {pv.shape} and mask {m.shape} must both be [B, N]")
  pv = pv.astype(np.float64)
  rows = m.any(axis=1)
  idx = np.arange(pv.shape[0])
  first = np.where(rows, pv[idx, np.argmax(m, axis=1)], np.nan)
  last = np.where(rows, pv[idx, m.shape[1] - 1 - np.argmax(m[:, ::-1], axis=1)], np.nan)
  mean = np.where(rows, np.where(m, pv, 0).sum(axis=1) / np.maximum(m.sum(axis=1), 1), np.nan)
  return {"first": first, "last": last, "mean": mean}


def staleness_from_rows(versions: dict, consumer_version) -> dict:
  """`staleness/{first_token,last_token,token_mean}/{min,mean,max}` from `row_versions` output;
  rows with NaN (no masked token) are ignored, and a batch with none reports 0 everywhere."""
  out = {}
  for kind, part in zip(_KINDS, ("first", "last", "mean")):
    v = np.asarray(versions[part], np.float64)
    v = consumer_version - v[np.isfinite(v)]
    for stat in ("min", "mean", "max"):
      out[f"staleness/{kind}/{stat}"] = float(getattr(v, stat)()) if v.size else 0.0
  return out
