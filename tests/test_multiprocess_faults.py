"""Faults across processes (2 processes x 4 simulated devices, gloo on 127.0.0.1).

SIGKILL of either process at a random step after the first checkpoint: the survivor exits
non-zero within `distributed.peer_timeout_s` (plus slack for this loaded 2-core machine) with a
message naming the lost process, and rerunning the same command on both processes writes the same
per-step metrics as an uninterrupted run of one process x 8 devices (so two processes equal one
to 1e-5 at lag 0 here; at lag 1, `test_parity`), at lag 0 and lag 2. SIGTERM to one process only (a preempted
host): both checkpoint the same step and exit 0, and the rerun continues from there with no step
lost or repeated.
"""

from __future__ import annotations

import math
import random
import signal
import subprocess
import sys
import time

import pytest

from processes import communicate, free_port
from test_cli import _tiny
from test_parity import _env
from test_resume import _checkpoints, _last_rl_step, _rows

STEPS = 12
PEER_TIMEOUT = 10
SKIP = ("perf/", "pipeline/", "data_plane/")
SKIP_KEYS = {"val/time_s", "val/trainer_wait_s", "sft/time_s", "rl/time_s", "total_time_s",
             "resumed_from_step"}


def _args(run_dir, lag, *extra):
  return _tiny(10, STEPS, 4, f"--config.run_dir={run_dir}", f"--config.rollout.lag={lag}",
               "--config.checkpoint.every=3", "--config.task.num_digits=1",
               "--config.rollout.num_prompts=8", "--config.mesh.data=-1",
               "--config.task.dev_size=16", "--config.task.val_size=16",
               "--config.val.batch_size=16", *extra)


def _start(args, cwd, devices=8) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "jaxrl.train", *args], cwd=cwd,
                          env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _two(args, cwd, port) -> list[subprocess.Popen]:
  return [_start([*args, f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                  "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                  "--config.distributed.init_timeout_s=60",
                  f"--config.distributed.peer_timeout_s={PEER_TIMEOUT}"], cwd, devices=4)
          for i in range(2)]


def _finish(procs, timeout=600) -> list[str]:
  return communicate(procs, timeout)


def _assert_same(base, other) -> int:
  key = lambda r: (r["phase"], r.get("step", -1))
  a, b = sorted(base, key=key), sorted(other, key=key)
  assert [key(r) for r in a] == [key(r) for r in b]
  compared = 0
  for x, y in zip(a, b):
    for k, v in x.items():
      if k.startswith(SKIP) or k in SKIP_KEYS or isinstance(v, bool) or \
          not isinstance(v, (int, float)):
        continue
      assert k in y, (key(x), k)
      assert math.isclose(v, y[k], rel_tol=1e-5, abs_tol=1e-5), (key(x), k, v, y[k])
      compared += 1
  return compared


def _wait_for(cond, procs, seconds=600):
  deadline = time.monotonic() + seconds
  while not cond():
    for i, p in enumerate(procs):
      assert p.poll() is None, f"process {i} ended early:\n{p.communicate()[0][-4000:]}"
    assert time.monotonic() < deadline
    time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("lag,victim", [(0, 1), (2, 0)])
def test_sigkill_of_one_process_ends_the_other_and_the_rerun_resumes(tmp_path, lag, victim):
  rng = random.Random(10 * lag + victim)
  base_dir, cut_dir = tmp_path / "base", tmp_path / "cut"
  _finish([_start(_args(base_dir, lag), tmp_path)])
  base = _rows(base_dir)
  assert any(r["phase"] == "rl" and r["reward/mixed_groups"] > 0 for r in base)

  target = rng.randint(4, STEPS - 1)  # the first checkpoint is step 3
  procs = _two(_args(cut_dir, lag), tmp_path, free_port())
  _wait_for(lambda: _last_rl_step(cut_dir) >= target and _checkpoints(cut_dir), procs)
  procs[victim].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  survivor = procs[1 - victim]
  out = survivor.communicate(timeout=PEER_TIMEOUT + 120)[0]
  took = time.monotonic() - killed
  procs[victim].communicate()
  print(f"survivor (process {1 - victim}) exited {survivor.returncode} {took:.1f} s after the "
        f"kill; its last lines:\n" + "\n".join(out.strip().splitlines()[-3:]))
  assert survivor.returncode != 0, out[-3000:]
  assert took < PEER_TIMEOUT + 20, (took, out[-3000:])
  if victim == 1:
    # The survivor's own watch names the silent process.
    assert "jaxrl: lost process 1 of 2" in out, out[-3000:]
  else:
    # Process 0 ran the coordination service: JAX's runtime ends the survivor at once, naming
    # its loss as that of the service's ("leader") task, or the watch names it first.
    assert "lost process 0 of 2" in out or "coordination service" in out, out[-3000:]

  outs = _finish(_two(_args(cut_dir, lag), tmp_path, free_port()))  # resume=auto on both
  assert "resumed from step" in outs[0]
  n = _assert_same(base, _rows(cut_dir))
  assert n > 200
  rl = [r for r in _rows(cut_dir) if r["phase"] == "rl"]
  assert [r["staleness/first_token/max"] for r in rl] == [min(s - 1, lag) for s in
                                                          range(1, STEPS + 1)]


@pytest.mark.slow
def test_sigterm_to_one_process_checkpoints_both_and_exits_zero(tmp_path):
  run_dir = tmp_path / "run"
  args = _args(run_dir, 1, "--config.checkpoint.every=100")
  procs = _two(args, tmp_path, free_port())
  _wait_for(lambda: _last_rl_step(run_dir) >= 5, procs)
  procs[1].send_signal(signal.SIGTERM)  # only process 1's host is preempted
  outs = _finish(procs)
  assert "stopped by signal" in outs[0]
  (saved,) = _checkpoints(run_dir)  # only the signal's checkpoint (every=100), one for both
  assert 5 <= saved < STEPS
  rows = _rows(run_dir)
  assert max(r["step"] for r in rows if r["phase"] == "rl") == saved
  assert not any(r["phase"] == "summary" for r in rows)

  outs = _finish(_two(args, tmp_path, free_port()))
  assert f"resumed from step {saved}" in outs[0]
  rl = [r for r in _rows(run_dir) if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == list(range(1, STEPS + 1))  # no step lost or repeated
  assert [r["staleness/first_token/max"] for r in rl] == [min(s - 1, 1) for s in
                                                          range(1, STEPS + 1)]
