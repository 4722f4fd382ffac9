"""The trainer on the environment layer: a multi-turn task trains end to end with lag 1, and an
environment that raises or stalls fails only its rows (re-sampled into their slots), with the
reasons in the metrics; the run never hangs."""

from __future__ import annotations

import io
import json
import threading
import time

import jax
import pytest

from jaxrl import config as config_lib

from jaxrl.observe import metrics as metrics_lib

from jaxrl.run import loop
from jaxrl.run.topology import Topology
from jaxrl.envs import make_env
from jaxrl.run.parts import build_parts

from test_bad_input import _tiny_cfg
from test_cli import _rl_rows, _tiny, _train


@pytest.mark.slow
def test_multi_turn_guess_trains_with_lag_one(tmp_path):
  # Guess (multi-turn) mixed per row with add (single turn), 3:1.
  run_dir = tmp_path / "out"
  args = _tiny(0, 6, 3, "--config.sft.enabled=false", "--config.task.name=guess+add",
               "--config.task.weights=3,1",
               "--config.rollout.lag=1", "--config.rollout.max_turns=4",
               "--config.rollout.max_prompt_len=32", "--config.rollout.max_total_tokens=48",
               "--config.val.batch_size=16", f"--config.run_dir={run_dir}")
  proc = _train(args, tmp_path, {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rl = _rl_rows(run_dir)
  assert [r["batch_id"] for r in rl] == list(range(6))
  for r in rl:
    assert r["staleness/first_token/max"] == r["staleness/first_token/min"] == min(r["batch_id"], 1)
    # Every episode ends one way; a random policy rarely finds the secret in 4 turns.
    ends = r["env/terminated_frac"] + r["env/truncated_frac"] + r["env/failed_frac"]
    assert abs(ends - 1.0) < 1e-6, r
    assert 1.0 <= r["env/turns/mean"] <= 4.0
    # One environment call per task per turn: add has 1 turn, guess up to 4.
    assert 1 <= r["env/calls"] <= 5
    # Observations are context only: the trained tokens are the generated ones.
    assert r["tokens"] <= 4 * 4 * 8 * 4  # P x G rows x max_turns x max_new_tokens
  assert max(r["env/turns/mean"] for r in rl) > 1.0  # really multi-turn
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  val = [r for r in rows if r["phase"] == "val"]
  assert sorted(r["step"] for r in val) == [0, 3, 6]
  assert all(r["val/turns/mean"] >= 1 and "val/truncated_frac" in r for r in val)
  assert all("val/add/accuracy" in r and "val/guess/accuracy" in r for r in val)


class _Flaky:
  """Wraps an environment: call 2 stalls past env.timeout_s, call 4 raises."""

  def __init__(self, env, stall_s):
    self.env, self.stall_s, self.calls = env, stall_s, 0
    self.name, self.max_turns = env.name, env.max_turns
    self.lock = threading.Lock()

  def step(self, turns):
    with self.lock:
      self.calls += 1
      n = self.calls
    if n == 2:
      time.sleep(self.stall_s)
    if n == 4:
      raise ConnectionError("grader unreachable")
    return self.env.step(turns)


@pytest.mark.slow  # a whole tiny run (fast-suite time budget)
def test_failing_and_stalling_environment_never_hang_training(tmp_path):
  cfg = _tiny_cfg(env__timeout_s=0.5)
  flaky = _Flaky(make_env("add"), stall_s=3.0)
  parts, params = build_parts(cfg, config_lib.validate(cfg, jax.device_count()),
                              envs={"add": flaky})
  out = metrics_lib.MetricsWriter(str(tmp_path))
  t0 = time.monotonic()
  try:
    loop.rl(parts, params, Topology.of(parts),
            loop.RunIO(out, metrics_lib.Progress(stream=io.StringIO())))
  finally:
    out.close()
  rl = [r for r in out.rows if r["phase"] == "rl"]
  assert len(rl) == 6
  # Calls 2 and 4 failed their batch's rows; each batch was re-sampled into its slots.
  assert sum(r.get("env/failed/timeout", 0) for r in rl) == 32
  assert sum(r.get("env/failed/error", 0) for r in rl) == 32
  assert rl[-1]["pipeline/regenerated"] == 8  # 4 slots, twice
  # Trained batches hold no failed rows (their groups were replaced whole).
  assert all(r["env/failed_frac"] == 0 for r in rl)
  assert time.monotonic() - t0 < 120
