"""The warm-up cache (`jaxrl.run.warmup`, `sft.cache`): where it lives, what its key covers, that
an entry round-trips exactly and a bad one is a miss, and that a second run loads the warm-up and
then runs exactly the run it would have run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.run import driver
from jaxrl.run import warmup as warmup_cache
from jaxrl.recipes.default import get_config
from jaxrl.envs.arithmetic import Problem
from test_profiling import tiny_cfg


def test_cache_directory_is_resolved_from_the_setting():
  home = os.path.expanduser("~")
  assert warmup_cache.resolve("") is None
  assert warmup_cache.resolve("/x/y") == "/x/y"
  assert warmup_cache.resolve("~/w") == os.path.join(home, "w")
  assert warmup_cache.resolve("auto", {"JAXRL_WARMUP_CACHE_DIR": "/ci/w"}) == "/ci/w"
  assert warmup_cache.resolve("auto", {"JAXRL_WARMUP_CACHE_DIR": ""}) is None  # set, empty: off
  assert warmup_cache.resolve("auto", {"XDG_CACHE_HOME": "/xdg"}) == "/xdg/jaxrl/warmup"
  assert warmup_cache.resolve("auto", {}) == os.path.join(home, ".cache", "jaxrl", "warmup")


class _Task:
  def __init__(self, dev):
    self.dev = dev

  def split(self, name):
    assert name == "dev"
    return self.dev


def _key(cfg, dev=("1+2=", "3"), batch=None, env=None):
  batch = batch if batch is not None else (np.arange(6, dtype=np.int32).reshape(2, 3), None)
  task = _Task([Problem(*dev)])
  return warmup_cache.fingerprint(cfg, task, batch, env=env or {"XLA_FLAGS": ""})[0]


def test_key_ignores_rl_keys_and_follows_everything_the_warm_up_reads():
  base = _key(get_config())
  assert _key(get_config()) == base  # deterministic (a None field hashes by value, not address)

  def changed(section, key, value):
    cfg = get_config()
    cfg[section][key] = value
    return _key(cfg)

  # The RL phase's keys share one warm-up ...
  assert changed("train", "learning_rate", 1e-4) == base
  assert changed("loss", "policy", "gspo") == base
  assert changed("rollout", "lag", 2) == base
  assert changed("checkpoint", "every", 7) == base
  # ... what the warm-up reads does not.
  assert changed("sft", "learning_rate", 5e-4) != base
  assert changed("sft", "stop_accuracy", 0.5) != base
  assert changed("model", "d_model", 32) != base
  assert changed("train", "adam_eps", 1e-6) != base  # the warm-up's optimiser uses it
  assert changed("rollout", "max_new_tokens", 5) != base
  cfg = get_config()
  cfg.seed = 1
  assert _key(cfg) != base
  assert _key(get_config(), dev=("1+2=", "4")) != base  # the dev split
  other = (np.arange(6, dtype=np.int32).reshape(2, 3) + 1, None)
  assert _key(get_config(), batch=other) != base  # the demonstrations
  flags = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}
  assert _key(get_config(), env=flags) != base  # the instruction set


def _tree():
  return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
          "layers": [{"b": np.asarray([1.5, -2.25], ml_dtypes.bfloat16)},
                     {"n": np.asarray([3, 4], np.int32)}]}


def test_entry_round_trips_exactly_and_a_mismatch_is_a_miss(tmp_path):
  host = _tree()
  rows = [{"phase": "sft", "step": 1, "sft/loss": 0.125}]
  summary = {"sft/steps": 1, "sft/dev_accuracy": 0.5, "sft/time_s": 2.0}
  path = warmup_cache.store(str(tmp_path), "k1", host, rows, summary, {"why": "test"})
  assert path == str(tmp_path / "k1")
  template = jax.tree.map(jax.numpy.asarray, _tree())
  arrays, got_rows, got_summary = warmup_cache.load(str(tmp_path), "k1", template)
  for a, b in zip(arrays, jax.tree.leaves(host)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))  # bit for bit
  assert got_rows == rows and got_summary == summary
  placed = warmup_cache.place(arrays, template)
  assert jax.tree.structure(placed) == jax.tree.structure(template)
  assert warmup_cache.load(str(tmp_path), "absent", template) is None
  wrong = jax.tree.map(jax.numpy.asarray, _tree())
  wrong["w"] = jax.numpy.zeros((4, 3), jax.numpy.float32)  # another shape: a miss, removed
  assert warmup_cache.load(str(tmp_path), "k1", wrong) is None
  assert not (tmp_path / "k1").exists()
  for broken in (b"not a zip", b"PK\x03\x04 truncated"):
    warmup_cache.store(str(tmp_path), "k1", host, rows, summary, {})
    with open(tmp_path / "k1" / "params.npz", "wb") as f:
      f.write(broken)  # an unreadable entry: a miss, not an error, and removed ...
    assert warmup_cache.load(str(tmp_path), "k1", template) is None
    assert not (tmp_path / "k1").exists()
  # ... so that the run stores a good one in its place.
  assert warmup_cache.store(str(tmp_path), "k1", host, rows, summary, {})
  assert warmup_cache.load(str(tmp_path), "k1", template) is not None


def test_cache_keeps_the_newest_entries_and_no_stale_temporary_ones(tmp_path):
  for i in range(warmup_cache.KEEP + 3):
    assert warmup_cache.store(str(tmp_path), f"k{i}", _tree(), [], {}, {})
    os.utime(tmp_path / f"k{i}", (1000 + i, 1000 + i))
  # Temporary entries of writers that died: an old one is removed, a fresh one (a writer still
  # at work) is not.
  (tmp_path / ".k9-old").mkdir()
  (tmp_path / ".k9-new").mkdir()
  now = os.path.getmtime(tmp_path / ".k9-new")
  os.utime(tmp_path / ".k9-old", (now - warmup_cache.STALE_TMP_S - 1,) * 2)
  warmup_cache.prune(str(tmp_path), now=now)
  left = sorted(os.listdir(tmp_path))
  assert ".k9-new" in left and ".k9-old" not in left
  left = sorted((d for d in left if not d.startswith(".")), key=lambda d: int(d[1:]))
  assert left == [f"k{i}" for i in range(3, warmup_cache.KEEP + 3)]


def test_unusable_cache_directory_is_a_config_error(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  cfg = get_config()
  cfg.sft.cache = str(a_file / "cache")
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(cfg, jax.device_count())
  assert info.value.problems == [
      f"config.sft.cache: {a_file} is not a directory; give a writable directory, \"auto\" or "
      "\"\" (no warm-up cache)"]


def _cfg(run_dir, cache):
  """`test_profiling.tiny_cfg`'s run with a 6-step warm-up (it never reaches its accuracy)."""
  cfg = tiny_cfg(run_dir, train__steps=2)
  cfg.sft.enabled = True
  cfg.sft.max_steps, cfg.sft.eval_every, cfg.sft.batch_size = 6, 3, 32
  cfg.sft.stop_accuracy = 1.0
  cfg.sft.cache = cache
  return cfg


TIMING = ("perf/", "pipeline/", "val/time_s", "val/trainer_wait_s", "sft/time_s", "rl/time_s",
          "total_time_s", "sft/from_cache")


def _rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


# Two whole runs (~90 s on 2 cores): in the slow step, which CI runs, so the default suite stays
# within its 10 minutes.
@pytest.mark.slow
def test_second_run_loads_the_warm_up_and_runs_the_same_run(tmp_path, capsys):
  cache = str(tmp_path / "cache")
  first = _cfg(tmp_path / "a", cache)
  s1 = driver.run(first, first.run_dir, config_lib.validate(first, jax.device_count()))
  assert "warm-up: cached in" in capsys.readouterr().out
  assert len(os.listdir(cache)) == 1 and "sft/from_cache" not in s1
  second = _cfg(tmp_path / "b", cache)
  s2 = driver.run(second, second.run_dir, config_lib.validate(second, jax.device_count()))
  out = capsys.readouterr().out
  assert "warm-up: loaded from the warm-up cache" in out and "warm-up: 6 steps" not in out
  assert s2["sft/from_cache"] == 1.0 and s2["sft/steps"] == s1["sft/steps"] == 6
  a, b = _rows(first.run_dir), _rows(second.run_dir)
  assert [r["phase"] for r in a].count("sft") == 6 and [r["phase"] for r in a].count("rl") == 2
  assert a == b  # the warm-up's rows replayed, then the same RL metrics to the last bit
  assert len(os.listdir(cache)) == 1


@pytest.mark.slow
def test_rl_keys_share_a_warm_up_and_the_cache_off_recomputes_it(tmp_path, capsys):
  cache = str(tmp_path / "cache")
  first = _cfg(tmp_path / "a", cache)
  driver.run(first, first.run_dir, config_lib.validate(first, jax.device_count()))
  assert "warm-up: cached in" in capsys.readouterr().out
  # An RL key differs: the same warm-up, loaded.
  second = _cfg(tmp_path / "b", cache)
  second.train.learning_rate = 1e-3
  s2 = driver.run(second, second.run_dir, config_lib.validate(second, jax.device_count()))
  assert "warm-up: loaded from the warm-up cache" in capsys.readouterr().out
  assert s2["sft/from_cache"] == 1.0 and len(os.listdir(cache)) == 1
  a, b = _rows(first.run_dir), _rows(second.run_dir)
  sft = [r for r in a if r["phase"] == "sft"]
  assert len(sft) == 6 and sft == [r for r in b if r["phase"] == "sft"]
  # That run with the cache off: the warm-up runs, and every row, the RL phase's included, is
  # the loaded run's to the last bit.
  third = _cfg(tmp_path / "c", "")
  third.train.learning_rate = 1e-3
  s3 = driver.run(third, third.run_dir, config_lib.validate(third, jax.device_count()))
  assert "warm-up: 6 steps" in capsys.readouterr().out and "sft/from_cache" not in s3
  c = _rows(third.run_dir)
  assert [r["phase"] for r in c].count("rl") == 2 and c == b
  # A warm-up key differs: a miss, a second entry.
  fourth = _cfg(tmp_path / "d", cache)
  fourth.sft.learning_rate = 2e-3
  driver.run(fourth, fourth.run_dir, config_lib.validate(fourth, jax.device_count()))
  assert "warm-up: cached in" in capsys.readouterr().out
  assert len(os.listdir(cache)) == 2


TWO_PROCESSES = r"""
import io, json, os, shutil, sys
import jax
import numpy as np
from jaxrl.parallel import distributed
distributed.join("", 1, 0, 60, auto=True, env=os.environ)
from jaxrl import config as config_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import driver
from jaxrl.run import warmup as warmup_lib
from jaxrl.recipes.default import get_config
from jaxrl.run.parts import build_parts

cfg = get_config()
cfg.model.d_model, cfg.model.head_dim, cfg.model.mlp_dim = 32, 16, 64
cfg.sft.max_steps, cfg.sft.eval_every, cfg.sft.batch_size, cfg.sft.stop_accuracy = 4, 2, 32, 1.0
cfg.task.dev_size = cfg.task.val_size = cfg.val.batch_size = 16
cfg.mesh.fsdp = -1  # parameters split over both processes' devices
# Each process its own cache directory, as on hosts with their own disks.
cfg.sft.cache = os.path.join(sys.argv[1], f"cache{jax.process_index()}")
mesh = config_lib.validate(cfg, jax.device_count(), num_processes=jax.process_count())
parts, params = build_parts(cfg, mesh)
whole = lambda p: [np.asarray(x) for x in jax.tree.leaves(distributed.fetch(p))]
text = io.StringIO()
progress = metrics_lib.Progress(stream=text)
out = metrics_lib.MetricsWriter(None)
first, s1 = warmup_lib.warmup(parts, params, out, progress)
second, s2 = warmup_lib.warmup(parts, params, out, progress)
same = all(np.array_equal(a, b) for a, b in zip(whole(first), whole(second)))
# One process loses its entry: both warm up again (a hit needs every process's).
if jax.process_index() == 1:
  shutil.rmtree(cfg.sft.cache)
third, s3 = warmup_lib.warmup(parts, params, out, progress)
print("RESULT " + json.dumps({"same": same, "s1": s1, "s2": s2, "s3": s3,
                              "split": not jax.tree.leaves(first)[0].is_fully_addressable,
                              "log": text.getvalue()}), flush=True)
"""


@pytest.mark.slow
def test_two_processes_load_the_warm_up_together_or_not_at_all(tmp_path):
  from processes import communicate, free_port
  from test_distributed import _torchrun_env

  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(tmp_path)],
                            env=_torchrun_env(i, port), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = communicate(procs, 600)
  for rank, out in enumerate(outs):
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["split"], rank  # the parameters really are split across the processes
    assert got["same"], rank  # loaded == computed, bit for bit, on every process
    assert "sft/from_cache" not in got["s1"] and got["s2"]["sft/from_cache"] == 1.0
    assert "sft/from_cache" not in got["s3"]  # one process's miss is everyone's
    assert got["s1"]["sft/steps"] == got["s2"]["sft/steps"] == got["s3"]["sft/steps"] == 4
    assert os.listdir(tmp_path / f"cache{rank}")  # each process stored its own copy
  log = json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))[7:])["log"]
  assert log.count("warm-up: cached in") == 2 and log.count("loaded from the warm-up cache") == 1
