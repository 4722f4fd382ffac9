"""Failures at run time end in one line: `python -m jaxrl.train` run as a subprocess, its stderr
read. A full disk during a background save, a rollout stall, an evaluation stall and the other
errors a run can meet at run time are one `jaxrl:` line naming what to change, with no traceback;
a second Ctrl-C ends the run at once with exit status 130, quietly; Orbax's background noise (a
TensorStore callback into a closed event loop) is filtered; a named pipe given as a data file is
named as such, not as a missing file."""

from __future__ import annotations

import asyncio
import collections
import gc
import io
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl.cli.train import user_message
from jaxrl.pipeline.gate import LagGate
from jaxrl.run.validation import Evaluator
from jaxrl.runtime import quiet

from test_cli import _tiny


def _args(run_dir, *extra):
  return _tiny(0, 12, 100, "--config.sft.enabled=false", "--config.val.at_start=false",
               "--config.val.at_end=false", "--config.task.dev_size=16",
               "--config.task.val_size=16", "--config.val.batch_size=16",
               # No shared compilation cache: its own warnings (another process's entries) would
               # come on the console beside the one line these tests look for.
               "--config.compile_cache=", f"--config.run_dir={run_dir}", *extra)


def _train(args, cwd, **env):
  env = {**{k: v for k, v in os.environ.items() if k != "JAXRL_DEBUG"}, **env}
  return subprocess.run([sys.executable, "-m", "jaxrl.train", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


def _one_jaxrl_line(stderr: str) -> str:
  lines = [ln for ln in stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("jaxrl: "), stderr[-3000:]
  return lines[0]


@pytest.fixture
def small_disk(tmp_path):
  """A 96 KiB tmpfs: room for the run's files, not for its first checkpoint (~0.3 MiB)."""
  where = tmp_path / "disk"
  where.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(where)],
                    capture_output=True).returncode != 0:
    pytest.skip("mounting a tmpfs needs root (a full disk is simulated on a small tmpfs)")
  yield where
  subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow  # a run to its first checkpoint (~15 s on 2 cores)
def test_a_full_disk_is_one_line(tmp_path, small_disk):
  proc = _train(_args(small_disk / "run", "--config.checkpoint.every=5"), tmp_path)
  assert proc.returncode == 1
  line = _one_jaxrl_line(proc.stderr)
  assert line.startswith(f"jaxrl: saving a checkpoint in {small_disk}/run/checkpoints failed: "
                         "No space left on device (a checkpoint of this run needs about "), line
  assert " MiB free there)" in line and "RESOURCE_EXHAUSTED" not in proc.stderr
  # The steps before the failed save were logged (the save of step 5 is the first to fail).
  assert "checkpoints already there are intact" in line
  assert len((small_disk / "run" / "metrics.jsonl").read_text().splitlines()) >= 5


@pytest.mark.slow  # a run to its first batch (~15 s on 2 cores)
def test_a_rollout_stall_is_one_line(tmp_path):
  # rollout.stall_timeout_s at its least (1 s) and the compilation cache off: the first batch
  # waits for the sampler's compilation, longer than that.
  proc = _train(_args(tmp_path / "run", "--config.rollout.lag=1",
                      "--config.rollout.stall_timeout_s=1.0", "--config.compile_cache="),
                tmp_path)
  assert proc.returncode == 1
  line = _one_jaxrl_line(proc.stderr)
  assert line.startswith("jaxrl: no rollout batch arrived for 1 s") and \
      "(rollout.stall_timeout_s=1; raise it" in line, line


def test_run_time_stalls_and_caps_are_user_errors():
  # The errors a run meets at run time that a key decides are one `jaxrl:` line at the CLI.
  gate = LagGate(1, stall_timeout_s=0.05)
  with pytest.raises(Exception) as stall:
    gate.pull()
  evaluator = Evaluator(run=lambda step, params: time.sleep(1.0) or {}, asynchronous=True,
                        max_wait_s=0.05)
  evaluator.submit(1, None)
  with pytest.raises(Exception) as stalled:
    evaluator.submit(2, None)
  evaluator.close()
  for info, key in ((stall, "rollout.stall_timeout_s=0.05"), (stalled, "val.max_wait_s=0.05")):
    message = user_message(info.value)
    assert message is not None and message.startswith("jaxrl: ") and key in message, message
    assert "\n" not in message


# The argument sys.unraisablehook gets (sys.UnraisableHookArgs cannot be built from Python).
_Unraisable = collections.namedtuple(
    "_Unraisable", "exc_type exc_value exc_traceback err_msg object")


def test_a_closed_loop_callback_is_filtered_from_the_console():
  # What TensorStore prints (through sys.unraisablehook, without an object, or sys.excepthook)
  # when it calls back into an event loop that Orbax closed after a failed restore or save:
  # filtered; any other error is printed as before.
  if quiet.debug():
    pytest.skip("JAXRL_DEBUG keeps every traceback")
  # Python's own hooks underneath: another test of this process may have left a library's hook
  # that prints and then calls the one before it (a wandb run does), which would print twice.
  hooks = sys.excepthook, sys.unraisablehook
  sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
  try:
    _check_the_closed_loop_filter()
  finally:
    sys.excepthook, sys.unraisablehook = hooks


def _check_the_closed_loop_filter():
  quiet.install()
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError:
    closed = sys.exc_info()
  try:
    raise RuntimeError("Event loop is closed")  # the same words from elsewhere: printed
  except RuntimeError:
    other = sys.exc_info()
  err = io.StringIO()
  old = sys.stderr
  sys.stderr = err
  try:
    sys.excepthook(*closed)
    sys.unraisablehook(_Unraisable(*closed, None, None))
    assert err.getvalue() == ""
    sys.excepthook(*other)  # (pytest's own unraisable hook would take the other one)
  finally:
    sys.stderr = old
  assert err.getvalue().count("RuntimeError: Event loop is closed") == 1, err.getvalue()
  assert quiet.closed_loop_callback(*closed) and not quiet.closed_loop_callback(*other)


def test_an_orbax_task_error_nobody_retrieved_is_filtered_from_the_console():
  # A save that fails on a full disk leaves its other write tasks failed and never awaited;
  # asyncio logs each when it is collected ("Task exception was never retrieved"), at a moment
  # the garbage collector picks. A task raising in Orbax's source is filtered; another is logged.
  if quiet.debug():
    pytest.skip("JAXRL_DEBUG keeps every traceback")
  quiet.install()
  where = {}
  # A coroutine whose code is Orbax's by its file name, as Orbax's write_fragment is.
  exec(compile("async def write_fragment():\n  raise ValueError('RESOURCE_EXHAUSTED')\n",
               os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py"),
               "exec"), where)

  async def elsewhere():
    raise ValueError("an error of some other task")

  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logger = logging.getLogger("asyncio")
  logger.addHandler(handler)
  try:
    for make in (where["write_fragment"], elsewhere):
      loop = asyncio.new_event_loop()
      task = loop.create_task(make())
      loop.run_until_complete(asyncio.sleep(0))  # the task ran and failed; nobody awaits it
      loop.close()
      del task
      gc.collect()  # collected: asyncio logs the error nobody retrieved
  finally:
    logger.removeHandler(handler)
  messages = [r.getMessage() for r in records]
  assert len(records) == 1 and "never retrieved" in messages[0], messages
  assert "other task" in str(records[0].exc_info[1])


@pytest.mark.slow  # a run to its first RL step (~15 s on 2 cores)
def test_a_second_ctrl_c_exits_at_once_quietly(tmp_path):
  run_dir = tmp_path / "run"
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxrl.train",
       *_args(run_dir, "--config.train.steps=100000", "--config.log_every=1")],
      cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={k: v for k, v in os.environ.items() if k != "JAXRL_DEBUG"})
  try:
    for line in proc.stdout:  # the RL loop is running: the signal handlers are in place
      if line.lstrip().startswith("1/100000") or "first RL step done" in line:
        break
    proc.send_signal(signal.SIGINT)  # asks for a checkpoint after the current step
    time.sleep(0.05)  # (two signals before the handler runs would count as one)
    proc.send_signal(signal.SIGINT)  # while it is being made: at once
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 130, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err and \
      "Save Finalize" not in err, err
  assert _one_jaxrl_line(err).startswith("jaxrl: interrupted twice: stopped at once")


def test_a_named_pipe_as_data_file_is_named(tmp_path):
  fifo = tmp_path / "rows.jsonl"
  os.mkfifo(fifo)
  proc = _train(["--config.task.name=math", f"--config.task.path={fifo}"], tmp_path)
  assert proc.returncode == 1
  assert f"config.task.path: '{fifo}' is a named pipe (FIFO), not a regular file" in \
      proc.stderr, proc.stderr
  assert "no file" not in proc.stderr and "Traceback" not in proc.stderr
