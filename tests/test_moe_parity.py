"""Expert parallelism end to end: the tiny mixture-of-experts run (`configs/default_moe.py`, 4
experts, 2 per token) on 1 device and on 8 (data 4 x fsdp 2: two experts per fsdp shard, rows
over both) gives the same per-step metrics within 1e-5, the load-balancing loss included."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

STEPS = 3
ARGS = ["--config", "configs/default_moe.py", "--config.task.num_digits=1",
        "--config.rollout.num_prompts=32", "--config.task.dev_size=16",
        "--config.task.val_size=32", "--config.val.batch_size=32", "--config.sft.max_steps=20",
        "--config.sft.eval_every=10", "--config.sft.batch_size=64",
        f"--config.train.steps={STEPS}", "--config.val.every=3"]
MESH8 = ["--config.mesh.data=4", "--config.mesh.fsdp=2"]
# Wall-clock metrics differ run to run.
TIMING = ("perf/", "pipeline/worker_blocked_s", "pipeline/trainer_wait_s", "sft/time_s",
          "rl/time_s", "total_time_s", "pipeline/worker_waiting", "pipeline/trainer_waiting",
          "val/time_s", "val/trainer_wait_s")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(run_dir, devices: int, extra=()) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-m", "jaxrl.train", *ARGS,
                        f"--config.run_dir={run_dir}", *extra], env=env, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                       check=False)
  assert out.returncode == 0, out.stdout
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return sorted(rows, key=lambda r: (r["phase"], r.get("step", -1)))


@pytest.mark.slow
def test_moe_run_on_one_device_vs_eight(tmp_path):
  base, eight = run(tmp_path / "one", 1), run(tmp_path / "eight", 8, MESH8)
  rl = [r for r in base if r["phase"] == "rl" and r["step"] > 0]
  assert len(rl) == STEPS and all("moe/aux_loss" in r for r in rl)
  assert any(r["grad_norm"] > 0 for r in rl)
  assert [(r["phase"], r.get("step")) for r in base] == \
      [(r["phase"], r.get("step")) for r in eight]
  compared = 0
  for a, b in zip(base, eight):
    for k, v in a.items():
      if k.startswith(TIMING) or not isinstance(v, (int, float)) or isinstance(v, bool):
        continue
      assert math.isclose(v, b[k], rel_tol=1e-5, abs_tol=1e-5), \
          f"{a['phase']} step {a.get('step')} {k}: {v} vs {b[k]}"
      compared += 1
  assert compared > 100


@pytest.mark.slow
def test_tiny_moe_run_learns(tmp_path):
  """Acceptance: the tiny mixture-of-experts default variant gains at least 0.3 held-out
  accuracy on CPU (measured +0.525 with seed 0, docs/moe.md), logging the load-balancing loss
  every RL step."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config", "configs/default_moe.py",
                        f"--config.run_dir={tmp_path / 'run'}"], env=env, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800,
                       check=False)
  assert out.returncode == 0, out.stdout
  with open(tmp_path / "run" / "summary.json") as f:
    summary = json.load(f)
  assert summary["val/rl_gain"] >= 0.3, summary
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rl = [r for r in map(json.loads, f) if r["phase"] == "rl" and r["step"] > 0]
  assert len(rl) == summary["rl/steps"] and all(r["moe/aux_loss"] > 0 for r in rl)
