"""Tests for the lag that tunes itself (`rollout.lag = "auto"`): the tuner's model and choice
(`jaxrl.pipeline.tuner`), the exact staleness of a pipeline whose lag changes (`LagGate.set_lag`
through `LagPipeline`), its checkpoints, and the config keys."""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxrl.config import ConfigError, parse_overrides, validate
from jaxrl.core.names import lag_bound
from jaxrl.pipeline import LagGate, LagPipeline
from jaxrl.pipeline.tuner import Choice, LagTuner, choose_lag, pipeline_time
from jaxrl.recipes.default import get_config


@pytest.fixture(autouse=True)
def _hang_guard():
  faulthandler.dump_traceback_later(60, exit=True)
  yield
  faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------------------------
# The model and the choice


def test_pipeline_time_worked_examples():
  one = [1.0, 1.0, 1.0]
  # Lag 0 alternates: 3 x (1 + 1) = 6. Lag 1: batch b+1 is made while step b trains, so only the
  # first batch is waited for: 1 + 3 x 1 = 4 (a lag that overlapped nothing would give 6).
  assert pipeline_time(one, one, 0) == 6.0
  assert pipeline_time(one, one, 1) == 4.0
  # Generation 3x the train step: the worker never idles at lag >= 1, the run ends when the
  # last batch is made plus one step: 3 x 3 + 1 = 10 at lag 1 and 2; lag 0: 3 x (3 + 1) = 12.
  three = [3.0, 3.0, 3.0]
  assert [pipeline_time(three, one, lag) for lag in (0, 1, 2)] == [12.0, 10.0, 10.0]
  # Alternating slow and instant batches (g = 2, 0, 2, 0; t = 1): lag 0 takes 4 + 4 = 8; lag 1
  # waits 1 s for batch 2 (made 3..5, pulled at 4): 7; lag 2 starts batch 2 at 2, on time: 6.
  g, t = [2.0, 0.0, 2.0, 0.0], [1.0] * 4
  assert [pipeline_time(g, t, lag) for lag in (0, 1, 2)] == [8.0, 7.0, 6.0]


def test_choose_lag_is_the_smallest_that_hides_generation():
  one, three = [1.0] * 8, [3.0] * 8
  # 3x slower generation: lag 1 already saves all lag 2 would (previous test), so 1, not 2.
  c = choose_lag(three, one, max_lag=2)
  assert c.lag == 1 and "lag 1 saves 100% of what lag 2 would" in c.reason
  assert "generation 3 s/batch, train 1 s/step (medians of 8 steps)" in c.reason
  # Jittery generation (times 8, 7, 6): lag 1 is 1 s behind lag 2, more than the tolerance
  # max(10% of the 2 s saving, 5% of 8 s) = 0.4 s: lag 2. With hide = 0.5 it is 1 s: lag 1.
  assert choose_lag([2.0, 0.0, 2.0, 0.0], [1.0] * 4, max_lag=2).lag == 2
  assert choose_lag([2.0, 0.0, 2.0, 0.0], [1.0] * 4, max_lag=2, hide=0.5).lag == 1
  # A lag more must save 5% of the lag-0 time: g = 2, 0.7, 2, 0.7 (t = 1) gives 5.4 + 4 = 9.4
  # at lag 0, 7.0 at lag 1 (batch 2 made 3..5, pulled at 4: 1 s waited) and 6.7 at lag 2 (batch
  # 2 made 2.7..4.7, 0.7 s waited). Lag 1 saves 2.4 / 2.7 = 89% of the best (< 90%), but it is
  # 0.3 s behind, within max(0.27, 5% of 9.4 = 0.47): lag 1.
  assert [pipeline_time([2.0, 0.7, 2.0, 0.7], [1.0] * 4, lag) for lag in (0, 1, 2)] == \
      pytest.approx([9.4, 7.0, 6.7])
  assert choose_lag([2.0, 0.7, 2.0, 0.7], [1.0] * 4, max_lag=2).lag == 1
  # Nothing to hide (instant generation): lag 0, the synchronous run.
  assert choose_lag([0.0] * 8, one, max_lag=3).lag == 0
  # Little to hide: g = 0.04, t = 1 over 3 steps: lag 0 takes 3.12, lag 1 0.04 + 3 = 3.04, a
  # saving of 2.6% < EPS = 5%: lag 0. At g = 0.2: 3.6 against 3.2, 11%: lag 1.
  assert choose_lag([0.04] * 3, [1.0] * 3, max_lag=2).lag == 0
  assert choose_lag([0.2] * 3, [1.0] * 3, max_lag=2).lag == 1
  # Only the last n = min(len) pairs count.
  assert choose_lag([9.0, 1.0], [1.0], max_lag=1) == choose_lag([1.0], [1.0], max_lag=1)


def test_tuner_decides_every_interval_from_the_steps_since_the_last():
  tuner = LagTuner(max_lag=2, every=4)
  assert tuner.start == 1
  for b in range(0, 8):
    # Batch 0 compiles (left out); batches 1..3 generate instantly, 4..7 at 3x the train step.
    tuner.observe_generation(b, 100.0 if b == 0 else (0.0 if b < 4 else 3.0))
    tuner.observe_train(b, 1.0)
  assert [tuner.due(b) for b in range(9)] == [False, False, False, False, True, False, False,
                                              False, True]
  assert tuner.decide(3) is None  # not a decision point
  first = tuner.decide(4)  # batches 1..3: nothing to hide
  assert first.lag == 0
  saved = tuner.state_dict()
  again = LagTuner(max_lag=2, every=4)
  again.load_state_dict(saved)
  # Batches 4..7 (1..3 were dropped with the first decision); restored, the same decision.
  second = tuner.decide(8)
  assert second == again.decide(8) == choose_lag([3.0] * 4, [1.0] * 4, 2)
  assert second.lag == 1
  assert tuner.decide(8) is None  # a decision reads each measurement once
  with pytest.raises(ValueError, match="max_lag >= 1"):
    LagTuner(max_lag=0, every=4)


# --------------------------------------------------------------------------------------------
# A pipeline whose lag changes: exact staleness at every step


class ScriptedTuner(LagTuner):
  """A `LagTuner` whose decisions are drawn from a seeded RNG (any lag in 0..max_lag, jumps by
  two included) instead of from the measured times, so every kind of change is exercised."""

  def __init__(self, max_lag, every, seed):
    super().__init__(max_lag, every)
    self.seed = seed

  def decide(self, batch_id):
    if not self.due(batch_id):
      return None
    lag = random.Random(hash((self.seed, batch_id))).randrange(self.max_lag + 1)
    return Choice(lag, f"scripted {lag}")


@dataclasses.dataclass
class Item:
  batch_id: int
  version: int
  draw: float


class SlowProducer:
  """Batch b: a draw of its RNG made with params `version`, after a random sleep (0..max_ms);
  records when each batch began. Checkpointable (`LagPipeline.state_dict`)."""

  def __init__(self, seed=0, max_ms=3.0):
    self.rng = np.random.default_rng(seed)
    self.sleep = random.Random(seed)
    self.max_ms = max_ms
    self.started: dict[int, float] = {}

  def produce(self, batch_id, params, version):
    self.started[batch_id] = time.monotonic()
    assert params["version"] == version  # the handoff gave exactly the requested version
    time.sleep(self.sleep.random() * self.max_ms / 1e3)
    return Item(batch_id, version, float(self.rng.random()))

  def state_dict(self):
    return {"rng": self.rng.bit_generator.state}

  def load_state_dict(self, host):
    self.rng.bit_generator.state = host["rng"]

  def encode(self, item):
    return {"draw": np.array([item.draw])}, {"batch_id": item.batch_id, "version": item.version}

  def target(self, host):
    return {"draw": (1,)}

  def decode(self, arrays, host):
    return Item(host["batch_id"], host["version"], float(arrays["draw"][0]))


def _drive(pipe, steps, start=0, train_ms=0.0, seed=0):
  """The trainer over `pipe` from `start` updates done: per step (batch id, version, recorded
  lag, draw, when the pull began)."""
  got, sleep = [], random.Random(seed + start)
  for t in range(start, steps):
    began = time.monotonic()
    batch_id, item = pipe.pull()
    got.append((batch_id, item.version, pipe.stats()["lag"], item.draw, began))
    time.sleep(sleep.random() * train_ms / 1e3)
    pipe.publish(t + 1, {"version": t + 1})
  return got


@pytest.mark.parametrize("max_lag,every,seed", [(2, 3, 0), (3, 2, 1), (1, 1, 2)])
@pytest.mark.parametrize("inline", [False, True])
def test_staleness_is_the_recorded_lag_at_every_step(max_lag, every, seed, inline):
  steps = 24
  lines = []
  tuner = ScriptedTuner(max_lag, every, seed)
  producer = SlowProducer(seed)
  with LagPipeline(producer, tuner, stall_timeout_s=10.0, inline=inline,
                   say=lines.append) as pipe:
    pipe.publish(0, {"version": 0})
    got = _drive(pipe, steps, train_ms=3.0, seed=seed)
    assert pipe.stats()["capacity"] == max_lag + 1
  lags = [lag for _, _, lag, _, _ in got]
  assert len(set(lags)) > 1  # the script changed the lag (else this test tests nothing)
  # The lag of batch b: the scripted decision at the last decision point s with
  # s + max_lag + 1 <= b (batches before the first change: the starting lag, 1).
  want = []
  for b in range(steps):
    points = [s for s in range(every, b + 1, every) if s + max_lag + 1 <= b]
    want.append(tuner.decide(points[-1]).lag if points else 1)
  assert lags == want
  for b, version, lag, _, _ in got:
    assert version == max(0, b - lag), (b, version, lag)  # step b + 1 consumes it
  # The recorded lag changes only where a decision takes effect.
  for b in range(1, steps):
    if lags[b] != lags[b - 1]:
      assert b >= every + max_lag + 1 and (b - max_lag - 1) % every == 0, (b, lags)
  # No batch started before the pull its lag waits for (b - lag(b)): no run-ahead.
  began = {b: at for b, _, _, _, at in got}
  for b, at in producer.started.items():
    if b < steps and b - lags[b] >= 1:
      assert at >= began[b - lags[b]], (b, lags[b])
  # Each change is said once, with where it takes effect (and the first decision, kept or not).
  changes = [b for b in range(1, steps) if lags[b] != lags[b - 1]]
  said = [line for line in lines if int(line.split("from step ")[1].split(" ")[0]) <= steps
          and " kept " not in line]
  assert len(said) == len(changes)
  assert lines[0].startswith(f"lag 1 -> {lags[every + max_lag + 1]} from step "
                             f"{every + max_lag + 2} " if lags[every + max_lag + 1] != 1
                             else f"lag 1 kept from step {every + max_lag + 2} ")
  assert all(f"-> {lags[b]} from step {b + 1}" in line for b, line in zip(changes, said))


def test_gate_refuses_a_change_to_a_reserved_batch_or_past_max_lag():
  gate = LagGate(1, stall_timeout_s=5, max_lag=2)
  assert gate.capacity == 3 and gate.reserve() == 0 and gate.reserve() == 1
  with pytest.raises(ValueError, match="reserved"):
    gate.set_lag(1, 2)
  with pytest.raises(ValueError, match="outside 0..2"):
    gate.set_lag(2, 3)
  gate.set_lag(2, 2)  # batch 2 may start now: version max(0, 2 - 2) = 0 is published
  assert gate.try_reserve() == 2 and gate.version_of(2) == 0
  assert gate.try_reserve() is None  # batch 3 needs the pull of batch 1 (3 - 2)
  gate.deliver(0, "a")
  assert gate.pull() == (0, "a") and gate.try_reserve() is None
  gate.deliver(1, "b")
  assert gate.pull() == (1, "b") and gate.try_reserve() == 3 and gate.version_of(3) == 1


def test_a_resumed_pipeline_continues_with_the_lag_in_force():
  """Saved after the lag changed, loaded into a fresh pipeline and tuner: the same batches,
  versions and recorded lags as the run that never stopped."""
  max_lag, every, seed, steps, stop_at = 2, 3, 0, 18, 11

  def pipeline(producer_seed):
    return LagPipeline(SlowProducer(producer_seed, max_ms=0.0), ScriptedTuner(max_lag, every, seed),
                       stall_timeout_s=10.0)

  def strip(got):
    return [(b, v, lag, draw) for b, v, lag, draw, _ in got]

  with pipeline(0) as pipe:
    pipe.publish(0, {"version": 0})
    whole = strip(_drive(pipe, steps))
  with pipeline(0) as pipe:
    pipe.publish(0, {"version": 0})
    first = strip(_drive(pipe, stop_at))
    arrays, host = pipe.state_dict()
    in_force = pipe.gate.lag_of(stop_at)
  assert len({lag for _, _, lag, _ in first}) > 1  # the lag changed before the save
  resumed = pipeline(99)
  resumed.load_state_dict(arrays, host)
  assert resumed.gate.lag_of(stop_at) == in_force
  with resumed:
    resumed.publish(stop_at, {"version": stop_at})
    rest = strip(_drive(resumed, steps, start=stop_at))
  assert first + rest == whole


def test_real_tuner_hides_slow_generation_and_keeps_lag_0_when_nothing_to_hide():
  """The measured times decide: generation ~3x the train step (30 ms vs 10 ms of sleep) makes the
  first decision raise the lag to 1 or more; instant generation next to a 50 ms step keeps 0."""

  class Sleepy(SlowProducer):
    def __init__(self, gen_s):
      super().__init__(0, max_ms=0.0)
      self.gen_s = gen_s

    def produce(self, batch_id, params, version):
      time.sleep(self.gen_s)
      return super().produce(batch_id, params, version)

  for gen_s, train_ms, lags in ((0.03, 10.0, {1, 2}), (0.0, 50.0, {0})):
    tuner = LagTuner(max_lag=2, every=4, start=0 if gen_s else 1)
    with LagPipeline(Sleepy(gen_s), tuner, stall_timeout_s=10.0) as pipe:
      pipe.publish(0, {"version": 0})
      for t in range(5):  # the decision at the pull of batch 4 sets the lag of batch 7 on
        pipe.pull()
        time.sleep(train_ms / 1e3)
        pipe.publish(t + 1, {"version": t + 1})
      assert pipe.gate.lag_of(7) in lags, (gen_s, pipe.gate.lag_of(7))


# --------------------------------------------------------------------------------------------
# Config


def test_config_lag_auto_and_its_bounds():
  cfg = parse_overrides(get_config(), ["--config.rollout.lag=auto", "--config.rollout.max_lag=3"])
  assert cfg.rollout.lag == "auto" and lag_bound(cfg.rollout) == 3
  validate(cfg, 1)
  assert lag_bound(get_config().rollout) == 0  # the default stays a fixed lag 0
  with pytest.raises(ConfigError, match=r"config.rollout.lag: expected int, got 'fast'"):
    parse_overrides(get_config(), ["--config.rollout.lag=fast"])
  cfg = parse_overrides(get_config(), ["--config.rollout.lag=auto", "--config.rollout.max_lag=0"])
  with pytest.raises(ConfigError, match=r"^config.rollout.max_lag: must be >= 1 with "):
    validate(cfg, 1)
  cfg = parse_overrides(get_config(), ["--config.rollout.lag=auto"])
  cfg.distributed.num_processes, cfg.distributed.coordinator_address = 2, "127.0.0.1:1234"
  with pytest.raises(ConfigError, match=r"^config.rollout.lag: 'auto' tunes one process's "
                     r"rollout worker; with config.distributed.num_processes > 1 set a fixed"):
    validate(cfg, 1)


# --------------------------------------------------------------------------------------------
# The whole run: `python -m jaxrl.train --config.rollout.lag=auto`, stopped and resumed


@pytest.mark.slow
def test_auto_lag_run_stops_and_resumes_with_the_lag_in_force(tmp_path):
  """A tiny run at lag auto (decisions every 2 steps, max_lag 1: a change can take effect only at
  batch b = 4, 6, 8, ..., step b + 1), stopped by SIGTERM after step 5 and resumed: every step's
  staleness is the lag recorded for it, and the first resumed step keeps the lag in force at the
  stop unless it is a step a change takes effect at."""
  from test_resume import STEPS, _args, _finish, _popen, _rows, _wait_for_rl_step

  run_dir = tmp_path / "run"
  args = _args(run_dir, "auto", "--config.checkpoint.every=100", "--config.rollout.max_lag=1",
               "--config.rollout.lag_every=2")
  proc = _popen(args, tmp_path)
  _wait_for_rl_step(proc, run_dir, 5)
  proc.send_signal(signal.SIGTERM)
  first = _finish(proc)
  assert "lag auto (0..1, starting at 1, decided every 2 steps)" in first
  saved = max(r["step"] for r in _rows(run_dir) if r["phase"] == "rl")
  out = _finish(_popen(args, tmp_path))
  assert f"resumed from step {saved}" in out
  rl = {r["step"]: r for r in _rows(run_dir) if r["phase"] == "rl"}
  assert sorted(rl) == list(range(1, STEPS + 1))
  for r in rl.values():
    assert r["pipeline/lag"] in (0, 1)
    assert r["staleness/first_token/min"] == r["staleness/first_token/max"] \
        == min(r["batch_id"], r["pipeline/lag"]), r["step"]
  lags = [rl[s]["pipeline/lag"] for s in range(1, STEPS + 1)]
  # The resumed run names the lag its checkpoint's schedule gives the first step it trains.
  assert (f"lag auto (0..1, resuming at lag {lags[saved]} from step {saved + 1}, decided every "
          "2 steps)") in out, out
  for s in range(2, STEPS + 1):  # changes only where one can take effect
    if lags[s - 1] != lags[s - 2]:
      assert (s - 1) >= 4 and (s - 1) % 2 == 0, lags
  for line in (first + out).splitlines():
    if line.strip().startswith("lag ") and " from step " in line:
      assert "rollout.lag_every=2): generation " in line and " s/batch, train " in line


@pytest.mark.slow
def test_lag_auto_benchmark_pipeline_quick_json():
  """`benchmarks/lag_auto.py --pipeline --quick`: generation (150 ms sleeps) 3x the train step
  (50 ms) makes the tuner keep lag >= 1 (lag 0 would waste 50 ms a step); the JSON has the
  fields benchmarks/README.md quotes."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "lag_auto.py"),
                         "--pipeline", "--quick"], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "PYTHONPATH": root})
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert report["mode"] == "pipeline" and report["steps"] == 20
  assert report["chosen_lag"] >= 1 and len(report["lag_per_step"]) == 20
  assert report["lag_decisions_said"][0].startswith("lag 1 ")
  assert {"lag0_step_s", "auto_step_s", "overlap_of_possible", "date"} <= set(report)
