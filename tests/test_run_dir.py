"""The run directory: one owner at a time, metrics.jsonl always what the directory can resume
from, a bad newest checkpoint skipped for the one before it, the keys a checkpoint depends on
compared on resume, a run whose updates are all skipped stopped, a failed background save reported
at once, a second Ctrl-C acting at once.

Runs go through `trainer.run` in-process on the tiny config of test_bad_input (no warm-up unless a
test turns it on), so each costs seconds, not a subprocess start."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import orbax.checkpoint as ocp
import pytest

from jaxrl.runtime import checkpoint

from jaxrl import config as config_lib

from jaxrl.observe import metrics as metrics_lib

from jaxrl.run import driver

from jaxrl.run import loop

from jaxrl.run.topology import Topology
from jaxrl.run.parts import build_parts
from jaxrl.run.directory import LOCK_FILE, RunDirError, RunDirLock
from jaxrl.run.signals import Stop

from test_bad_input import _poison, _tiny_cfg


def _cfg(**over):
  top = {k: over.pop(k) for k in list(over) if "__" not in k}
  cfg = _tiny_cfg(**{"checkpoint__every": 2, "checkpoint__async_save": False, **over})
  for k, v in top.items():
    cfg[k] = v
  return cfg


def _run(run_dir, stop=None, **over):
  cfg = _cfg(**over)
  return driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()), stop=stop)


def _rows(run_dir, phase=None):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if phase is None or r["phase"] == phase]


def _keyed(rows):
  return [(r["phase"], r.get("step")) for r in rows]


@pytest.mark.slow  # whole runs (fast-suite time budget)
def test_a_rerun_without_a_checkpoint_starts_clean(tmp_path):
  # Killed (here: stopped by a signal) in the warm-up, before any checkpoint: the rerun must not
  # append to the old metrics.jsonl; the old files are moved aside, named, not deleted.
  run_dir = tmp_path / "run"
  out = _run(run_dir, stop=lambda: True, sft__enabled=True, sft__max_steps=5)
  assert out == {"sft/steps": 1, "sft/stopped": True}
  assert _keyed(_rows(run_dir)) == [("sft", 1)]
  _run(run_dir, train__steps=2)
  assert _keyed(_rows(run_dir)) == [("rl", 1), ("rl", 2), ("summary", None)]  # each step once
  assert _keyed(_rows(run_dir / "previous-1")) == [("sft", 1)]
  assert not (run_dir / LOCK_FILE).exists()  # released


@pytest.mark.slow  # whole runs (fast-suite time budget)
def test_resume_none_refuses_a_used_directory_unless_overwrite(tmp_path):
  run_dir = tmp_path / "run"
  _run(run_dir, train__steps=2)
  before = (run_dir / "metrics.jsonl").read_text()
  with pytest.raises(RunDirError, match=r"run directory .*run already holds a run \(metrics.jsonl,"
                     r" summary.json, config.json, curves.png, checkpoints\); pick another "
                     r"--config.run_dir, or --config.overwrite=true"):
    _run(run_dir, train__steps=3, resume="none")
  assert (run_dir / "metrics.jsonl").read_text() == before  # nothing touched
  # Overwrite: the old run moves aside whole; the new one trains and saves step 2 again.
  assert _run(run_dir, train__steps=3, resume="none", overwrite=True)["rl/steps"] == 3
  assert _keyed(_rows(run_dir)) == [("rl", 1), ("rl", 2), ("rl", 3), ("summary", None)]
  assert (run_dir / "previous-1" / "metrics.jsonl").read_text() == before
  assert checkpoint.complete_steps(str(run_dir / "checkpoints")) == [2, 3]


def _timing(k):
  return k.startswith(("perf/", "pipeline/", "data_plane/")) or k in (
      "val/time_s", "val/trainer_wait_s", "rl/time_s", "total_time_s", "resumed_from_step")


def _same_metrics(a, b):
  assert _keyed(a) == _keyed(b)
  for ra, rb in zip(a, b):
    assert {k: v for k, v in ra.items() if not _timing(k)} == \
        {k: v for k, v in rb.items() if not _timing(k)}, (ra["phase"], ra.get("step"))


@pytest.mark.slow  # three short runs (fast-suite time budget)
def test_bad_newest_checkpoints_fall_back_to_the_one_before(tmp_path, capsys):
  # Lag 2, checkpoints at steps 2, 4, 6; the run ends at 6. Step 6 gets a truncated host JSON
  # (found when the checkpoint is chosen) and step 4 truncated array data (found by its restore).
  # Extended to 8 steps, the run names both in one line each, resumes from step 2, and its
  # metrics from step 3 on equal those of a run that went to 8 steps without stopping.
  over = dict(rollout__lag=2, checkpoint__keep=3, val__every=3, val__at_end=True)
  whole = tmp_path / "whole"
  _run(whole, train__steps=8, **over)
  run_dir = tmp_path / "run"
  _run(run_dir, train__steps=6, **over)
  host = run_dir / "checkpoints" / "6" / "host" / "metadata"
  host.write_bytes(host.read_bytes()[:20])
  for f in (run_dir / "checkpoints" / "4" / "state" / "d").iterdir():
    f.write_bytes(f.read_bytes()[:max(1, len(f.read_bytes()) // 2)])
  capsys.readouterr()
  summary = _run(run_dir, train__steps=8, **over)
  said = capsys.readouterr().out
  # This process did not warm up: the summary says where it resumed, not the old warm-up time.
  assert summary["resumed_from_step"] == 2 and "sft/time_s" not in summary
  for step, why in ((6, "is unusable (host/metadata is unreadable (JSONDecodeError"),
                    (4, "is unreadable: ")):
    lines = [ln for ln in said.splitlines() if f"checkpoints/{step} " in ln]
    assert len(lines) == 1 and why in lines[0] and "trying the one before it" in lines[0], said
  _same_metrics([r for r in _rows(run_dir) if r["phase"] != "summary"],
                [r for r in _rows(whole) if r["phase"] != "summary"])


@pytest.mark.slow  # whole runs (fast-suite time budget)
def test_changing_a_checkpoint_key_is_refused_before_config_json_changes(tmp_path):
  run_dir = tmp_path / "run"
  _run(run_dir, train__steps=2, rollout__lag=2)
  config_json = (run_dir / "config.json").read_text()
  with pytest.raises(RunDirError, match=r"cannot resume from .*checkpoints/2: config.rollout.lag "
                     r"= 2 in the checkpoint, 1 now; config.rollout.num_prompts = 4 in the "
                     r"checkpoint, 8 now\. Resume with the checkpoint's values"):
    _run(run_dir, train__steps=4, rollout__lag=1, rollout__num_prompts=8)
  assert (run_dir / "config.json").read_text() == config_json
  # Keys the checkpoint does not depend on may change: more steps, another learning rate.
  assert _run(run_dir, train__steps=3, rollout__lag=2, train__learning_rate=1e-4)[
      "resumed_from_step"] == 2
  # Resuming another directory's checkpoint with a changed key: refused, nothing created.
  fresh = tmp_path / "fresh"
  with pytest.raises(RunDirError, match="config.rollout.lag = 2 in the checkpoint, 1 now"):
    _run(fresh, train__steps=4, rollout__lag=1, resume=str(run_dir))
  assert not fresh.exists()


# A process that takes a run directory's lock, forks a child unless told not to (the child releases
# nothing and keeps nothing), prints both pids, then waits to be killed.
HOLDER = """
import os, sys, time
from jaxrl.run.directory import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
child = os.fork() if sys.argv[2:] != ["nofork"] else -1
if child == 0:
  lock.release()  # the child's copy: the parent's lock stays
  time.sleep(600)
  os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(600)
"""


def _holder(run_dir, *prefix, fork=True):
  """A process holding `run_dir`'s lock (`HOLDER`, behind `prefix`): (Popen, its first line)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(run_dir),
                           *([] if fork else ["nofork"])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  line = proc.stdout.readline()
  if not line:  # refused, or broken: its error
    pytest.fail(f"the lock holder did not start: {proc.communicate(timeout=60)[1][-2000:]}")
  return proc, line.split()


def test_a_killed_runs_lock_naming_this_very_pid_does_not_block_the_restart(tmp_path):
  # A run in a container is pid 1 every time: the lock its SIGKILLed predecessor left names the
  # restart's own host and pid. Nothing holds the OS lock, so the restart takes the directory.
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  left = {"host": socket.gethostname(), "pid": os.getpid(), "started": "before the kill"}
  (run_dir / LOCK_FILE).write_text(json.dumps(left))
  lock = RunDirLock(str(run_dir)).acquire()
  try:
    assert json.loads((run_dir / LOCK_FILE).read_text()) == lock.owner != left
    # The same process asking again (a second run in one process) is refused, naming itself.
    with pytest.raises(RunDirError, match=rf"in use by pid {os.getpid()} on "):
      RunDirLock(str(run_dir)).acquire()
  finally:
    lock.release()
  assert os.listdir(run_dir) == []
  again = RunDirLock(str(run_dir)).acquire()  # released: taken again
  assert again.held
  again.release()


def test_a_live_holder_is_refused_until_it_is_killed(tmp_path):
  run_dir = tmp_path / "run"
  proc, (pid, child) = _holder(run_dir)
  try:
    # Held by a live process: refused with its owner line, though a forked child of the holder
    # called release (a child's copy of the lock releases nothing).
    with pytest.raises(RunDirError, match=rf"run directory .*run is in use by pid {pid} on "
                       rf"{socket.gethostname()} \(since [\d:\- ]+\); wait for it, stop it, or "
                       r"pick another --config.run_dir$"):
      RunDirLock(str(run_dir)).acquire()
    proc.kill()
    proc.wait()
    # SIGKILLed: its lock file stays, naming it, but the OS lock went with it, and its child
    # (still alive) kept none.
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == int(pid)
    os.kill(int(child), 0)
    lock = RunDirLock(str(run_dir)).acquire()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
  finally:
    proc.kill()
    proc.wait()
    os.kill(int(child), signal.SIGKILL)


def _pid_namespace() -> list[str]:
  """The command prefix that runs a process as pid 1 of a new pid namespace (unshare), or skip.
  `--kill-child`: killing unshare kills the namespace's pid 1 too (without it the lock holder
  outlived the test by its 600 s sleep)."""
  prefix = ["unshare", "--user", "--map-root-user", "--pid", "--kill-child", "--mount-proc"]
  try:
    ok = subprocess.run([*prefix, "sh", "-c", "test $$ = 1"], capture_output=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    pytest.skip("no unshare here")
  if ok.returncode != 0:
    pytest.skip(f"unshare cannot make a pid namespace here: {ok.stderr.decode().strip()}")
  return prefix


def test_a_container_restart_takes_over_from_its_killed_predecessor(tmp_path):
  # The container case itself: the run is pid 1 of its own pid namespace, SIGKILLed, and the
  # same command is started again in a new namespace, where it is pid 1 again.
  prefix = _pid_namespace()
  run_dir = tmp_path / "run"
  first, (pid, _) = _holder(run_dir, *prefix, fork=False)
  try:
    assert pid == "1"
    with pytest.raises(RunDirError, match=rf"in use by pid 1 on {socket.gethostname()} "):
      RunDirLock(str(run_dir)).acquire()
    inner = int(open(f"/proc/{first.pid}/task/{first.pid}/children").read().split()[0])
    os.kill(inner, signal.SIGKILL)  # the namespace's pid 1
    first.wait(timeout=60)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == 1
    second, (pid, _) = _holder(run_dir, *prefix, fork=False)  # (refused: no line)
    try:
      assert pid == "1"
      assert json.loads((run_dir / LOCK_FILE).read_text())["started"]
    finally:
      second.kill()
      second.wait()
  finally:
    first.kill()
    first.wait()


def test_without_os_locks_the_owner_line_decides(tmp_path, monkeypatch):
  # A filesystem without locks (flock fails with ENOLCK, as on NFS without a lock daemon): the
  # lock falls back to the pid in the owner line, as the docs say.
  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", no_locks)
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  dead = subprocess.Popen([sys.executable, "-c", ""])
  dead.wait()
  host = socket.gethostname()
  (run_dir / LOCK_FILE).write_text(json.dumps({"host": host, "pid": dead.pid, "started": "x"}))
  lock = RunDirLock(str(run_dir)).acquire()  # its pid is gone: taken over
  assert json.loads((run_dir / LOCK_FILE).read_text()) == lock.owner
  lock.release()
  assert not (run_dir / LOCK_FILE).exists()
  # A pid alive on this host (here: this process's own) is refused, pointing at the file.
  (run_dir / LOCK_FILE).write_text(json.dumps({"host": host, "pid": os.getpid(), "started": "x"}))
  with pytest.raises(RunDirError, match=rf"in use by pid {os.getpid()} on {host} \(since x\); .*"
                     r"\(a stale lock is .*\.jaxrl\.lock\)$"):
    RunDirLock(str(run_dir)).acquire()


@pytest.mark.slow  # whole runs (fast-suite time budget)
def test_one_run_per_directory(tmp_path):
  run_dir = tmp_path / "run"
  holder, (pid, child) = _holder(run_dir)
  try:
    with pytest.raises(RunDirError, match=rf"run directory .*run is in use by pid {pid} "
                       rf"on {socket.gethostname()} \(since "):
      _run(run_dir, train__steps=1)
    assert os.listdir(run_dir) == [LOCK_FILE]  # the refused run wrote nothing
  finally:
    holder.kill()
    holder.wait()
    os.kill(int(child), signal.SIGKILL)
  # The holder is gone: its lock file is left, holding nothing, and the run takes it.
  assert _run(run_dir, train__steps=1)["rl/steps"] == 1
  assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.slow  # whole runs (fast-suite time budget)
def test_all_skipped_updates_stop_the_run_with_a_checkpoint(tmp_path):
  cfg = _cfg(rollout_kl__coef=0.1, train__max_consecutive_skipped=2)
  parts, params = build_parts(cfg, config_lib.validate(cfg, jax.device_count()))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ck"), async_save=False)
  out = metrics_lib.MetricsWriter(str(tmp_path))
  try:
    with pytest.raises(loop.TrainingHalted, match=r"the last 2 updates \(to step 3\) were all "
                       r"skipped .*train.max_consecutive_skipped=2\); checkpoint of step 3 saved"):
      loop.rl(parts, params, Topology.of(parts),
              loop.RunIO(out, metrics_lib.Progress(stream=io.StringIO()), ckpt=ckpt),
              step=loop.RLStep.build(parts, params, on_batch=_poison({2: "logprobs",
                                                                     3: "logprobs"})))
  finally:
    out.close()
  assert ckpt.latest_step() == 3
  ckpt.close()
  assert [r["skipped_nonfinite"] for r in out.rows if r["phase"] == "rl"] == [0, 1, 1]


def test_a_failed_checkpoint_save_is_reported_at_once(tmp_path, monkeypatch):
  # The host item's write fails as a full disk would; `save`, or else `check` (called by the
  # trainer every step), reports it in one line naming the directory and the OS error, without
  # waiting for the next save.
  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full_disk)
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"saving a checkpoint in .*ck failed: No space left on device \(a "
                           r"checkpoint of this run needs about [\d.]+ MiB, [\d.]+ MiB free "
                           r"there\); .* the checkpoints already there are intact") as info:
    ck.save(1, {"w": jax.numpy.ones(4)}, {"step": 1})  # (the write may fail in save itself)
    for _ in range(200):  # or in the background, within moments
      ck.check()
      time.sleep(0.05)
  assert "\n" not in str(info.value)
  assert checkpoint.complete_steps(str(tmp_path / "ck")) == []


def test_a_second_interrupt_acts_at_once():
  stop = Stop(quit_on_second=False)  # (the default ends the process: tests/test_faults_cli.py)
  old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  try:
    stop.handler(signal.SIGINT, None)
    assert stop() and stop.signal == signal.SIGINT  # the first one only asks
    with pytest.raises(KeyboardInterrupt):
      stop.handler(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGINT, old[0])
    signal.signal(signal.SIGTERM, old[1])
