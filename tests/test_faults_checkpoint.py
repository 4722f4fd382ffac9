"""A checkpoint that cannot be restored, for any reason, is passed over for the one before it.

The decision comes from the restore itself, which reads and hashes every array: a checkpoint
whose array bytes were damaged but still decode is found by the array digests (`digest`), and
one whose array data files were cut short passes every check made without reading the arrays (`step_problem`), and
its restore then fails inside TensorStore (Orbax wraps that error in a bare `Exception`). The run
names it in one line, resumes from the checkpoint before it and continues exactly as a run
resumed from that checkpoint does; its next save replaces the passed-over steps.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

from jaxrl import config as config_lib
from jaxrl.run import driver
from jaxrl.runtime import checkpoint
from jaxrl.runtime.checkpoint import Checkpointer, UnreadableStep, abstract_like

from test_bad_input import _tiny_cfg


def _halve_array_data(step_dir) -> list[str]:
  """Cuts every array data file of a saved step (`state/ocdbt.process_*/d/*`: the arrays' bytes;
  the OCDBT index under `state/d/` stays whole) to half its size; returns their paths."""
  paths = sorted(glob.glob(os.path.join(str(step_dir), "state", "ocdbt.process_*", "d", "*")))
  assert paths, os.listdir(os.path.join(str(step_dir), "state"))
  for path in paths:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
      f.truncate(size // 2)
  return paths


def _state(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  return {"step": jnp.int32(seed), "mu": {"wq": jax.random.normal(k[0], (32, 64)),
                                          "wv": jax.random.normal(k[1], (32, 64))},
          "w": jax.random.normal(k[2], (64, 128))}


def test_truncated_array_data_is_an_unreadable_step(tmp_path):
  # The checks made without reading the arrays pass; the restore raises UnreadableStep (a
  # CheckpointError: one line naming the step and TensorStore's reason), never Orbax's own error.
  directory = str(tmp_path / "ck")
  with Checkpointer(directory, async_save=False) as ck:
    ck.save(1, _state(1), {"v": 1})
  _halve_array_data(tmp_path / "ck" / "1")
  assert checkpoint.step_problem(directory, 1) is None
  with Checkpointer(directory) as ck, pytest.raises(UnreadableStep) as info:
    ck.restore(1, abstract_like(_state(0)))
  message = str(info.value)
  assert info.value.step == 1 and "\n" not in message
  assert message.startswith(f"checkpoint {directory}/1 is unreadable: ")
  assert "OUT_OF_RANGE" in message, message  # TensorStore's own words, the innermost cause


def test_replace_deletes_a_step_of_the_same_number(tmp_path):
  # A run that went back to step 1 (steps 2 and 3 passed over) saves step 2 again: with
  # replace the old steps 2 and 3 are deleted first; without it (even with force) the save of
  # an existing step is skipped as before.
  with Checkpointer(str(tmp_path / "ck"), keep=5, async_save=False) as ck:
    for step in (1, 2, 3):
      ck.save(step, _state(step), {"v": step})
    assert not ck.save(3, _state(30), {"v": 30}, force=True)  # an existing step: skipped
    with pytest.warns(UserWarning, match=r"deleting checkpoint steps \[2, 3\]"):
      assert ck.save(2, _state(20), {"v": 20}, replace=True)
    assert ck.all_steps() == [1, 2]
    state, host = ck.restore(2, abstract_like(_state(0)))
  assert host == {"v": 20} and int(state["step"]) == 20


def _cfg(steps):
  return _tiny_cfg(rollout__lag=2, checkpoint__every=5, checkpoint__keep=3,
                   checkpoint__async_save=True, train__steps=steps)


def _run(run_dir, steps, stop_after=None):
  cfg = _cfg(steps)
  calls = [0]

  def stop():  # asked once per step, after it: a SIGTERM arriving during step `stop_after`
    calls[0] += 1
    return stop_after is not None and calls[0] >= stop_after

  return driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()), stop=stop)


def _rl_rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  timing = ("perf/", "pipeline/", "data_plane/", "val/trainer_wait_s")  # wall-clock, threads
  return [{k: v for k, v in r.items() if not k.startswith(timing)}
          for r in rows if r["phase"] == "rl"]


def _newest_damaged_then_resumed(tmp_path, capsys, damage) -> str:
  """A lag-2 run stopped at step 12 (checkpoints 5, 10 and the stop's 12); `damage` applied to
  checkpoint 12 of a copy, which then resumes to step 16. It must resume from 10 and continue
  exactly like a copy with checkpoint 12 removed (every metric but timings; steps 1..10 kept),
  its own saves replacing the passed-over history, no traceback. Returns the one console line
  that names checkpoint 12."""
  base = tmp_path / "base"
  assert _run(base, 16, stop_after=12)["rl/stopped_at"] == 12
  assert checkpoint.complete_steps(str(base / "checkpoints")) == [5, 10, 12]
  ref = tmp_path / "ref"  # the reference: checkpoint 12 removed, resumed (from 10)
  shutil.copytree(base, ref)
  shutil.rmtree(ref / "checkpoints" / "12")
  damaged = tmp_path / "damaged"
  shutil.copytree(base, damaged)
  damage(damaged / "checkpoints" / "12")

  assert _run(ref, 16)["resumed_from_step"] == 10
  capsys.readouterr()
  summary = _run(damaged, 16)
  said = capsys.readouterr()
  assert summary["resumed_from_step"] == 10
  lines = [ln for ln in said.out.splitlines() if "checkpoints/12" in ln]
  assert len(lines) == 1, said.out
  assert "Traceback" not in said.err, said.err
  assert [r["step"] for r in _rl_rows(damaged)] == list(range(1, 17))
  assert _rl_rows(damaged) == _rl_rows(ref)
  assert checkpoint.complete_steps(str(damaged / "checkpoints"))[-1] == 16
  return lines[0]


@pytest.mark.slow  # three short runs (~40 s on 2 cores)
def test_a_checkpoint_whose_restore_fails_is_passed_over(tmp_path, capsys):
  # The case, smaller: every array data file of the newest checkpoint cut to half its size.
  line = _newest_damaged_then_resumed(tmp_path, capsys, _halve_array_data)
  assert line.startswith("jaxrl: checkpoint ") and "is unreadable: " in line and \
      line.endswith("trying the one before it"), line


def _flip_a_byte_of_the_largest_array_file(step_dir) -> str:
  """Flips one bit of the middle byte of the step's largest array data file (zstd-compressed
  array bytes: it still decodes, to other values, so only the digests can tell)."""
  paths = glob.glob(os.path.join(str(step_dir), "state", "ocdbt.process_*", "d", "*"))
  path = max(paths, key=os.path.getsize)
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0x10
    f.seek(0)
    f.write(bytes(data))
  return path


@pytest.mark.slow  # three short runs (~40 s on 2 cores)
def test_a_flipped_byte_in_the_newest_checkpoint_is_passed_over(tmp_path, capsys):
  # The case: one byte in the middle of an array file of the newest checkpoint flipped.
  # Every file is still there and decodes, so only the array digests find it: the run names the
  # step and the array in one line and continues exactly like a run resumed from the checkpoint
  # before (before digests it resumed from the damaged one and trained on its arrays).
  def flip(step_dir):
    _flip_a_byte_of_the_largest_array_file(step_dir)
    assert checkpoint.step_problem(str(step_dir.parent), 12) is None  # no other check sees it

  line = _newest_damaged_then_resumed(tmp_path, capsys, flip)
  assert re.fullmatch(r"jaxrl: checkpoint \S+/checkpoints/12 is unreadable: array train/\S+ does "
                      r"not match its digest \(crc32 \w{8}, saved \w{8}\): its bytes were "
                      r"damaged after the save; trying the one before it", line), line


@pytest.mark.slow  # one short run and one resume (~25 s on 2 cores)
def test_a_run_that_went_back_ends_before_the_passed_over_step(tmp_path):
  # Resumed from 10 (12 unreadable) with train.steps=11: the final save of step 11 is older than
  # the unreadable 12, which it replaces (a plain save would refuse to go back).
  run_dir = tmp_path / "run"
  _run(run_dir, 16, stop_after=12)
  _halve_array_data(run_dir / "checkpoints" / "12")
  with pytest.warns(UserWarning, match=r"deleting checkpoint steps \[12\]"):
    summary = _run(run_dir, 11)
  assert summary["resumed_from_step"] == 10 and summary["rl/stopped_at"] is None
  assert checkpoint.complete_steps(str(run_dir / "checkpoints")) == [5, 10, 11]
