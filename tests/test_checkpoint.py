"""Checkpoints: exact round trip, restore onto another mesh, async snapshots, pruning, atomicity,
resume resolution, numpy RNG state."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from orbax.checkpoint._src.path import async_path

from conftest import tiny_model_config
from jaxrl import parallel
from jaxrl.runtime.checkpoint import (Checkpointer, abstract_like, checkpoint_dir, numpy_rng_state,
                              resolve_resume, restore_numpy_rng)
from jaxrl.runtime.checkpoint import CheckpointError, choose_step, step_problem
from jaxrl.models import init_model
from jaxrl.learner.step import (StepConfig, build_train_step, make_optimizer, shard_params,
                              to_rows)
from jaxrl.core.types import TrainState
from test_train_step import _batch

TMP = ".orbax-checkpoint-tmp"  # Orbax's name for a step directory being written


def _opt():
  return make_optimizer(1e-3, b2=0.98)


@pytest.fixture(scope="module")
def model():
  """(graphdef, params) of the tiny model, built once (initialisation compiles)."""
  return init_model(tiny_model_config(), seed=0)


@pytest.fixture(scope="module")
def state1(model):
  """A TrainState on a 1-device mesh whose every leaf is non-trivial: params and Adam moments
  moved by a positive amount (nu stays >= 0), integer counters and `step` advanced, so a restore
  that dropped or zeroed a leaf cannot pass for a good one."""
  graphdef, params = model
  mesh = parallel.make_mesh(1, 1, 1)
  _, init = build_train_step(graphdef, _opt(), StepConfig(), mesh, shard_params(params, mesh))
  state = init(shard_params(params, mesh))
  rng = np.random.default_rng(0)

  def perturb(x):
    host = np.asarray(x)
    if np.issubdtype(host.dtype, np.integer):
      host = host + rng.integers(1, 50, host.shape).astype(host.dtype)
    else:
      host = host + rng.uniform(1e-4, 1e-2, host.shape).astype(host.dtype)
    return jax.device_put(host, x.sharding)

  return jax.tree.map(perturb, state)


def _host_copy(tree):
  return jax.tree.map(np.array, tree)


def _assert_same(tree, expected):
  assert jax.tree.structure(tree) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected)):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _small(value: float):
  """A cheap state for tests about steps rather than contents."""
  return {"w": jnp.full((4, 3), value, jnp.float32), "n": jnp.asarray(int(value), jnp.int32)}


def test_train_state_round_trip_is_exact(tmp_path, state1):
  rng = np.random.default_rng(123)
  rng.random(5)
  rng.integers(0, 1000, dtype=np.int32)  # leaves half a 64-bit word buffered (has_uint32 = 1)
  host = {"rng": numpy_rng_state(rng), "cursor": 17, "counters": {"regenerated": 2},
          "ring": [{"batch_id": 6, "version": 5, "prompt_ids": [3, 1, 4]}], "lr": 3e-4,
          "best": None, "done": False, "big": 2**80, "val_next": float("inf")}
  assert host["rng"]["has_uint32"] == 1
  saved = _host_copy(state1)
  with Checkpointer(str(tmp_path / "ck"), async_save=False) as ck:
    assert ck.save(7, state1, host)
    assert ck.latest_step() == 7
    target = abstract_like(state1)
    state, host_back = ck.restore(None, target)

  assert isinstance(state, TrainState) and isinstance(state.params, nnx.State)
  assert state.ref_params is None
  _assert_same(state, saved)
  for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
    assert x.sharding == t.sharding
  assert int(state.step) == int(saved.step) > 0
  assert host_back == host
  # The RNG continues exactly where it was: same next draws as the original, of every width.
  again = restore_numpy_rng(host_back["rng"])
  assert again.integers(0, 2**31, dtype=np.int32) == rng.integers(0, 2**31, dtype=np.int32)
  np.testing.assert_array_equal(again.random(8), rng.random(8))
  np.testing.assert_array_equal(again.permutation(50), rng.permutation(50))


@pytest.mark.slow
def test_restore_from_one_device_onto_an_8_device_mesh_then_train(tmp_path, devices, model,
                                                                  state1):
  ck_dir = str(tmp_path / "ck")
  host = {"cursor": 3}
  with Checkpointer(ck_dir, async_save=False) as ck:
    ck.save(int(state1.step), state1, host)
  saved = _host_copy(state1)

  graphdef, params = model
  mesh = parallel.make_mesh(4, 2, 1)
  step_fn, init = build_train_step(graphdef, _opt(), StepConfig(), mesh,
                                   shard_params(params, mesh))
  target = abstract_like(init(shard_params(params, mesh)))
  with Checkpointer(ck_dir) as ck:
    state, host_back = ck.restore(None, target)

  assert host_back == host
  _assert_same(state, saved)
  for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
    assert x.sharding == t.sharding
  # The target really distributes: wq [L, D, H, Dh] is split over fsdp (D) on 8 devices.
  wq = state.params["wq"][...]
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  assert len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape[1] == 32 // 2

  new, metrics = step_fn(state, to_rows(_batch(), mesh))
  assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped_nonfinite"]) == 0
  assert int(new.step) == int(saved.step) + 1
  assert not np.array_equal(np.asarray(new.params["wq"][...]), saved.params["wq"][...])


def test_async_save_snapshots_state_and_host(tmp_path, state1, monkeypatch):
  # The caller donates the state and mutates `host` right after save() returns, while the
  # background write is still held back; the checkpoint holds what was passed.
  state = jax.tree.map(jnp.copy, state1)
  saved = _host_copy(state)
  host = {"cursor": 5, "ring": [1, 2]}
  release = threading.Event()
  write_json = ocp.handlers.JsonCheckpointHandler._save_fn

  async def held_write(self, *args):
    await asyncio.to_thread(release.wait, 60)
    return await write_json(self, *args)

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", held_write)
  bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  with Checkpointer(str(tmp_path / "ck"), async_save=True) as ck:
    try:
      assert ck.save(1, state, host)
      leaves = jax.tree.leaves(state)
      state = bump(state)
      # Whether or not the jitted update honoured the donation (an executable loaded from the
      # persistent compilation cache may not), the caller's buffers are gone after save():
      for x in leaves:
        if not x.is_deleted():
          x.delete()
      host["cursor"] = 99
      host["ring"].append(3)
      assert ck.latest_step() is None  # still being written
    finally:
      release.set()
    ck.wait()
    assert sorted(os.listdir(ck.directory)) == ["1"] and ck.latest_step() == 1
    restored, host_back = ck.restore(1, abstract_like(state))
  _assert_same(restored, saved)
  assert host_back == {"cursor": 5, "ring": [1, 2]}
  assert not np.array_equal(np.asarray(jax.tree.leaves(state)[0]), jax.tree.leaves(saved)[0])


def test_keep_prunes_old_checkpoints(tmp_path):
  with Checkpointer(str(tmp_path / "ck"), keep=2) as ck:
    for step in range(1, 5):
      assert ck.save(step, _small(step), {"step": step})
    ck.wait()
    assert sorted(os.listdir(ck.directory)) == ["3", "4"]
    assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
    state, host = ck.restore(3, abstract_like(_small(0)))
  assert host == {"step": 3} and float(state["w"][0, 0]) == 3.0 and int(state["n"]) == 3


def test_saving_an_existing_step_is_skipped(tmp_path):
  with Checkpointer(str(tmp_path / "ck")) as ck:
    assert ck.save(3, _small(1), {"v": 1})
    assert not ck.save(3, _small(2), {"v": 2})  # in flight: skipped
    ck.wait()
    assert not ck.save(3, _small(2), {"v": 2})
    assert not ck.save(3, _small(2), {"v": 2}, force=True)  # never overwritten
    assert ck.all_steps() == [3]
    _, host = ck.restore(3, abstract_like(_small(0)))
  assert host == {"v": 1}


def test_going_back_needs_force_and_drops_the_newer_steps(tmp_path):
  with Checkpointer(str(tmp_path / "ck"), keep=3) as ck:
    for step in (1, 3, 5):
      ck.save(step, _small(step), {"v": step})
    with pytest.raises(ValueError, match="step 4 is older than step 5"):
      ck.save(4, _small(4), {"v": 4})
    ck.wait()
    assert ck.all_steps() == [1, 3, 5]  # the refused save touched nothing
    with pytest.warns(UserWarning, match=r"deleting checkpoint steps \[5\]"):
      assert ck.save(4, _small(4), {"v": 4}, force=True)
    ck.wait()
    assert ck.all_steps() == [1, 3, 4] and sorted(os.listdir(ck.directory)) == ["1", "3", "4"]
    # Pruning then follows the new history: step 1 goes, not step 4.
    assert ck.save(6, _small(6), {"v": 6})
    ck.wait()
    assert ck.all_steps() == [3, 4, 6] and ck.latest_step() == 6
    _, host = ck.restore(4, abstract_like(_small(0)))
  assert host == {"v": 4}


def test_interrupted_save_is_never_picked(tmp_path):
  # What a SIGKILL just before Orbax's final rename leaves behind: step 7 fully written (even its
  # commit_success.txt) but still under the tmp name.
  run = tmp_path / "run"
  ck_dir = checkpoint_dir(str(run))
  with Checkpointer(ck_dir, async_save=False) as ck:
    ck.save(5, _small(5), {"step": 5})
  shutil.copytree(os.path.join(ck_dir, "5"), os.path.join(ck_dir, "7" + TMP))
  assert os.path.exists(os.path.join(ck_dir, "7" + TMP, "commit_success.txt"))
  os.makedirs(os.path.join(ck_dir, "9" + TMP))  # and one killed as it started

  ro = Checkpointer(ck_dir, read_only=True)  # a reader leaves the tmp directory alone
  assert ro.latest_step() == 5 and ro.all_steps() == [5]
  assert os.path.exists(os.path.join(ck_dir, "7" + TMP))
  assert resolve_resume("auto", str(run)) == (os.path.abspath(ck_dir), None)
  with Checkpointer(ck_dir) as ck:  # the writer deletes them, and step 7 can be saved again
    assert ck.latest_step() == 5
    state, host = ck.restore(None, abstract_like(_small(0)))
    assert host == {"step": 5} and float(state["w"][0, 0]) == 5.0
    assert ck.save(7, _small(8), {"step": 8})
    ck.wait()
    assert sorted(os.listdir(ck_dir)) == ["5", "7"]
    state, host = ck.restore(None, abstract_like(_small(0)))
  assert host == {"step": 8} and float(state["w"][0, 0]) == 8.0

  # A run whose only checkpoint was interrupted starts fresh.
  fresh = tmp_path / "fresh"
  os.makedirs(os.path.join(checkpoint_dir(str(fresh)), "3" + TMP))
  assert resolve_resume("auto", str(fresh)) is None


def test_in_flight_save_is_not_a_checkpoint(tmp_path, monkeypatch):
  # Hold an async save just before its rename; meanwhile neither this process nor a copy of the
  # directory (what a kill at this moment would leave) may see that step.
  ck_dir = str(tmp_path / "ck")
  entered, release = threading.Event(), threading.Event()
  rename = async_path.rename

  async def held_rename(*args, **kwargs):
    entered.set()
    await asyncio.to_thread(release.wait, 60)
    return await rename(*args, **kwargs)

  with Checkpointer(ck_dir) as ck:
    ck.save(5, _small(5), {"step": 5})
    ck.wait()
    monkeypatch.setattr(async_path, "rename", held_rename)
    try:
      assert ck.save(6, _small(6), {"step": 6})
      assert entered.wait(60)
      assert sorted(os.listdir(ck_dir)) == ["5", "6" + TMP]
      assert ck.latest_step() == 5 and ck.all_steps() == [5]
      shutil.copytree(ck_dir, str(tmp_path / "killed"))
    finally:
      release.set()
    ck.wait()
    assert ck.latest_step() == 6
  killed = Checkpointer(str(tmp_path / "killed"))
  assert killed.latest_step() == 5
  _, host = killed.restore(None, abstract_like(_small(0)))
  assert host == {"step": 5}
  killed.close()


def test_resolve_resume(tmp_path, monkeypatch):
  run = tmp_path / "run"
  assert resolve_resume("auto", str(run)) is None  # nothing there yet
  ck_dir = checkpoint_dir(str(run))
  assert ck_dir == str(run / "checkpoints")
  with Checkpointer(ck_dir, async_save=False) as ck:
    ck.save(4, _small(4), {})
  assert resolve_resume("none", str(run)) is None
  assert resolve_resume("auto", str(run)) == (ck_dir, None)
  assert resolve_resume(ck_dir, str(tmp_path / "other")) == (ck_dir, None)
  assert resolve_resume(str(run), str(tmp_path / "other")) == (ck_dir, None)  # a run directory
  assert resolve_resume(os.path.join(ck_dir, "4"), str(run)) == (ck_dir, 4)  # one step of it
  monkeypatch.chdir(tmp_path)
  assert resolve_resume("run/checkpoints", "elsewhere") == (ck_dir, None)  # made absolute

  missing = str(tmp_path / "nope")
  with pytest.raises(CheckpointError, match="nope"):
    resolve_resume(missing, str(run))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(CheckpointError, match="empty.*no complete checkpoint"):
    resolve_resume(str(tmp_path / "empty"), str(run))
  with pytest.raises(CheckpointError, match="'.*5' does not exist"):
    resolve_resume(os.path.join(ck_dir, "5"), str(run))
  with pytest.raises(CheckpointError, match="not a directory"):
    resolve_resume(os.path.join(ck_dir, "4", "_CHECKPOINT_METADATA"), str(run))


def test_numpy_rng_state_survives_json():
  rng = np.random.default_rng([7, 2])
  rng.normal(size=3)
  state = json.loads(json.dumps(numpy_rng_state(rng)))
  assert isinstance(state["state"], str)  # 128-bit ints as strings: exact in any JSON reader
  again = restore_numpy_rng(state)
  np.testing.assert_array_equal(again.integers(0, 10**9, 6), rng.integers(0, 10**9, 6))
  np.testing.assert_array_equal(again.normal(size=4), rng.normal(size=4))
  # A fresh generator of the same seed draws differently: the state, not the seed, was restored.
  assert not np.array_equal(restore_numpy_rng(state).random(4),
                            np.random.default_rng([7, 2]).random(4))
  with pytest.raises(ValueError, match="PCG64"):
    numpy_rng_state(np.random.Generator(np.random.MT19937(0)))


def test_bad_inputs_fail_before_writing(tmp_path):
  with Checkpointer(str(tmp_path / "ck")) as ck:
    with pytest.raises(ValueError, match=r"host\['ring'\] is a tuple"):
      ck.save(1, _small(1), {"ring": (1, 2)})
    with pytest.raises(ValueError, match="key 3 of type int"):
      ck.save(1, _small(1), {"by_id": {3: "x"}})
    with pytest.raises(ValueError, match=r"host\['n'\] is a int64"):
      ck.save(1, _small(1), {"n": np.int64(3)})
    assert ck.latest_step() is None and os.listdir(ck.directory) == []
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
      ck.restore(None, abstract_like(_small(0)))
  with pytest.raises(ValueError, match="no sharding"):
    abstract_like({"w": np.zeros(3)})
  with pytest.raises(ValueError, match="keep"):
    Checkpointer(str(tmp_path / "ck2"), keep=0)


def test_choose_step_skips_unusable_checkpoints(tmp_path):
  # Three steps; the newest is broken three ways in turn: truncated host JSON, a removed state
  # metadata file, an empty array data file. Each time the newest good step is chosen and the bad
  # one named in one line; a named bad step, or no good step at all, is an error.
  ck_dir = str(tmp_path / "ck")
  with Checkpointer(ck_dir, async_save=False, keep=3) as ck:
    for s in (1, 2, 3):
      ck.save(s, _small(s), {"step": s})
  said = []
  assert choose_step(ck_dir, say=said.append) == (3, {"step": 3}) and said == []
  host = os.path.join(ck_dir, "3", "host", "metadata")
  with open(host, "rb") as f:
    text = f.read()
  with open(host, "wb") as f:
    f.write(text[:len(text) // 2])
  assert step_problem(ck_dir, 3).startswith("host/metadata is unreadable (JSONDecodeError")
  assert choose_step(ck_dir, say=said.append) == (2, {"step": 2})
  assert said == [f"jaxrl: checkpoint {ck_dir}/3 is unusable ({step_problem(ck_dir, 3)}); "
                  "trying the one before it"]
  os.remove(os.path.join(ck_dir, "2", "state", "_METADATA"))
  assert step_problem(ck_dir, 2) == "state/_METADATA is missing"
  assert choose_step(ck_dir, say=said.append)[0] == 1
  data = os.path.join(ck_dir, "1", "state", "d")
  open(os.path.join(data, os.listdir(data)[0]), "wb").close()
  assert step_problem(ck_dir, 1).endswith("is empty")
  with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*ck \(steps \[1, 2, 3\]\)"):
    choose_step(ck_dir, say=said.append)
  with pytest.raises(CheckpointError, match=r"ck/2 is unusable: state/_METADATA is missing"):
    choose_step(ck_dir, 2)
  with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 in"):
    choose_step(ck_dir, 7)


def test_truncated_array_data_is_a_checkpoint_error(tmp_path):
  ck_dir = str(tmp_path / "ck")
  with Checkpointer(ck_dir, async_save=False) as ck:
    ck.save(1, _small(1), {"step": 1})
  data = os.path.join(ck_dir, "1", "state", "d")
  for name in os.listdir(data):
    path = os.path.join(data, name)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  assert step_problem(ck_dir, 1) is None  # only reading the arrays finds it
  with Checkpointer(ck_dir, read_only=True) as ck:
    with pytest.raises(CheckpointError, match=r"checkpoint .*ck/1 is unreadable: ") as info:
      ck.restore(1, abstract_like(_small(0)))
  assert info.value.step == 1 and "\n" not in str(info.value)
