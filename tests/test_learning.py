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
