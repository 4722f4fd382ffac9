"""Rollouts overlapping training on several processes, colocated (`ProcessShare`).

Each process's rollout worker is a thread that makes its share of every batch (its groups, the
rows its devices hold in the train mesh) on its own devices; the trainer threads publish params
and assemble every batch in lockstep. Two processes x 4 simulated CPU devices at lag 1 must give
the per-step metrics of one process x 8 devices (<= 1e-5; timings and how far the worker had got
excepted), with first-token staleness exactly min(step - 1, 1), and the worker producing on its own
thread with params on its own process's devices only. (`test_parity` runs the whole
`python -m jaxrl.train` this way at lag 1, warm-up, validation, a checkpoint and only process 0
writing included.)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from processes import communicate, free_port
from test_distributed import _env

RUN = r"""
import json, os, sys, threading
import jax
from jaxrl.parallel import distributed
distributed.join("", 1, 0, 60, auto=True, env=os.environ)
from jaxrl import config as config_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import loop
from jaxrl.run.topology import Topology
from jaxrl.recipes.default import get_config
from jaxrl.run.parts import build_parts
from jaxrl.pipeline import producer as producer_lib

cfg = get_config()
for k, v in dict(d_model=32, head_dim=16, mlp_dim=64).items():
  setattr(cfg.model, k, v)
cfg.sft.enabled = False
cfg.train.steps = 4
cfg.rollout.lag = 1
cfg.rollout.num_prompts = 8
cfg.task.dev_size = cfg.task.val_size = cfg.val.batch_size = 16
cfg.val.at_start = cfg.val.at_end = False
cfg.val.every = 1000
cfg.mesh.data = -1
mesh = config_lib.validate(cfg, jax.device_count(), num_processes=jax.process_count())
parts, params = build_parts(cfg, mesh)
seen = []
produce = producer_lib.RolloutProducer.produce

def recording(self, batch_id, params, version):
  mine = set(jax.local_devices())
  local = all(x.is_fully_addressable and x.sharding.device_set <= mine
              for x in jax.tree.leaves(params))
  split = any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
  seen.append([threading.current_thread().name, local, split])
  return produce(self, batch_id, params, version)

producer_lib.RolloutProducer.produce = recording
out_dir = sys.argv[1] if jax.process_index() == 0 else None
out = metrics_lib.MetricsWriter(out_dir)
import io
loop.rl(parts, params, Topology.of(parts), loop.RunIO(out, metrics_lib.Progress(stream=io.StringIO())))
out.close()
print("SEEN " + json.dumps(seen), flush=True)
"""

SKIP = ("perf/", "pipeline/", "data_plane/train_rows", "val/trainer_wait_s")


def same_metrics(base: list[dict], rows: list[dict]) -> int:
  """How many numeric values of `base`'s rows `rows` repeat (<= 1e-5; timings and how far the
  rollout worker had got, `SKIP`, excepted); asserts they all do, row by row."""
  compared = 0
  for a, b in zip(base, rows, strict=True):
    for k, v in a.items():
      if k.startswith(SKIP) or not isinstance(v, (int, float)) or isinstance(v, bool):
        continue
      assert k in b, k
      assert math.isclose(v, b[k], rel_tol=1e-5, abs_tol=1e-5), (a["step"], k, v, b[k])
      compared += 1
  return compared


def _rows(path) -> list[dict]:
  with open(path / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if json.loads(line).get("phase") == "rl"]


def _seen(out: str) -> list:
  line = next(line for line in out.splitlines() if line.startswith("SEEN "))
  return json.loads(line[5:])


def one_and_two_processes(program: str, tmp_path, timeout: float = 600):
  """Runs `program` (python -c, its first argument the output directory) as 1 process x 8
  devices in `tmp_path/one`, then as 2 processes x 4 devices in `tmp_path/two` (gloo on
  127.0.0.1); returns (the single process's output, the two processes' outputs)."""
  one, two = tmp_path / "one", tmp_path / "two"
  one.mkdir()
  two.mkdir()
  base_out = subprocess.run([sys.executable, "-c", program, str(one)], env=_env(8),
                            capture_output=True, text=True, timeout=timeout)
  assert base_out.returncode == 0, base_out.stdout + base_out.stderr
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-c", program, str(two)],
      env=_env(4, WORLD_SIZE="2", RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  return base_out.stdout, communicate(procs, timeout)


# LoRA on two processes: each process's rollout copy gets the frozen base once and then each
# version's adapters (gathered to its own devices), merged there.
RUN_LORA = RUN.replace("cfg.mesh.data = -1\n", "cfg.mesh.data = -1\ncfg.model.lora.rank = 4\n"
                       "cfg.model.lora.learning_rate = 3e-3\n")
# Each process's rollout mesh tensor-parallel over its own devices: (2, 1, 2), params split over
# its 'tensor' axis (the one-process run keeps its colocated 8-device mesh).
RUN_TP = RUN.replace("mesh = config_lib.validate(", "if jax.process_count() > 1:\n"
                     "  cfg.mesh.rollout_tensor = 2\nmesh = config_lib.validate(")


@pytest.mark.slow
# (Plain params replicated on each process's devices: the LoRA case's base, and test_parity's
# two-process run; the CI time is spent on the cases that add a layout.)
@pytest.mark.parametrize("program", [RUN_LORA, RUN_TP], ids=["lora", "tensor"])
def test_two_processes_overlap_and_match_one_process(tmp_path, program):
  _, outs = one_and_two_processes(program, tmp_path)
  base, rows = _rows(tmp_path / "one"), _rows(tmp_path / "two")

  # The worker thread made every batch, with params on its own process's devices (split over
  # them with a rollout 'tensor' axis, whole on each device otherwise); 4 steps at lag 1 start
  # batches 0..4 (the ring holds one more than was pulled).
  for out in outs:
    seen = _seen(out)
    assert len(seen) == 5, out
    assert all(thread == "rollout-worker" and local and split == (program is RUN_TP)
               for thread, local, split in seen), seen

  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["consume_version"] - r["submit_version"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/first_token/min"] for r in rows] == [0, 1, 1, 1]
  assert same_metrics(base, rows) > 50


# Dynamic sampling on two processes: each process filters and regenerates its own groups on its
# rollout thread. The grader rewards a completion whose text hashes to 0 mod 4 (deterministic, so
# a random tiny model's groups sometimes have no spread and are dropped).
RUN_DS = RUN.replace("parts, params = build_parts(cfg, mesh)\n", '''import zlib
from jaxrl.envs.base import single_turn_result

class Hashed:
  name = "add"
  def step(self, turns):
    return single_turn_result([float(zlib.crc32(t.response.encode()) % 4 == 0) for t in turns])

cfg.dynamic_sampling.enabled = True
cfg.rollout.num_prompts = 16
parts, params = build_parts(cfg, mesh, envs={"add": Hashed()})
''')


@pytest.mark.slow
def test_two_processes_dynamic_sampling_overlaps_per_process(tmp_path):
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-c", RUN_DS, str(tmp_path)],
      env=_env(4, WORLD_SIZE="2", RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = communicate(procs, 600)
  rows = _rows(tmp_path)
  # Not made inline: every batch on each process's rollout thread, params on its own devices.
  for out in outs:
    seen = _seen(out)
    assert len(seen) == 5, out
    assert all(thread == "rollout-worker" and local for thread, local, _ in seen), seen
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/first_token/min"] for r in rows] == [0, 1, 1, 1]
  for r in rows:
    assert r["reward/mixed_groups"] == 1.0, r  # every trained group has reward spread
    assert 1 <= r["dynamic_sampling/num_gen_batches"] <= 10, r
    assert r["dynamic_sampling/discarded_valid_samples"] == 0, r
  # Some group was dropped and regenerated in its slot (P(no spread) = 0.75^8 = 0.10 per group,
  # 64 groups); the mean reward over every generated row then differs from the trained rows'.
  dropped = sum(r["dynamic_sampling/dropped_groups"] for r in rows)
  assert dropped >= 1, rows
  assert rows[-1]["pipeline/regenerated"] >= dropped > 0
  assert any(r["reward"] != r["filtered_reward"] for r in rows)
