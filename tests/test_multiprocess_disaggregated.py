"""Disaggregated across processes (`mesh.rollout_processes`, `jaxrl.pipeline.remote`).

Processes of 4 simulated CPU devices, lag 1, through `python -m jaxrl.train`: process 0's
devices only generate, process 1's only train; then two rollout processes and one train process;
one rollout process for a train mesh of two processes (checkpoints folded); LoRA; partial
rollouts. Each run's per-step metrics must be one colocated process's (8 devices) for the same
keys (<= 1e-5), with first-token staleness exactly min(step - 1, 1), only the (first) train
process writing the run directory, and the rollout process generating batch b + 1 while step b
trains (each row carries the wall-clock span of its batch's generation and of its train step).
SIGTERM to any one process checkpoints all and the rerun resumes exactly.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from processes import communicate, free_port
from test_distributed import _env
from test_multiprocess_rollouts import same_metrics

ARGS = ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
        "--config.sft.enabled=false", "--config.train.steps=4", "--config.task.dev_size=16",
        "--config.task.val_size=16", "--config.val.batch_size=16", "--config.val.at_start=false",
        "--config.val.every=2", "--config.rollout.num_prompts=8", "--config.rollout.lag=1",
        "--config.mesh.data=-1"]


def _rows(path, phase="rl") -> list[dict]:
  with open(path / "metrics.jsonl") as f:
    return [r for r in map(json.loads, f) if r.get("phase") == phase]


# `python -m jaxrl.train` with partial rollouts made deterministic: batches 1..3 (the ones made
# after the first step) switch params after their first decode dispatch (one token each), waiting
# there for the next version, which the train side publishes after the step that consumes the
# batch before. So every row's first token is one update stale and the rest are fresh, whatever
# process generates it. (`samplers.partial_source` is the documented seam for this.)
GATED = r"""
import sys, threading, time
from jaxrl.cli import train
from jaxrl.pipeline import producer as producer_lib
from jaxrl.rollout import samplers

here = threading.local()
produce = producer_lib.RolloutProducer.produce

def recording(self, batch_id, params, version):
  here.batch = batch_id
  try:
    return produce(self, batch_id, params, version)
  finally:
    here.batch = None

def gated(newest, version, params):
  calls, b = [], getattr(here, "batch", None)

  def source():
    calls.append(1)
    if b is None or not 1 <= b <= 3 or len(calls) < 2:
      return version, params
    deadline = time.monotonic() + 300
    while (newest() or (-1, None))[0] <= version:
      assert time.monotonic() < deadline, f"batch {b}: no params newer than {version}"
      time.sleep(0.01)
    return newest()

  return source

producer_lib.RolloutProducer.produce = recording
samplers.partial_source = gated
sys.argv = ["jaxrl.train", *sys.argv[1:]]
train.run()
"""
PARTIAL = ["--config.rollout.engine=continuous", "--config.rollout.partial_rollouts=true",
           "--config.rollout.engine_steps=1"]


def _start(run_dir, processes: int = 2, rollout: str = "0",
           program: list[str] | None = None, extra=()) -> list[subprocess.Popen]:
  port = free_port()
  program = program or ["-m", "jaxrl.train"]
  return [subprocess.Popen(
      [sys.executable, *program, *ARGS, *extra, f"--config.mesh.rollout_processes={rollout}",
       f"--config.run_dir={run_dir}"],
      env=_env(4, WORLD_SIZE=str(processes), RANK=str(i), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port)),
      cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(processes)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The colocated one-process run (8 devices) every disaggregated run must repeat."""
  path = tmp_path_factory.mktemp("one")
  one = subprocess.run([sys.executable, "-m", "jaxrl.train", *ARGS, f"--config.run_dir={path}"],
                       env=_env(8), cwd=path.parent, capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stdout + one.stderr
  return path


def _sigterm_after_first_step(run, procs, victim: int) -> list[str]:
  deadline = time.monotonic() + 300
  while not ((run / "metrics.jsonl").exists() and len(_rows(run)) >= 1):
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.05)
  procs[victim].send_signal(signal.SIGTERM)
  return communicate(procs, 600)


@pytest.mark.slow
def test_rollout_process_and_train_process_match_one_colocated_process(tmp_path, one_process):
  outs = communicate(_start(tmp_path / "two"), 600)
  assert "processes [0] generate on their 4 devices" in outs[1], outs[1]
  assert "wrote " in outs[1] and "wrote " not in outs[0], outs

  base, rows = _rows(one_process), _rows(tmp_path / "two")
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/first_token/min"] for r in rows] == [0, 1, 1, 1]
  assert [r["consume_version"] - r["submit_version"] for r in rows] == [0, 1, 1, 1]
  assert same_metrics(base, rows) > 150
  # Validation ran on the train processes (steps 2 and 4), with the one-process accuracy.
  assert [(r["step"], r["val/accuracy"]) for r in _rows(tmp_path / "two", "val")] == \
      [(r["step"], r["val/accuracy"]) for r in _rows(one_process, "val")]

  # The rollout process never waits for a step it does not need: batch s (version s - 1) starts
  # after step s - 1 and before step s ends. Step s trains batch s - 1 meanwhile (their spans
  # intersect) unless a validation pass (inline, after step 2) came between.
  for prev, row, nxt in zip([None] + rows, rows, rows[1:]):
    gen_from, gen_to = nxt["pipeline/generated_from"], nxt["pipeline/generated_to"]
    assert prev is None or prev["perf/train_to"] < gen_from, (prev, nxt)
    assert gen_from < row["perf/train_to"], (row, nxt)
    if row["step"] - 1 != 2:
      assert gen_to > row["perf/train_from"], (row, nxt)

  # SIGTERM to the rollout process after step 1 (a preempted host): it tells the train process,
  # which checkpoints both sides' way (the rollout process takes part in the save) and stops;
  # both exit 0, and the same command again resumes and writes the uninterrupted run's metrics.
  run = tmp_path / "term"
  outs = _sigterm_after_first_step(run, _start(run), 0)
  assert "stopped by signal after step" in outs[1], outs[1]
  stopped = len(_rows(run))
  assert 1 <= stopped < 4, outs[1]
  outs = communicate(_start(run), 600)
  assert f"resumed at step {stopped}" in outs[1], outs[1]
  assert same_metrics(rows, _rows(run)) > 150


@pytest.mark.slow
def test_two_rollout_processes_make_a_batch_between_them(tmp_path, one_process):
  """3 processes x 4 devices: processes 0 and 1 generate, each its half of every batch's groups
  on its own devices (each receives the whole params from the train process), process 2 trains.
  The per-step metrics are still the one colocated process's; SIGTERM to the second rollout
  process makes all three checkpoint and exit 0, and the rerun resumes exactly."""
  outs = communicate(_start(tmp_path / "three", 3, "0,1"), 600)
  assert "processes [0, 1] generate on their 8 devices (a 4x1x1 mesh each)" in outs[2], outs[2]
  assert "wrote " in outs[2] and not any("wrote " in o for o in outs[:2]), outs
  rows = _rows(tmp_path / "three")
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert same_metrics(_rows(one_process), rows) > 150

  run = tmp_path / "term"
  outs = _sigterm_after_first_step(run, _start(run, 3, "0,1"), 1)
  assert "stopped by signal after step" in outs[2], outs[2]
  stopped = len(_rows(run))
  assert 1 <= stopped < 4, outs[2]
  outs = communicate(_start(run, 3, "0,1"), 600)
  assert f"resumed at step {stopped}" in outs[2], outs[2]
  assert same_metrics(rows, _rows(run)) > 150


@pytest.mark.slow
def test_fewer_rollout_devices_than_the_train_mesh(tmp_path, one_process):
  """3 processes x 4 devices: process 0 generates on 4 devices for a train mesh of 8 (processes
  1 and 2), so each checkpoint folds the train mesh in two to mirror it. SIGTERM to the second
  train process after step 1: all three checkpoint and exit 0; the rerun restores through the
  same fold, and the whole run's per-step metrics are the one colocated process's."""
  run = tmp_path / "fold"
  outs = _sigterm_after_first_step(run, _start(run, 3, "0"), 2)
  assert "processes [1, 2] train on 8" in outs[1], outs[1]
  assert "stopped by signal after step" in outs[1], outs[1]
  stopped = len(_rows(run))
  assert 1 <= stopped < 4, outs[1]
  outs = communicate(_start(run, 3, "0"), 600)
  assert f"resumed at step {stopped}" in outs[1], outs[1]
  rows = _rows(run)
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert same_metrics(_rows(one_process), rows) > 150


@pytest.mark.slow
def test_partial_rollouts_on_a_rollout_process(tmp_path):
  """The continuous engine with partial rollouts on the rollout process: a batch starts on its
  forced-lag version and switches to the newest one joined (deterministically here, `GATED`), the
  tokens stamped with the version that made them; the per-step metrics are one colocated
  process's with the same switches, staleness included."""
  one = subprocess.run([sys.executable, "-c", GATED, *ARGS, *PARTIAL,
                        f"--config.run_dir={tmp_path / 'one'}"], env=_env(8), cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stdout + one.stderr
  communicate(_start(tmp_path / "two", program=["-c", GATED], extra=PARTIAL), 600)
  base, rows = _rows(tmp_path / "one"), _rows(tmp_path / "two")
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/first_token/min"] for r in rows] == [0, 1, 1, 1]
  # Partial rollouts happened: rows of steps 2..4 end on the params of the step before (tokens
  # of two versions in one row, each stamped with its own).
  assert [r["staleness/last_token/min"] for r in rows] == [0, 0, 0, 0]
  assert all(0 < r["staleness/token_mean/mean"] < 1 for r in rows[1:]), rows
  assert same_metrics(base, rows) > 150


@pytest.mark.slow
def test_lora_moves_the_base_once_then_adapters(tmp_path):
  """LoRA on a rollout process: the base crosses with the first version (and again after a
  restore), the adapters alone every other version, merged there; the per-step metrics are a
  colocated LoRA run's. SIGTERM to the train process after step 1, then the rerun: the whole
  run still matches."""
  lora = ["--config.model.lora.rank=4"]
  one = subprocess.run([sys.executable, "-m", "jaxrl.train", *ARGS, *lora,
                        f"--config.run_dir={tmp_path / 'one'}"], env=_env(8), cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stdout + one.stderr
  run = tmp_path / "two"
  outs = _sigterm_after_first_step(run, _start(run, extra=lora), 1)
  crossing = re.search(r"the base once \(([\d,]+) bytes\), then the adapters \(([\d,]+) bytes "
                       r"per version\)", outs[1])
  assert crossing, outs[1]
  base, adapters = (int(g.replace(",", "")) for g in crossing.groups())
  assert 0 < adapters < base / 4, (base, adapters)
  stopped = len(_rows(run))
  assert 1 <= stopped < 4 and "stopped by signal after step" in outs[1], outs[1]
  outs = communicate(_start(run, extra=lora), 600)
  assert f"resumed at step {stopped}" in outs[1], outs[1]
  assert same_metrics(_rows(tmp_path / "one"), _rows(run)) > 150
