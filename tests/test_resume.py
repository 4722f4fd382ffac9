"""Checkpoints resume exactly: a run killed (SIGKILL) at a random step after its first
checkpoint and resumed writes the same per-step metrics as an uninterrupted run of the same seed,
at lag 0 and at lag 2 with LoRA; SIGTERM checkpoints and exits 0, and the run resumes from
there; a checkpoint saved on 1 device continues on 8.

Compared: every numeric metric of every step (RL and validation rows, by phase and step), except
wall-clock timings and counters that depend on thread timing (how far the rollout worker had
got when a row was written).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from test_cli import _tiny

STEPS = 12
TIMING_PREFIXES = ("perf/", "pipeline/", "data_plane/")
TIMING_KEYS = {"val/time_s", "val/trainer_wait_s", "sft/time_s", "rl/time_s", "total_time_s"}
# The resumed run's summary says where it resumed (the uninterrupted run's has no such key).
RESUME_KEYS = {"resumed_from_step"}


def _args(run_dir, lag, *extra):
  return _tiny(10, STEPS, 4, f"--config.run_dir={run_dir}", f"--config.rollout.lag={lag}",
               "--config.checkpoint.every=3", "--config.task.num_digits=1",
               "--config.task.dev_size=16", "--config.task.val_size=16",
               "--config.val.batch_size=16", *extra)


def _popen(args, cwd, devices=None):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  if devices is not None:
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  return subprocess.Popen([sys.executable, "-m", "jaxrl.train", *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=600):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out
  return out


def _rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _last_rl_step(run_dir) -> int:
  try:
    rows = _rows(run_dir)
  except (FileNotFoundError, json.JSONDecodeError):
    return 0
  return max([r["step"] for r in rows if r["phase"] == "rl"], default=0)


def _wait_for_rl_step(proc, run_dir, step: int, timeout_s: float = 600.0) -> None:
  """Until the running `proc` has written RL step `step` (failing if it exits or times out)."""
  deadline = time.monotonic() + timeout_s
  while _last_rl_step(run_dir) < step:
    assert proc.poll() is None, proc.communicate()[0]
    assert time.monotonic() < deadline
    time.sleep(0.02)


def _checkpoints(run_dir) -> list[int]:
  d = os.path.join(run_dir, "checkpoints")
  return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if os.path.isdir(d) else []


def _comparable(rows):
  out = {}
  for r in rows:
    key = (r["phase"], r.get("step"))
    assert key not in out, f"duplicate row {key}"
    out[key] = {k: v for k, v in r.items()
                if not k.startswith(TIMING_PREFIXES) and k not in TIMING_KEYS | RESUME_KEYS}
  return out


def _assert_same(base, other):
  a, b = _comparable(base), _comparable(other)
  assert sorted(a, key=str) == sorted(b, key=str)
  for key in a:
    assert a[key] == b[key], (key, {k: (a[key][k], b[key].get(k)) for k in a[key]
                                    if a[key][k] != b[key].get(k)})


def _kill_after_checkpoint(args, run_dir, cwd, rng) -> int:
  """Starts a run, SIGKILLs it at a random step after its first checkpoint; returns that step."""
  target = rng.randint(4, STEPS - 1)  # the first checkpoint is step 3
  proc = _popen(args, cwd)
  deadline = time.monotonic() + 600
  while _last_rl_step(run_dir) < target or not _checkpoints(run_dir):
    assert proc.poll() is None, proc.communicate()[0]
    assert time.monotonic() < deadline
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  return target


# Lag 2 runs with LoRA and its dropout: the ring of saved batches as at any lag 2, and the
# adapters, their optimizer state and the frozen base checkpointed, with dropout masks a function
# of the update count, so the resumed run drops the same (lag 0 runs without LoRA).
LORA = ("--config.model.lora.rank=4", "--config.model.lora.dropout=0.1",
        "--config.model.lora.learning_rate=3e-3")


@pytest.mark.slow
@pytest.mark.parametrize("lag,extra", [(0, ()), (2, LORA)], ids=["lag0", "lag2-lora"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, lag, extra):
  rng = random.Random(lag + len(extra))
  base_dir, cut_dir = tmp_path / "base", tmp_path / "cut"
  base_out = _finish(_popen(_args(base_dir, lag, *extra), tmp_path))
  if extra:
    assert "LoRA rank 4" in base_out and "trained params" in base_out
  killed_at = _kill_after_checkpoint(_args(cut_dir, lag, *extra), cut_dir, tmp_path, rng)
  assert 3 <= max(_checkpoints(cut_dir)) and killed_at >= 4
  out = _finish(_popen(_args(cut_dir, lag, *extra), tmp_path))  # resume=auto
  assert "resumed from step" in out
  _assert_same(_rows(base_dir), _rows(cut_dir))


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_resumes(tmp_path):
  run_dir = tmp_path / "run"
  args = _args(run_dir, 1, "--config.checkpoint.every=100")
  proc = _popen(args, tmp_path)
  _wait_for_rl_step(proc, run_dir, 5)
  proc.send_signal(signal.SIGTERM)
  out = _finish(proc)
  assert "stopped by signal" in out
  (saved,) = _checkpoints(run_dir)  # only the signal's checkpoint (every=100)
  assert 5 <= saved < STEPS
  rows = _rows(run_dir)
  assert max(r["step"] for r in rows if r["phase"] == "rl") == saved
  assert not any(r["phase"] == "summary" for r in rows)
  out = _finish(_popen(args, tmp_path))
  assert f"resumed from step {saved}" in out
  rl = [r["step"] for r in _rows(run_dir) if r["phase"] == "rl"]
  assert rl == list(range(1, STEPS + 1))  # no step lost or repeated
  for r in _rows(run_dir):
    if r["phase"] == "rl":
      assert r["staleness/first_token/max"] == min(r["batch_id"], 1)


@pytest.mark.slow
def test_checkpoint_from_one_device_continues_on_eight(tmp_path):
  run_dir = tmp_path / "run"
  first = _args(run_dir, 0)
  first[first.index(f"--config.train.steps={STEPS}")] = "--config.train.steps=3"
  _finish(_popen(first, tmp_path, devices=1))
  assert _checkpoints(run_dir) == [3]
  out = _finish(_popen(_args(run_dir, 0, "--config.mesh.data=4", "--config.mesh.fsdp=2"),
                       tmp_path, devices=8))
  assert "resumed from step 3" in out and "mesh 4x2x1" in out
  rl = [r for r in _rows(run_dir) if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
  assert all(r["skipped_nonfinite"] == 0 for r in rl)
