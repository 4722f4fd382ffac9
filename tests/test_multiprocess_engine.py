"""The continuous engine on several processes, colocated, with partial rollouts.

Each process's rollout thread runs the engine's host driver over its own devices (the
process-local rollout mesh its params are published to): its slots split over that mesh's 'data'
axis, every array it reads its own. Two processes x 4 simulated CPU devices at lag 1 must give the
per-step metrics of one process x 8 devices (<= 1e-5; timings and how far the worker had got
excepted), rewards and token counts included, with first-token staleness exactly min(step - 1, 1).

Partial rollouts switch params between decode dispatches whenever the trainer has published a
newer version, which depends on timing; to compare two runs the test makes the switch
deterministic. The newest-params source of batches 1..3 (the ones trained on after the first)
switches after the batch's first decode dispatch (one step each), waiting there for the next
version, which the trainer publishes after the step that consumes the batch before. So every
row's first two tokens are one update stale and the rest are fresh (`staleness/last_token/min` is
0), the same tokens and versions on either process layout.
"""

from __future__ import annotations

import json
import math

import pytest

from test_multiprocess_rollouts import one_and_two_processes

RUN = r"""
import io, json, os, sys, threading, time
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
from jaxrl.rollout import samplers, scheduler

STEPS = 4
cfg = get_config()
for k, v in dict(d_model=32, head_dim=16, mlp_dim=64).items():
  setattr(cfg.model, k, v)
cfg.sft.enabled = False
cfg.train.steps = STEPS
cfg.rollout.lag = 1
cfg.rollout.num_prompts = 8
cfg.rollout.engine = "continuous"
cfg.rollout.partial_rollouts = True
cfg.rollout.engine_steps = 1  # one token per dispatch: a batch spans several dispatches
cfg.task.dev_size = cfg.task.val_size = cfg.val.batch_size = 16
cfg.val.at_start = False
cfg.val.at_end = True  # several processes: evaluation runs inline on the global params
cfg.val.every = 1000
cfg.mesh.data = -1
mesh = config_lib.validate(cfg, jax.device_count(), num_processes=jax.process_count())
parts, params = build_parts(cfg, mesh)
seen, engines, switches = [], [], []
batch = [None]
produce = producer_lib.RolloutProducer.produce

def recording(self, batch_id, params, version):
  mine = set(jax.local_devices())
  local = all(x.is_fully_addressable and x.sharding.device_set <= mine
              for x in jax.tree.leaves(params))
  seen.append([threading.current_thread().name, local])
  batch[0] = batch_id
  return produce(self, batch_id, params, version)

def gated(newest, version, params):
  calls, b = [], batch[0]

  def source():
    calls.append(1)
    if threading.current_thread().name != "rollout-worker" or not 1 <= b < STEPS \
        or len(calls) < 2:
      return version, params
    if len(calls) == 2:
      deadline = time.monotonic() + 300
      while (newest() or (-1, None))[0] <= version:
        assert time.monotonic() < deadline, f"batch {b}: no params newer than {version}"
        time.sleep(0.01)
      switches.append([b, version, newest()[0]])
    return newest()

  return source

scheduler_run = scheduler.Scheduler.run

def placed(self):
  devices = set().union(*(x.sharding.device_set for x in jax.tree.leaves(self.state)))
  engines.append([threading.current_thread().name,
                  sorted({d.process_index for d in devices}), len(devices)])
  return scheduler_run(self)

producer_lib.RolloutProducer.produce = recording
samplers.partial_source = gated
scheduler.Scheduler.run = placed
out_dir = sys.argv[1] if jax.process_index() == 0 else None
out = metrics_lib.MetricsWriter(out_dir)
loop.rl(parts, params, Topology.of(parts), loop.RunIO(out, metrics_lib.Progress(stream=io.StringIO())))
out.close()
print("SEEN " + json.dumps({"produce": seen, "engines": engines, "switches": switches,
                           "process": jax.process_index(),
                           "local_devices": jax.local_device_count()}), flush=True)
"""

SKIP = ("perf/", "pipeline/", "data_plane/train_rows", "val/trainer_wait_s", "val/time_s")


def _rows(path, phase="rl") -> list[dict]:
  with open(path / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if json.loads(line).get("phase") == phase]


def _seen(out: str) -> dict:
  line = next(line for line in out.splitlines() if line.startswith("SEEN "))
  return json.loads(line[5:])


def _compare(base: list[dict], rows: list[dict]) -> set:
  """Asserts every numeric metric of `base` is in `rows`, step by step, within 1e-5; returns the
  keys compared."""
  compared = set()
  assert len(base) == len(rows)
  for a, b in zip(base, rows):
    for k, v in a.items():
      if k.startswith(SKIP) or not isinstance(v, (int, float)) or isinstance(v, bool):
        continue
      assert k in b, k
      assert math.isclose(v, b[k], rel_tol=1e-5, abs_tol=1e-5), (a["step"], k, v, b[k])
      compared.add(k)
  return compared


def _check_run(outs: list[str], processes: int) -> None:
  """The worker thread made every batch on its own process's devices, and the engine ran there
  (its decode state on every one of them, no other process's), switching params mid-batch."""
  for out in outs:
    seen = _seen(out)
    # 4 steps at lag 1 start batches 0..4 (the ring holds one more than was pulled).
    assert len(seen["produce"]) == 5, out
    assert all(thread == "rollout-worker" and local for thread, local in seen["produce"]), seen
    train = [e for e in seen["engines"] if e[0] == "rollout-worker"]
    assert len(train) == 5, seen["engines"]
    assert all(e[1:] == [[seen["process"]], 8 // processes] for e in train), train
    assert seen["local_devices"] == 8 // processes
    assert sorted(s[0] for s in seen["switches"]) == [1, 2, 3], seen["switches"]
    assert all(new == old + 1 for _, old, new in seen["switches"]), seen["switches"]


@pytest.mark.slow
def test_two_processes_run_the_engine_like_one_process(tmp_path):
  base_out, outs = one_and_two_processes(RUN, tmp_path, timeout=900)
  _check_run([base_out], 1)
  _check_run(outs, 2)
  one, two = tmp_path / "one", tmp_path / "two"
  base, rows = _rows(one), _rows(two)

  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["consume_version"] - r["submit_version"] for r in rows] == [0, 1, 1, 1]
  # (a) The forced lag holds for every row's first token ...
  assert [r["staleness/first_token/max"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/first_token/min"] for r in rows] == [0, 1, 1, 1]
  # ... and partial rollouts happened: rows of steps 2..4 end on the params of the step before
  # (tokens of two versions in one row, each stamped with its own).
  assert [r["staleness/last_token/min"] for r in rows] == [0, 0, 0, 0]
  assert all(0 < r["staleness/token_mean/mean"] < 1 for r in rows[1:]), rows
  # (b) The same per-step metrics as one process: the same tokens, rewards and updates.
  compared = _compare(base, rows)
  assert {"reward", "completion_len", "loss", "grad_norm",
          "staleness/last_token/mean"} <= compared, sorted(compared)
  assert len(compared) > 40  # distinct keys, each on every step
  # Evaluation (inline on the global params, static sampler there): the same as one process.
  assert len(_compare(_rows(one, "val"), _rows(two, "val"))) > 3
