"""Whole runs compiled by XLA:TPU on this CPU (`python -m jaxrl.plan`, libtpu's topology
descriptions; the `tpu` extra): every program of the default run for `v5e-4`, and of the
Qwen2.5-0.5B GSM8K recipe for the smallest TPU target it is documented to fit (`v5e-4`, four
16-GiB chips; docs/plan.md),
each compiled, fitting, and the run's own memory plan checked against the compiler's figures.

Marked `aot`: CI runs them in their own step with the extra installed (docs/testing.md has the
time). Each plan runs as the command a user runs, in a process of its own without the suite's
8 simulated CPU devices and CPU compiler flags."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu]"')]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {"train_step", "publish", "prefill", "decode", "val_prefill", "val_decode"}


def plan(*args: str) -> tuple[int, dict, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  r = subprocess.run([sys.executable, "-m", "jaxrl.plan", "--json", *args], cwd=ROOT, env=env,
                     text=True, capture_output=True, timeout=1800)
  lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
  assert lines, r.stderr[-3000:]
  return r.returncode, json.loads(lines[-1]), r.stderr


def test_the_default_run_compiles_for_v5e_4():
  rc, p, err = plan("--target", "v5e-4")
  assert rc == 0 and p["fits"], err[-2000:]
  assert set(p["programs"]) == PROGRAMS
  for name, c in p["programs"].items():
    assert c["error"] is None, (name, c["error"])
    assert c["peak"] > 0 and c["memory"]["argument"] > 0, name
  # XLA:TPU's cost figures are there (XLA:GPU gives none): the step's FLOPs and a decode time.
  assert p["programs"]["train_step"]["flops"] > 0
  assert p["estimates"]["decode_compiler_tokens_per_s"] > 0
  assert p["estimates"]["train_step_s"] > 0 and p["target"]["chips"] == 4
  assert p["peak"]["total"] <= p["target"]["usable_bytes"]


def test_the_qwen_0_5b_recipe_compiles_and_fits_its_smallest_target():
  rc, p, err = plan("--config", "configs/qwen2_5_0_5b_gsm8k.py", "--target", "v5e-4")
  assert rc == 0 and p["fits"], err[-2000:]
  assert set(p["programs"]) == PROGRAMS
  assert all(c["error"] is None for c in p["programs"].values())
  # At least 10% headroom at the recipe's own settings and lag (compiled 2026-12-08: 11.87 of
  # 15.20 GiB usable, 22%).
  assert p["peak"]["total"] <= 0.9 * p["target"]["usable_bytes"], p["peak"]
  # FSDP over 4 chips: the step gathers params and reduce-scatters gradients.
  coll = p["programs"]["train_step"]["collectives"]
  assert coll.get("all-gather", {}).get("ops", 0) > 0
  # The run's own memory plan (what it prints and checks at its start) within 15% of XLA:TPU's
  # per-chip peak of the train step and of the sampler.
  mp = p["memory_plan"]
  assert 0.85 <= mp["train_step"]["ratio"] <= 1.15, mp
  assert 0.85 <= mp["sampler"]["ratio"] <= 1.15, mp
