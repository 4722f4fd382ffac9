"""A run directory written by an earlier jaxrl resumes with this one and continues it exactly.

`fixtures/run_flat_layout` was written by jaxrl as it stood before its modules moved into folders
by role (the flat layout, commit 733de5a): the default recipe's model and warm-up, then 4 RL steps
of 4 prompts x 8 samples at lag 1, checkpoints every 2 steps (the one of step 4 removed, so the
newest is step 2, whose lag ring holds batch 2, made with params version 1). Its metrics.jsonl
holds all 4 steps. Resumed here from step 2, steps 3 and 4 must be the rows that run wrote: the
same batches and versions, the same sampled lengths and rewards, the same losses.

A code change that moves a class a checkpoint names, renames a field of the host JSON, or changes
the ring's layout fails this test; so does one that changes the numbers (then the fixture is
written again by the new code, on purpose, and the change is said in its commit).
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import pytest
from ml_collections import ConfigDict

from jaxrl import config as config_lib
from jaxrl.recipes import default
from jaxrl.run import driver

FIXTURE = "fixtures/run_flat_layout"


def _timing(key: str) -> bool:
  """Not a function of the run's state, so not compared: what was measured (seconds, rates) and
  where the rollout worker had got to when the row was written (the ring's and row store's
  gauges: at the last step it may or may not have made the batch past the end yet)."""
  return key.startswith(("perf/", "pipeline/", "data_plane/")) or key.endswith("_s")


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _same(a, b, key: str = "") -> bool:
  """Equal up to f32 printing; `mismatch/*` (the float noise between the sampler's and the train
  step's log-prob passes) within 1e-4: XLA's CPU code for those two programs differs by
  instruction set: on a 2-core AVX2-only machine (2026-12-04) `mismatch/abs_diff/max` of step 4
  read 0.3814487 where the fixture has 0.3814435 (rel 1.4e-5), every other value equal, at the
  fixture's commit's code as at today's."""
  if isinstance(a, float) and isinstance(b, float):
    rel = 1e-4 if key.startswith("mismatch/") else 1e-5
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)
  return a == b


@pytest.mark.slow  # a whole resumed run (fast-suite time budget)
def test_a_run_dir_of_the_flat_layout_resumes_and_continues_exactly(tmp_path):
  here = __file__.rsplit("/", 1)[0]
  run_dir = tmp_path / "run"
  shutil.copytree(f"{here}/{FIXTURE}", run_dir)
  before = [r for r in _rows(run_dir / "metrics.jsonl") if r["phase"] == "rl"]
  assert [r["step"] for r in before] == [1, 2, 3, 4]
  with open(run_dir / "config.json") as f:
    cfg = ConfigDict(config_lib.merge_saved(default.get_config().to_dict(), json.load(f)))
  cfg.run_dir = str(run_dir)
  summary = driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()))
  assert summary["resumed_from_step"] == 2
  after = [r for r in _rows(run_dir / "metrics.jsonl") if r["phase"] == "rl"]
  assert [r["step"] for r in after] == [1, 2, 3, 4]  # steps 1-2 kept, 3-4 written again
  for old, new in zip(before[2:], after[2:]):
    keys = {k for k in old if not _timing(k)}
    assert keys == {k for k in new if not _timing(k)}
    differ = {k: (old[k], new[k]) for k in sorted(keys) if not _same(old[k], new[k], k)}
    assert not differ, f"step {old['step']}: {differ}"
  # The resumed step trained on the batch the checkpoint's ring held: batch 2, version 1.
  assert (after[2]["batch_id"], after[2]["submit_version"]) == (2, 1)
