"""Acceptance: the default run visibly learns in its RL phase (slow: ~2 min per seed).

Run by CI in its own step: `pytest -m slow`.
"""

import json
import os
import subprocess
import sys

import pytest

# The bar: held-out greedy accuracy must rise by this much between the start and the end of the
# RL phase (the warm-up before it is stopped on a separate split, so RL starts with headroom).
BARS = {0: 0.25, 1: 0.15, 2: 0.15, 3: 0.15}


@pytest.mark.slow
@pytest.mark.parametrize("seed", sorted(BARS))
def test_default_run_learns(seed, tmp_path):
  run_dir = tmp_path / "run"
  # Exactly the README command: one host device, not the 8 simulated ones conftest sets.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", f"--config.seed={seed}",
                         f"--config.run_dir={run_dir}"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=900, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  print(proc.stdout[-600:])
  summary = json.loads((run_dir / "summary.json").read_text())
  gain = summary["val/accuracy_after_rl"] - summary["val/accuracy_before_rl"]
  assert gain >= BARS[seed], summary


@pytest.mark.slow
def test_default_run_with_rollout_kl_logs_it_every_step(tmp_path):
  # The default recipe with the rollout-KL term on: `rollout_kl` and the mismatch metrics are in
  # every RL step's metrics line, finite, and the term is small because sampler and trainer
  # compute the same log-probs (it would be O(1) if they disagreed).
  run_dir = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config.rollout_kl.coef=0.1",
                         "--config.train.steps=60", f"--config.run_dir={run_dir}"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if r["phase"] == "rl" and r["step"] > 0]
  assert [r["step"] for r in steps] == list(range(1, 61))
  keys = ("rollout_kl", "mismatch/token_mult_prob_error", "mismatch/seq_mult_prob_error/mean",
          "mismatch/seq_mult_prob_error/min", "mismatch/seq_mult_prob_error/max",
          "mismatch/gen_kl", "mismatch/abs_diff/mean", "mismatch/abs_diff/max",
          "mismatch/is_ratio/mean")
  for r in steps:
    for k in keys:
      assert k in r and r[k] == r[k], (r["step"], k)  # present and not NaN
    assert 0 <= r["rollout_kl"] < 1e-6 and r["mismatch/token_mult_prob_error"] < 1 + 1e-4
  config = json.loads((run_dir / "config.json").read_text())
  assert config["rollout_kl"]["coef"] == 0.1


@pytest.mark.slow
def test_default_run_with_lag_two_learns_with_exact_staleness(tmp_path):
  # `--config.rollout.lag=2` on the default recipe: every RL step reports first-token staleness
  # exactly min(batch_id, 2) (step s trains on batch s - 1), the pipeline metrics are present,
  # and held-out accuracy clears the default seed's bar.
  run_dir = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config.rollout.lag=2",
                         f"--config.run_dir={run_dir}"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=900, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  print(proc.stdout[-600:])
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if r["phase"] == "rl" and r["step"] > 0]
  assert len(steps) == 500
  for r in steps:
    assert r["staleness/first_token/max"] == min(r["batch_id"], 2), r["step"]
    for k in ("slots_held", "capacity", "utilization", "submitted", "completed", "consumed",
              "regenerated", "filtered", "worker_blocked_s", "trainer_wait_s"):
      assert f"pipeline/{k}" in r, k
  summary = json.loads((run_dir / "summary.json").read_text())
  gain = summary["val/accuracy_after_rl"] - summary["val/accuracy_before_rl"]
  assert gain >= BARS[0], summary
