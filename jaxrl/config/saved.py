"""A run's config as its run directory keeps it (config.json), written and read back.

A saved config is read by whatever jaxrl evaluates the run or distills from it, which may have
keys its writer did not: `merge_saved` fills those from the reader's defaults.
"""

from __future__ import annotations

from typing import Any

from ml_collections import ConfigDict


def merge_saved(ref: dict, saved: dict) -> dict:
  """`ref` (e.g. the default config as a dict) with the values `saved` (a run's config.json) has
  for its keys: a saved run's config, read by a jaxrl whose defaults have more keys."""
  out = {}
  for k, v in ref.items():
    if k not in saved:
      out[k] = v
    elif isinstance(v, dict) and isinstance(saved[k], dict):
      out[k] = merge_saved(v, saved[k])
    else:
      out[k] = saved[k]
  return out


def to_dict(cfg: ConfigDict) -> dict[str, Any]:
  """Plain nested dict (references resolved), e.g. for writing the resolved config as JSON."""
  return cfg.to_dict()
