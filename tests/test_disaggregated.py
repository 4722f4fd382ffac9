"""Disaggregated rollout and train meshes (`mesh.rollout`, `mesh.train`, `mesh.rollout_tensor`).

The config resolves disjoint device sets; the sampler (static and continuous) run on the rollout
mesh with params resharded there samples exactly the tokens of a colocated run for the same keys;
and a whole run with 4 rollout + 4 train devices at lag 1 gives the per-step metrics of the
colocated run on 4 devices with staleness exactly `min(step - 1, 1)` (slow step).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.data import left_pad
from jaxrl.run.parts import build_parts
from jaxrl.config import ConfigError, MeshShape
from jaxrl.recipes.default import get_config


def _cfg(**mesh):
  cfg = get_config()
  cfg.task.num_digits, cfg.task.dev_size, cfg.task.val_size = 1, 16, 32
  for k, v in mesh.items():
    cfg.mesh[k] = v
  return cfg


@pytest.mark.parametrize("mesh, expected", [
    ({"rollout": 4, "data": 4}, MeshShape(4, 1, 1, 4, 4, 1)),
    ({"rollout": 0.25, "train": 0.5, "data": -1}, MeshShape(4, 1, 1, 4, 2, 1)),  # fractions
    ({"rollout": 4, "train": 2, "fsdp": 2}, MeshShape(1, 2, 1, 2, 4, 1)),  # 2 devices left idle
    ({"rollout": 4, "rollout_tensor": 2, "fsdp": -1}, MeshShape(1, 4, 1, 4, 4, 2)),
    ({}, MeshShape(1, 1, 1)),  # colocated: the default
])
def test_device_split_resolves(mesh, expected):
  got = config_lib.validate(_cfg(**mesh), 8)
  assert got == expected
  if got.disaggregated:
    assert got.size <= got.train_devices and got.train_devices + got.rollout_devices <= 8
    assert math.prod(got.rollout_shape) == got.rollout_devices


@pytest.mark.parametrize("mesh, key, message", [
    ({"rollout": 4, "train": 6}, "config.mesh.rollout", "need 10 disjoint devices, but 8"),
    ({"rollout": 0.01}, "config.mesh.rollout", "0.01 of 8 devices is no device"),
    ({"rollout": 2.5}, "config.mesh.rollout", "a whole number of devices, got 2.5"),
    ({"rollout": -1.0}, "config.mesh.rollout", "got -1.0"),
    ({"train": 4}, "config.mesh.train", "only with config.mesh.rollout > 0"),
    ({"rollout_tensor": 2}, "config.mesh.rollout_tensor",
     "only with config.mesh.rollout > 0 or several processes"),
    ({"rollout": 4, "rollout_tensor": 3}, "config.mesh.rollout_tensor",
     "must divide the 4 rollout devices, got 3"),
    ({"rollout": 4, "data": 8}, "config.mesh", "does not divide the 4 train devices"),
    ({"rollout": 8}, "config.mesh.rollout", "need 8 disjoint devices"),  # no train device left
])
def test_bad_device_split_is_named(mesh, key, message):
  with pytest.raises(ConfigError) as e:
    config_lib.validate(_cfg(**mesh), 8)
  line = next(p for p in e.value.problems if p.startswith(key))
  assert message in line, e.value.problems


def test_rollout_tensor_on_several_processes_splits_each_process():
  """Colocated on several processes, `mesh.rollout_tensor` is each process's own rollout mesh's
  'tensor' axis: it must divide a process's devices (not the 8 of the run)."""
  got = config_lib.validate(_cfg(rollout_tensor=2, data=-1), 8, num_processes=2)
  assert got == MeshShape(8, 1, 1, rollout_tensor=2) and not got.disaggregated
  with pytest.raises(ConfigError) as e:
    config_lib.validate(_cfg(rollout_tensor=8, data=-1), 8, num_processes=2)
  assert any(p.startswith("config.mesh.rollout_tensor: must divide each process's 4 devices")
             for p in e.value.problems), e.value.problems


def test_rollout_processes_resolve_to_whole_processes():
  """`mesh.rollout_processes`: those processes' devices generate, the others' train."""
  got = config_lib.validate(_cfg(rollout_processes="0", data=-1), 8, num_processes=2)
  assert got == MeshShape(4, 1, 1, 4, 4, 1, (0,)) and got.disaggregated
  got = config_lib.validate(_cfg(rollout_processes="1", rollout_tensor=2, data=-1), 8,
                            num_processes=2)
  assert got.rollout_processes == (1,) and got.rollout_shape == (2, 1, 2)
  # Several rollout processes (4 x 2 devices): each generates on its own 2-device mesh.
  got = config_lib.validate(_cfg(rollout_processes="0,1", data=-1), 8, num_processes=4)
  assert got == MeshShape(4, 1, 1, 4, 4, 1, (0, 1)) and got.rollout_shape == (2, 1, 1)
  # Fewer rollout devices than the train mesh's (2 for 6): checkpoints fold the train mesh.
  cfg = _cfg(rollout_processes="0", data=-1)
  cfg.val.batch_size, cfg.sft.batch_size, cfg.rollout.num_prompts = 60, 96, 48
  got = config_lib.validate(cfg, 8, num_processes=4)
  assert got == MeshShape(6, 1, 1, 6, 2, 1, (0,))


@pytest.mark.parametrize("shape, devices, processes, folds", [
    ((8, 1, 1), 8, 1, (1, 1, 1)),  # as many rollout devices: no fold
    ((8, 1, 1), 4, 1, (2, 1, 1)),  # 8 train devices mirrored on 4: pairs of neighbours
    ((6, 1, 1), 2, 1, (3, 1, 1)),
    ((2, 2, 2), 3, 1, (2, 2, 1)),  # the largest fold within 3 is 2 devices; 'tensor' kept
    ((1, 4, 2), 4, 2, (1, 2, 1)),  # 'fsdp' folds before 'tensor'
    ((8, 1, 1), 3, 3, None),  # sizes 1, 2, 4, 8: none in [3, 3]
    ((2, 1, 1), 6, 3, None),  # a device of each of 3 rollout processes: more than 2
])
def test_checkpoint_folds(shape, devices, processes, folds):
  assert config_lib.mirror_folds(shape, devices, processes) == folds


@pytest.mark.parametrize("settings, processes, key, message", [
    ({"rollout_processes": "0"}, 1, "config.mesh.rollout_processes", "the run has one process"),
    ({"rollout_processes": "2"}, 2, "config.mesh.rollout_processes", "must be < the 2 processes"),
    ({"rollout_processes": "0,1"}, 2, "config.mesh.rollout_processes",
     "at least one process must train"),
    # 4 processes x 2 devices, 3 of them rollout processes: a train mesh of 2 devices cannot
    # give each a device in every checkpoint's layout; 128 prompts do not split over 3
    ({"rollout_processes": "0,1,2", "num_prompts": 6}, 4, "config.mesh.rollout_processes",
     "no checkpoint layout: the train mesh (2x1x1) folded to a size in [3, 6]"),
    ({"rollout_processes": "0,1,2"}, 4, "config.rollout.num_prompts",
     "must split evenly over the 3 rollout processes"),
    # 2 processes x 4 devices: 3 prompts x 2 = 6 rows over the rollout process's 4 row shards
    ({"rollout_processes": "0", "num_prompts": 3, "group_size": 2}, 2,
     "config.rollout.num_prompts", "must split evenly over its 4 row shards"),
    ({"rollout_processes": "0,0"}, 2, "config.mesh.rollout_processes", "distinct process"),
    ({"rollout_processes": "a"}, 2, "config.mesh.rollout_processes", "got 'a'"),
    ({"rollout_processes": "0", "rollout": 2}, 2, "config.mesh.rollout", "must be 0 with"),
    ({"rollout_processes": "0", "rollout_tensor": 3}, 2, "config.mesh.rollout_tensor",
     "must divide the rollout process's 4 devices"),
    ({"rollout_processes": "0", "resume": "other/checkpoints/4"}, 2, "config.resume",
     "resumes from its own checkpoints only"),
])
def test_bad_rollout_processes_are_named(settings, processes, key, message, tmp_path):
  settings = dict(settings)
  cfg = _cfg(data=-1)
  cfg.mesh.rollout_processes = settings.pop("rollout_processes")
  if "resume" in settings:  # another run's checkpoint step, which exists
    (tmp_path / settings["resume"]).mkdir(parents=True)
    cfg.run_dir, cfg.resume = str(tmp_path / "mine"), str(tmp_path / settings.pop("resume"))
  for k in ("num_prompts", "group_size"):
    if k in settings:
      cfg.rollout[k] = settings.pop(k)
  for k, v in settings.items():
    cfg.mesh[k] = v
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 8, num_processes=processes)
  line = next((p for p in e.value.problems if p.startswith(key)), None)
  assert line is not None and message in line, e.value.problems


def _parts(engine="static", **mesh):
  cfg = _cfg(**mesh)
  cfg.rollout.engine = engine
  cfg.rollout.num_prompts, cfg.rollout.group_size = 4, 4
  return build_parts(cfg, config_lib.validate(cfg, 8))


def _devices(x) -> set[int]:
  return {d.id for d in x.sharding.device_set}


# Two samplers compiled per engine, on two meshes: the slow step (fast-suite time budget).
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_rollout_mesh_samples_the_colocated_tokens(engine):
  """Same init params and keys: 4 rollout devices (after a reshard from the 4-device train
  mesh) and a colocated 4-device mesh sample identical tokens; the sampled arrays live on the
  rollout devices only, and the train params stay where they were."""
  colocated, colocated_params = _parts(engine, data=4)
  split, split_params = _parts(engine, data=4, rollout=4)
  assert _devices(jax.tree.leaves(split_params)[0]) == {0, 1, 2, 3}
  rollout_params = split.for_rollout(split_params)
  assert {d for x in jax.tree.leaves(rollout_params) for d in _devices(x)} == {4, 5, 6, 7}
  assert split.for_rollout(rollout_params) is rollout_params  # already there: no copy
  for a, b in zip(jax.tree.leaves(colocated_params), jax.tree.leaves(rollout_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  tasks = colocated.source.split("val")[:4]
  prompts, valid = left_pad([colocated.tok.encode_prompt(t.prompt) for t in tasks],
                            colocated.cfg.rollout.max_prompt_len, colocated.tok.pad_id)
  ids = np.arange(16, dtype=np.int32)
  outs = []
  for parts, params in ((colocated, colocated_params), (split, rollout_params)):
    sample = parts.train_loop().sample_first  # the training sampler, rows over the rollout mesh
    outs.append(sample(params, prompts, valid, jax.random.key(3), ids, 1.0))
  if engine == "static":
    assert _devices(outs[1].tokens) == {4, 5, 6, 7}
  a, b = (jax.tree.map(np.asarray, o) for o in outs)
  assert a.mask.sum() > 16  # rows generated more than one token each, on average
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.mask, b.mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_rollout_mesh_samples_the_same_tokens():
  """A (2, 1, 2) rollout mesh (tensor-parallel params, rows over 'data') against a colocated
  train mesh with fsdp: the same greedy tokens, log-probs within 1e-5."""
  colocated, colocated_params = _parts(fsdp=4)
  split, split_params = _parts(fsdp=4, rollout=4, rollout_tensor=2)
  params = split.for_rollout(split_params)
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(params)}
  assert any("tensor" in s for s in specs), specs  # something is split over 'tensor'
  tasks = colocated.source.split("val")[:4]
  prompts, valid = left_pad([colocated.tok.encode_prompt(t.prompt) for t in tasks],
                            colocated.cfg.rollout.max_prompt_len, colocated.tok.pad_id)
  ids = np.arange(16, dtype=np.int32)
  a = jax.tree.map(np.asarray, colocated.train_loop().sample_first(
      colocated_params, prompts, valid, jax.random.key(5), ids, 0.0))
  b = jax.tree.map(np.asarray, split.train_loop().sample_first(
      params, prompts, valid, jax.random.key(5), ids, 0.0))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


# -- end to end (slow) ---------------------------------------------------------------------------

ARGS = ["--config.task.num_digits=1", "--config.rollout.num_prompts=32",
        "--config.task.dev_size=16", "--config.task.val_size=32",
        "--config.val.batch_size=32", "--config.sft.max_steps=20", "--config.sft.eval_every=10",
        "--config.sft.batch_size=64", "--config.train.steps=4", "--config.val.every=2",
        "--config.rollout.lag=1", "--config.mesh.data=4"]
# Wall-clock and pipeline-occupancy metrics depend on thread timing, not on what was computed.
TIMING = ("perf/", "pipeline/", "val/time_s", "val/trainer_wait_s", "sft/time_s", "rl/time_s",
          "total_time_s", "data_plane/train_rows")


def _run(run_dir, extra=()):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.Popen([sys.executable, "-m", "jaxrl.train", *ARGS,
                           f"--config.run_dir={run_dir}", *extra], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return sorted(rows, key=lambda r: (r["phase"], r.get("step", -1)))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[]], ids=["full"])
def test_disaggregated_run_matches_colocated_with_exact_staleness(tmp_path, extra):
  procs = {"colocated": _run(tmp_path / "colocated", extra),
           "split": _run(tmp_path / "split", ["--config.mesh.rollout=4", *extra])}
  outs = {}
  for name, p in procs.items():
    try:
      outs[name], _ = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      p.kill()
      raise AssertionError(f"{name} run timed out:\n{p.communicate()[0]}")
    assert p.returncode == 0, outs[name]
  assert "rollouts on devices 4-7" in outs["split"]
  if extra:
    assert "LoRA rank 4" in outs["split"]
  base, split = _rows(tmp_path / "colocated"), _rows(tmp_path / "split")
  assert [(r["phase"], r.get("step")) for r in base] == [(r["phase"], r.get("step")) for r in split]
  rl = [r for r in split if r["phase"] == "rl"]
  assert len(rl) == 4
  for r in rl:  # forced lag 1: exactly min(step - 1, 1) versions behind, every token
    want = min(r["step"] - 1, 1)
    assert r["consume_version"] - r["submit_version"] == want
    for kind in ("first_token", "last_token", "token_mean"):
      assert r[f"staleness/{kind}/min"] == r[f"staleness/{kind}/max"] == want, r
  assert any(r["reward/mixed_groups"] > 0 for r in rl)  # the policy really learned something
  compared = 0
  for a, b in zip(base, split):
    for k, v in a.items():
      if k.startswith(TIMING) or not isinstance(v, (int, float)) or isinstance(v, bool):
        continue
      # Same train mesh shape, same rollout computation, same keys: the same tokens and rewards,
      # so the same losses; log-prob arithmetic on other devices may differ in the last bits.
      assert math.isclose(v, b[k], rel_tol=1e-5, abs_tol=1e-5), (a["phase"], a.get("step"), k,
                                                                 v, b[k])
      compared += 1
  assert compared > 200
