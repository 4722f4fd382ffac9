"""Rollout processes that come and go (docs/failures.md), through `python -m jaxrl.train`: one
train process (process 0, which runs the coordination service) and two rollout processes
(1 and 2), 4 simulated CPU devices each, gloo, lag 1, partial rollouts off.

SIGKILL (or SIGSTOP: a hung process) of rollout process 2 after the first logged step: the
train process drops it within `distributed.peer_timeout_s`, process 1 makes its undelivered
parts and then its share of every later batch, and the run finishes all its steps with rc 0 on the two processes left. Every
step's first-token staleness is exactly min(step - 1, 1), every step's metrics are one colocated
process's (8 devices) for the same keys (the parts made again are the very rows the lost process
would have made), the steps after the loss say process 1 made every group, and the run's last
lines say how many groups it made for process 2. The same command started again for process 2
rejoins: it makes its own half of every batch again from at most L + 2 steps after the train
process took it back.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxrl.runtime.checkpoint import Checkpointer
from processes import communicate, free_port
from test_distributed import _env
from test_multiprocess_rollouts import same_metrics

STEPS, PROMPTS, LAG = 8, 8, 1
ARGS = ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
        "--config.sft.enabled=false", f"--config.train.steps={STEPS}",
        "--config.task.dev_size=16", "--config.task.val_size=16", "--config.val.batch_size=16",
        "--config.val.at_start=false", "--config.val.every=4",
        f"--config.rollout.num_prompts={PROMPTS}", f"--config.rollout.lag={LAG}",
        "--config.mesh.data=-1"]
PEER_TIMEOUT_S = 5


def _rows(path) -> list[dict]:
  with open(path / "metrics.jsonl") as f:
    return [r for r in map(json.loads, f) if r.get("phase") == "rl"]


def _start(run_dir, rollout: str = "1,2", extra=(), port=None,
           ranks=(0, 1, 2)) -> list[subprocess.Popen]:
  port = port or free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jaxrl.train", *ARGS, *extra,
       f"--config.mesh.rollout_processes={rollout}",
       f"--config.distributed.peer_timeout_s={PEER_TIMEOUT_S}", f"--config.run_dir={run_dir}"],
      env=_env(4, WORLD_SIZE="3", RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
      cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in ranks]
  for p in procs:
    p.args_port = port  # the same command again joins the same run
  return procs


def _wait_rows(run, procs, n: int) -> None:
  deadline = time.monotonic() + 300
  while not ((run / "metrics.jsonl").exists() and len(_rows(run)) >= n):
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
        [p.poll() for p in procs]
    time.sleep(0.05)


def _colocated(path, extra=()) -> list[dict]:
  """The rows of the colocated one-process run (8 devices) the disaggregated runs must repeat."""
  one = subprocess.run([sys.executable, "-m", "jaxrl.train", *ARGS, *extra,
                        f"--config.run_dir={path}"],
                       env=_env(8), cwd=path.parent, capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stdout + one.stderr
  return _rows(path)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  return _colocated(tmp_path_factory.mktemp("one"))


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_rollout_process_and_the_run_goes_on(tmp_path, one_process, how):
  """SIGKILL, or SIGSTOP (a hung process, never resumed here), of rollout process 2."""
  run = tmp_path / "lost"
  procs = _start(run)
  _wait_rows(run, procs, 1)
  procs[2].send_signal(how)
  killed_at = len(_rows(run))
  try:
    outs = communicate(procs[:2], 600)
  finally:
    procs[2].kill()
    procs[2].wait()
  train = outs[0]
  assert re.search(r"lost process 2 of 3: no heartbeat for 5 s .*: dropped; \d+ undelivered "
                   r"part\(s\) of its batches go to rollout process\(es\) \[1\]", train), train
  rows = _rows(run)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert [r["staleness/first_token/max"] for r in rows] == \
      [min(t - 1, LAG) for t in range(1, STEPS + 1)]
  assert same_metrics(one_process, rows) > 250
  # Each process's own part is half the batch's groups; after the loss process 1 makes them all.
  half = PROMPTS // 2
  assert rows[0]["pipeline/groups_made/1"] == rows[0]["pipeline/groups_made/2"] == half
  late = rows[killed_at + LAG + 2:]
  assert late and all(r["pipeline/groups_made/1"] == PROMPTS and
                      "pipeline/groups_made/2" not in r for r in late), late
  made = sum(r.get("pipeline/groups_made/1", 0) for r in rows)
  by_2 = sum(r.get("pipeline/groups_made/2", 0) for r in rows)
  assert made + by_2 == STEPS * PROMPTS
  line = re.search(r"rollout groups made: process 1: (\d+) \((\d+) of its own, (\d+) for "
                   r"process 2\)", train)
  assert line, train
  # The batches the run made ahead of its last step (LAG of them) count too.
  total, own, for_2 = map(int, line.groups())
  assert total == own + for_2 and own == (STEPS + LAG) * half and for_2 >= made - STEPS * half


@pytest.mark.slow
@pytest.mark.parametrize("lag", [LAG, 2])
def test_every_rollout_process_lost_stops_with_one_line_and_the_rerun_resumes(tmp_path,
                                                                              one_process, lag):
  """SIGKILL of both rollout processes after step 2: the train process drops them, waits
  `distributed.peer_timeout_s` more for one to come back, then checkpoints its last completed
  step (the ring as it is, with the older params versions its undelivered batches need) and
  stops (rc 1) with one `jaxrl:` line naming that step and no traceback; the same command on
  every process resumes from it (the run has no other checkpoint), and the whole run's
  per-step metrics are one colocated process's, at lag 1 and 2."""
  extra = ["--config.checkpoint.every=100", f"--config.rollout.lag={lag}"]
  reference = one_process if lag == LAG else _colocated(tmp_path / "one", extra[1:])
  run = tmp_path / "all"
  procs = _start(run, extra=extra)
  _wait_rows(run, procs, 2)
  for p in procs[1:]:
    p.send_signal(signal.SIGKILL)
  t0 = time.monotonic()
  out = communicate(procs[:1], 300, check=False)[0]
  waited = time.monotonic() - t0
  for p in procs[1:]:
    p.wait()
  assert procs[0].returncode == 1, out
  lines = [ln for ln in out.splitlines() if ln.startswith("jaxrl:")]
  assert len(lines) == 1 and "Traceback" not in out, out
  stopped = len(_rows(run))
  assert 2 <= stopped < STEPS
  assert re.fullmatch(
      r"jaxrl: every rollout process \(1, 2\) was lost and none came back within "
      rf"distributed.peer_timeout_s={PEER_TIMEOUT_S} s while the train side waited for batch "
      rf"\d+; a checkpoint of step {stopped}, the last completed step, was saved: rerun the "
      "same command on every process to resume from it", lines[0]), lines
  # Dropped after a silence of the timeout, then waited for as long again.
  assert 2 * PEER_TIMEOUT_S <= waited < 2 * PEER_TIMEOUT_S + 60, waited
  # The only checkpoint: step T's, whose undelivered batches (from the first the gate gave
  # back) need the params versions b - L below the newest, T, saved with it.
  with Checkpointer(str(run / "checkpoints"), read_only=True) as ckpt:
    assert ckpt.all_steps() == [stopped]
    _, host = ckpt.read_host(stopped)
  first = host["gate"]["submitted"]
  assert sorted(map(int, host["versions"])) == list(range(max(0, first - lag), stopped))
  assert host["versions"]  # the trainer waited for batch T: T - L .. T - 1 were needed
  outs = communicate(_start(run, extra=extra), 600)
  assert f"resumed from step {stopped} " in outs[0], outs[0]
  rows = _rows(run)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert [r["staleness/first_token/max"] for r in rows] == \
      [min(t - 1, lag) for t in range(1, STEPS + 1)]
  assert same_metrics(reference, rows) > 250


@pytest.mark.slow
def test_a_restarted_rollout_process_joins_again(tmp_path):
  """SIGKILL of rollout process 2, then, once the train process has dropped it, the same
  command for process 2 again: it joins the run again and makes its own part of every batch
  from the first one not yet assigned; the run finishes with rc 0 on all three (the new start
  of process 2 too) and staleness exact at every step."""
  steps = 80  # room for the new start (about 10 s on 2 cores) before the run ends
  run = tmp_path / "back"
  procs = _start(run, extra=[f"--config.train.steps={steps}"])
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(procs[0].stdout), daemon=True)
  reader.start()
  _wait_rows(run, procs, 1)
  procs[2].send_signal(signal.SIGKILL)
  procs[2].wait()
  deadline = time.monotonic() + 120
  while not any("dropped" in ln for ln in lines):
    assert time.monotonic() < deadline and procs[0].poll() is None, lines
    time.sleep(0.05)
  again = _start(run, extra=[f"--config.train.steps={steps}"], port=procs[0].args_port,
                 ranks=(2,))[0]
  while not any("started again" in ln for ln in lines):
    assert time.monotonic() < deadline + 120 and procs[0].poll() is None, lines
    time.sleep(0.05)
  rejoined_at = len(_rows(run))  # steps logged when the train process took it back (or more)
  outs = communicate([procs[1], again], 600)
  procs[0].wait(timeout=600)
  reader.join(timeout=10)
  train = "".join(lines)
  assert procs[0].returncode == 0, train
  assert re.search(r"rollout process 2 started again: it makes its part from batch \d+ on",
                   train), train
  assert all("Traceback" not in o for o in outs), outs
  rows = _rows(run)
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  assert [r["staleness/first_token/max"] for r in rows] == \
      [min(t - 1, LAG) for t in range(1, steps + 1)]
  assert all(r.get("pipeline/groups_made/1", 0) + r.get("pipeline/groups_made/2", 0) == PROMPTS
             for r in rows), rows
  back = [r["step"] for r in rows if r.get("pipeline/groups_made/2") == PROMPTS // 2]
  alone = [r["step"] for r in rows if r.get("pipeline/groups_made/1") == PROMPTS]
  assert alone and max(back) == steps and any(b > min(alone) for b in back), rows
  # Back within two versions: when the train process took it back its newest version v was
  # at most one past the steps logged (a step publishes, then logs), the batches up to v + L
  # were assigned, and its first, v + L + 1, is trained at step v + L + 2.
  again_from = min(b for b in back if b > max(alone))
  assert again_from <= rejoined_at + 1 + LAG + 2, (again_from, rejoined_at)
  assert all(r.get("pipeline/groups_made/2") == PROMPTS // 2 for r in rows[again_from - 1:]), rows
