"""Acceptance: the default run's RL phase takes held-out accuracy to >= 0.80 (slow: ~3 min a run).

Every run is README command 1 (`python -m jaxrl.train`, one host device) in a subprocess, for a
seed on one of two XLA CPU code paths: the machine's native one, and `--xla_cpu_max_isa=AVX2`,
which stands in for another machine (XLA's CPU code, and with it every learning curve, differs by
instruction set). CI runs this file in its own step (`pytest -m slow`): seed 0 natively and
under AVX2 (skipped where the CPU has nothing past AVX2: the same code), a lag-2 run and a
rollout-KL run. Seed 1 left CI on 2026-12-07 (170 s of a 2-core worker, on a CI run that took
77 of its 90 minutes): more seeds are the sweep's job. The acceptance sweep (seeds 0-3
natively, 0-1 under AVX2, lag 2 on both) is `benchmarks/learning.py` (by default seeds 0-7 on
both paths), whose numbers are in benchmarks/README.md: each run is ~150 s of a 2-core machine, and CI's 75 minutes do not
hold nine of them beside the rest of the slow step.
"""

import json
import os
import subprocess
import sys

import pytest

# The bars (held-out greedy exact match on the 1,000-problem val split, which neither phase
# trains or stops on). The warm-up stops on a separate dev split at accuracy 0.3, so RL starts
# at 0.29-0.42; ending at >= 0.80 from there is a gain of >= 0.38-0.51, and the gain bar of 0.40
# catches a run that started high and barely moved.
AFTER_RL = 0.80
GAIN = 0.40
BEFORE_RL_MAX = 0.45  # the warm-up must leave RL the work: it stops early on purpose
ISAS = {"native": None, "avx2": "--xla_cpu_max_isa=AVX2"}


def _cpu_has_more_than_avx2() -> bool:
  """Whether this CPU has an x86 vector extension past AVX2 (AVX-512, AVX10, AMX), so that
  `--xla_cpu_max_isa=AVX2` compiles other code than the native path. On a CPU without one (or
  where /proc/cpuinfo is unreadable: True, the case runs) the two paths are the same code: on a
  2-core AVX2-only AMD EPYC the default run's 896 metrics rows were equal in every value but
  timings, natively and with the flag (2026-12-04)."""
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
  except OSError:
    return True
  return not flags or any(f.startswith(("avx512", "avx10", "amx")) for f in flags)


def _skip_same_code(isa):
  if isa == "avx2" and not _cpu_has_more_than_avx2():
    pytest.skip("this CPU has nothing past AVX2: the native case ran the same code")


def _run(tmp_path, isa, *args):
  """README command 1 with `args`, on the code path `isa`; returns (summary, RL metric rows)."""
  run_dir = tmp_path / "run"
  # One host device (not the 8 simulated ones conftest sets), and only the ISA flag under test.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if ISAS[isa]:
    env["XLA_FLAGS"] = ISAS[isa]
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", f"--config.run_dir={run_dir}",
                         *args], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                        env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  print(proc.stdout[-600:])
  summary = json.loads((run_dir / "summary.json").read_text())
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return summary, [r for r in rows if r["phase"] == "rl" and r["step"] > 0]


def _assert_learned(summary):
  before, after = summary["val/accuracy_before_rl"], summary["val/accuracy_after_rl"]
  assert before <= BEFORE_RL_MAX, summary  # RL, not the warm-up, must do the work
  assert after >= AFTER_RL, summary
  assert after - before >= GAIN, summary


@pytest.mark.slow
@pytest.mark.parametrize("seed,isa", [(0, "native"), (0, "avx2")])
def test_default_run_learns(seed, isa, tmp_path):
  _skip_same_code(isa)
  summary, rows = _run(tmp_path, isa, f"--config.seed={seed}")
  _assert_learned(summary)
  assert len(rows) == summary["rl/steps"]


@pytest.mark.slow
def test_default_run_with_rollout_kl_logs_it_every_step(tmp_path):
  # The default recipe with the rollout-KL term on: `rollout_kl` and the mismatch metrics are in
  # every RL step's metrics line, finite, and the term is small because sampler and trainer
  # compute the same log-probs (it would be O(1) if they disagreed).
  _, steps = _run(tmp_path, "native", "--config.rollout_kl.coef=0.1", "--config.train.steps=60")
  assert [r["step"] for r in steps] == list(range(1, 61))
  keys = ("rollout_kl", "mismatch/token_mult_prob_error", "mismatch/seq_mult_prob_error/mean",
          "mismatch/seq_mult_prob_error/min", "mismatch/seq_mult_prob_error/max",
          "mismatch/gen_kl", "mismatch/abs_diff/mean", "mismatch/abs_diff/max",
          "mismatch/is_ratio/mean")
  for r in steps:
    for k in keys:
      assert k in r and r[k] == r[k], (r["step"], k)  # present and not NaN
    assert 0 <= r["rollout_kl"] < 1e-6 and r["mismatch/token_mult_prob_error"] < 1 + 1e-4
  config = json.loads((tmp_path / "run" / "config.json").read_text())
  assert config["rollout_kl"]["coef"] == 0.1


@pytest.mark.slow
def test_default_run_with_lag_two_learns_with_exact_staleness(tmp_path):
  # `--config.rollout.lag=2` on the default recipe: every RL step reports first-token staleness
  # exactly min(batch_id, 2) (step s trains on batch s - 1), the pipeline metrics are present,
  # and held-out accuracy clears the same bars as the synchronous run.
  summary, steps = _run(tmp_path, "native", "--config.rollout.lag=2")
  assert len(steps) == summary["rl/steps"] and summary["rl/steps"] > 0
  for r in steps:
    assert r["staleness/first_token/max"] == min(r["batch_id"], 2), r["step"]
    for k in ("slots_held", "capacity", "utilization", "submitted", "completed", "consumed",
              "regenerated", "filtered", "worker_blocked_s", "trainer_wait_s"):
      assert f"pipeline/{k}" in r, k
  _assert_learned(summary)


@pytest.mark.slow
def test_learning_benchmark_reports_every_run_and_the_weakest_margins(tmp_path):
  # benchmarks/learning.py --quick: seed 0 and a lag-2 run, 5 RL steps each (native code only:
  # the AVX2 path is the learning tests' own, above, and CI time is better spent there). The
  # report must hold every run with its numbers, and the weakest margins must be the extremes of
  # those runs (a wrong min/max would name another run or value).
  bench = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "learning.py")
  proc = subprocess.run([sys.executable, bench, "--quick", "--isas", "native", "--out-dir",
                         str(tmp_path)], capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  runs = report["runs"]
  assert sorted(r["run"] for r in runs) == ["seed0-native", "seed0-native-lag2"]
  assert all(r["returncode"] == 0 and r["rl_steps"] == 5 for r in runs), runs
  assert all(r["staleness_exact"] for r in runs if r["lag"]), runs
  w = report["weakest"]
  assert w["after_rl"]["value"] == min(r["after_rl"] for r in runs)
  assert w["gain"]["value"] == min(r["gain"] for r in runs)
  assert w["before_rl"]["value"] == max(r["before_rl"] for r in runs)
  assert abs(w["after_rl"]["margin"] - (w["after_rl"]["value"] - AFTER_RL)) < 1e-4
  # 5 RL steps cannot reach the bars: the report must say so, not pass by default.
  assert report["learning_bars_met"] is False
