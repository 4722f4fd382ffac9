"""Array digests of checkpoints: a byte damaged after the save is never restored silently.

A checkpoint's array files are zstd-compressed OCDBT data files (`state/ocdbt.process_0/d/*`).
A byte flipped in the middle of one mostly still decodes, to different values: before digests
the restore then succeeded and the run trained on them. Now every restore recomputes each
array's CRC-32 and refuses a step whose arrays differ from the ones saved.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.runtime import checkpoint, digest
from jaxrl.runtime.checkpoint import Checkpointer, UnreadableStep, abstract_like


def _state(seed: int = 0):
  k = jax.random.split(jax.random.key(seed), 4)
  return {"train": {"params": {"layers_0": {"q_proj": {"kernel": jax.random.normal(k[0], (64, 96))},
                                            "norm": {"scale": jax.random.normal(k[1], (96,))}},
                               "embed": jax.random.normal(k[2], (128, 64))},
                    "mu": {"embed": jax.random.normal(k[3], (128, 64))},
                    "step": jnp.int32(7)}}


PATHS = {"train/params/layers_0/q_proj/kernel", "train/params/layers_0/norm/scale",
         "train/params/embed", "train/mu/embed", "train/step"}


def _sharded(tree):
  """`tree` over a (4, 2) mesh of the 8 host devices (2-d arrays split on both axes)."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  spec = {0: PartitionSpec(), 1: PartitionSpec("b"), 2: PartitionSpec("a", "b")}
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec[x.ndim])), tree)


def _data_files(step_dir) -> list[str]:
  paths = sorted(glob.glob(os.path.join(str(step_dir), "state", "ocdbt.process_*", "d", "*")))
  assert paths
  return paths


def flip_middle_byte(path: str) -> None:
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0x10
    f.seek(0)
    f.write(bytes(data))


def _same(tree, expected) -> bool:
  return all(np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected)))


def test_a_flipped_byte_in_any_array_file_is_never_restored_silently(tmp_path):
  # Each data file in turn gets its middle byte flipped. The restore either raises
  # UnreadableStep (one line naming the step and the damaged array) or returns exactly the
  # saved values (a byte of an index node no array read needs); never other values. Without
  # digests, the flips inside the two large files restore silently to different values.
  state = _state()
  good = str(tmp_path / "good")
  with Checkpointer(good, async_save=True) as ck:
    ck.save(3, state, {"v": 1})
  caught = []
  for i in range(len(_data_files(tmp_path / "good" / "3"))):
    work = tmp_path / f"flip{i}"
    shutil.copytree(good, work)
    flip_middle_byte(_data_files(work / "3")[i])
    with Checkpointer(str(work)) as ck:
      try:
        restored, host = ck.restore(3, abstract_like(state))
      except UnreadableStep as e:
        message = str(e)
        assert e.step == 3 and "\n" not in message
        assert message.startswith(f"checkpoint {work}/3 is unreadable: "), message
        found = re.search(r"array (\S+) does not match its digest", message)
        if found:
          caught.append(found.group(1))
      else:
        assert _same(restored, state) and host == {"v": 1}, f"file {i} restored damaged values"
  # The damage the digests found (the two largest arrays fill the two large files; a decode
  # error would have been found before digests, so at least one must be a digest mismatch).
  assert caught and set(caught) <= PATHS, caught


def test_digests_do_not_depend_on_the_devices(tmp_path):
  # The same values saved on 1 device and over 8 (split on both axes) get the same digest file,
  # and a checkpoint written on 1 device verifies restored onto 8 (and back).
  state = _state()
  with Checkpointer(str(tmp_path / "one"), async_save=False) as ck:
    ck.save(1, state, {})
  with Checkpointer(str(tmp_path / "eight"), async_save=False) as ck:
    ck.save(1, _sharded(state), {})
  one = digest.read(str(tmp_path / "one" / "1"))
  assert one == digest.read(str(tmp_path / "eight" / "1"))
  assert set(one["arrays"]) == PATHS and one["algorithm"] == "crc32"
  # Orbax committed the mark with the step: a step without the file is damaged, not old.
  meta = json.loads((tmp_path / "one" / "1" / "_CHECKPOINT_METADATA").read_text())
  assert meta["custom_metadata"] == {digest.MARK: "crc32"}
  # The CRC of an array is zlib's over its C-order bytes.
  kernel = np.asarray(state["train"]["params"]["layers_0"]["q_proj"]["kernel"])
  assert one["arrays"]["train/params/layers_0/q_proj/kernel"] == zlib.crc32(kernel.tobytes())
  with Checkpointer(str(tmp_path / "one")) as ck:
    restored, _ = ck.restore(1, abstract_like(_sharded(state)))
  assert _same(restored, state)
  assert len(restored["train"]["mu"]["embed"].sharding.device_set) == 8
  with Checkpointer(str(tmp_path / "eight")) as ck:
    restored, _ = ck.restore(1, abstract_like(state))
  assert _same(restored, state)


def test_a_checkpoint_saved_without_digests_restores_with_one_line(tmp_path):
  # The format before digests: Orbax's two items and no digest mark in the step's metadata.
  state = _state()
  directory = str(tmp_path / "old")
  with ocp.CheckpointManager(directory, item_names=("state", "host")) as mngr:
    mngr.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         host=ocp.args.JsonSave({"v": 4})))
  assert checkpoint.step_problem(directory, 4) is None
  said = []
  with Checkpointer(directory, read_only=True, say=said.append) as ck:
    restored, host = ck.restore(4, abstract_like(state))
  assert _same(restored, state) and host == {"v": 4}
  assert said == [f"jaxrl: checkpoint {directory}/4 restored without verifying its array "
                  "digests (saved without them)"]


def test_a_finished_step_whose_digests_are_gone_is_unusable(tmp_path):
  # Its metadata says it was saved with digests: without the file it is damaged, not old.
  directory = str(tmp_path / "ck")
  with Checkpointer(directory, keep=3) as ck:
    ck.save(1, _state(1), {"v": 1})
    ck.save(2, _state(2), {"v": 2})
  shutil.rmtree(tmp_path / "ck" / "2" / "digest")
  assert checkpoint.step_problem(directory, 2) == "digest/metadata is missing"
  said = []
  assert checkpoint.choose_step(directory, say=said.append) == (1, {"v": 1})
  assert said == [f"jaxrl: checkpoint {directory}/2 is unusable (digest/metadata is missing); "
                  "trying the one before it"]
  (tmp_path / "ck" / "1" / "digest" / "metadata").write_text("{not json")
  assert checkpoint.step_problem(directory, 1).startswith("digest/metadata is unreadable")
  with Checkpointer(directory) as ck, pytest.raises(UnreadableStep, match="digest/metadata"):
    ck.restore(1, abstract_like(_state()))


def test_partial_restores_verify_what_they_read(tmp_path):
  # restore_params (evaluate, teachers) and restore_fields (export) hash the fields they read;
  # damage in the large file of one field is found there, named by its path.
  state = _state()
  directory = str(tmp_path / "ck")
  with Checkpointer(directory, async_save=False) as ck:
    ck.save(5, state, {})
  target = abstract_like(state["train"]["params"])
  with Checkpointer(directory, read_only=True) as ck:
    step, params = ck.restore_params(5, target)
    assert step == 5 and _same(params, state["train"]["params"])
  # Damage every large data file: whichever holds params, the params restore must see it.
  for path in _data_files(tmp_path / "ck" / "5"):
    if os.path.getsize(path) > 4096:
      flip_middle_byte(path)
  with Checkpointer(directory, read_only=True) as ck:
    with pytest.raises(UnreadableStep, match=r"array train/(mu|params)/\S+ does not match"):
      ck.restore_fields(5, {"params": target, "mu": abstract_like(state["train"]["mu"])})
    with pytest.raises(UnreadableStep, match=r"array train/params/\S+ does not match"):
      ck.restore_params(5, target)
