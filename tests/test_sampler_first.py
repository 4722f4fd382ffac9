"""Tests for the trainer letting the rollout worker's sampler calls go first
(`rollout.sampler_first`, `jaxrl.pipeline.turns.SamplerFirst` through `LagPipeline(turns=)`):
when each pull returns, what it waits for, that batches and versions do not change, that a wait
ends when the pipeline does, a resumed pipeline, and where a run turns it on."""

from __future__ import annotations

import faulthandler
import threading
import time
import types

import pytest

from jaxrl.config import ConfigError, parse_overrides, validate
from jaxrl.pipeline import LagPipeline, PipelineClosed, WorkerFailed
from jaxrl.pipeline.turns import SamplerFirst
from jaxrl.recipes.default import get_config
from jaxrl.run.topology import Topology

SECTION_S, ENV_S, TRAIN_S = 0.03, 0.06, 0.02  # generation (0.09 s) 4.5x the train step


@pytest.fixture(autouse=True)
def _hang_guard():
  faulthandler.dump_traceback_later(60, exit=True)
  yield
  faulthandler.cancel_dump_traceback_later()


class Producer:
  """A batch is one device section (SECTION_S) then an environment's wait (ENV_S), the
  section marked on `turns` as a sampler's call is; records each section's span."""

  def __init__(self, turns: SamplerFirst | None):
    self.turns = turns
    self.sections: dict[int, tuple[float, float]] = {}

  def produce(self, batch_id, params, version):
    assert params == {"version": version}
    began = time.monotonic()
    if self.turns is None:
      time.sleep(SECTION_S)
    else:
      with self.turns.section():
        time.sleep(SECTION_S)
    self.sections[batch_id] = (began, time.monotonic())
    time.sleep(ENV_S)
    return (batch_id, version)

  def state_dict(self):
    return {}

  def load_state_dict(self, host):
    pass

  def encode(self, item):
    return {}, {"item": list(item)}

  def target(self, host):
    return {}

  def decode(self, arrays, host):
    return tuple(host["item"])


def _train(pipe, steps: int, start: int = 0, train_s: float = TRAIN_S):
  """The trainer: per step the pulled item, the batch the worker makes next right after the
  pull (None when the pull found its batch delivered: the worker was not the slower side, or
  the ring is full), and the span of its train step."""
  out = []
  for t in range(start, steps):
    _, item = pipe.pull()
    began = time.monotonic()
    bound = pipe.gate.next_to_make() if pipe.gate.last_pull_waited else None
    time.sleep(train_s)
    out.append((item, bound, (began, time.monotonic())))
    pipe.publish(t + 1, {"version": t + 1})
  return out


def _overlaps(a, b) -> bool:
  return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("lag", [1, 2])
def test_a_step_that_waited_for_its_batch_starts_after_the_next_batchs_first_section(lag):
  turns = SamplerFirst()
  producer = Producer(turns)
  steps = 12
  with LagPipeline(producer, lag, stall_timeout_s=30.0, turns=turns) as pipe:
    pipe.publish(0, {"version": 0})
    got = _train(pipe, steps)
  # Generation is 4.5x the step: the trainer waits for (nearly) every batch.
  assert sum(bound is not None for _, bound, _ in got) >= steps - 2
  for t, (item, b, span) in enumerate(got):
    assert item == (t, max(0, t - lag))  # the same batches and versions as without turns
    # The batch the worker makes next ran its section before the step (when it was made).
    if b is not None and b in producer.sections:
      assert b == t + 1  # one batch in flight: generation is the slower side
      assert producer.sections[b][1] <= span[0], (t, b)
      assert not _overlaps(producer.sections[b], span), (t, b)
  assert turns.waits > 0 and turns.waited_s > 0
  assert pipe.stats()["turn_wait_s"] == turns.waited_s


def test_without_turns_the_steps_share_time_with_the_sections():
  """The control of the test above: the same work with no turns, a step starts while the
  worker's next section runs (it starts as the previous batch is delivered)."""
  producer = Producer(None)
  with LagPipeline(producer, 1, stall_timeout_s=30.0) as pipe:
    pipe.publish(0, {"version": 0})
    got = _train(pipe, 12)
  assert [item for item, _, _ in got] == [(t, max(0, t - 1)) for t in range(12)]
  shared = sum(any(_overlaps(s, span) for s in producer.sections.values())
               for _, _, span in got[2:])
  assert shared >= 5, shared
  assert "turn_wait_s" not in pipe.stats()


def test_where_the_trainer_is_the_slower_side_it_never_waits():
  """Batches ready before the trainer asks (generation 0.01 s, the step 0.05 s): the worker is
  not the critical path, and the two keep sharing the devices as without turns."""

  class Quick(Producer):
    def produce(self, batch_id, params, version):
      with self.turns.section():
        time.sleep(0.01)
      return (batch_id, version)

  turns = SamplerFirst()
  with LagPipeline(Quick(turns), 1, stall_timeout_s=30.0, turns=turns) as pipe:
    pipe.publish(0, {"version": 0})
    got = _train(pipe, 10, train_s=0.05)
  assert [item for item, _, _ in got] == [(t, max(0, t - 1)) for t in range(10)]
  assert sum(bound is not None for _, bound, _ in got) <= 2  # the first pull waits for batch 0
  assert turns.waited_s < 0.1


def test_at_lag_0_nothing_waits():
  turns = SamplerFirst()
  with LagPipeline(Producer(turns), 0, stall_timeout_s=30.0, turns=turns) as pipe:
    pipe.publish(0, {"version": 0})
    got = _train(pipe, 5)
  assert [item for item, _, _ in got] == [(t, t) for t in range(5)]
  assert turns.waits == 0 and turns.waited_s == 0.0


class Stuck(Producer):
  """Batch `stuck` waits (polling `should_stop`) before its section, or raises."""

  def __init__(self, turns, stuck: int, fail: bool):
    super().__init__(turns)
    self.stuck, self.fail, self.should_stop = stuck, fail, lambda: False

  def bind_stop(self, should_stop):
    self.should_stop = should_stop

  def produce(self, batch_id, params, version):
    if batch_id == self.stuck:
      if self.fail:
        time.sleep(0.2)
        raise RuntimeError("sampler broke before its first call")
      while not self.should_stop():
        time.sleep(0.01)
      raise PipelineClosed("closed")
    return super().produce(batch_id, params, version)


def test_a_wait_ends_when_the_pipeline_closes():
  turns = SamplerFirst()
  pipe = LagPipeline(Stuck(turns, stuck=2, fail=False), 1, stall_timeout_s=30.0, turns=turns)
  with pipe:
    pipe.publish(0, {"version": 0})
    pipe.pull()
    pipe.publish(1, {"version": 1})
    threading.Timer(0.3, pipe.close).start()
    began = time.monotonic()
    with pytest.raises(PipelineClosed):  # waits for batch 2's section, then the pull is closed
      pipe.pull()
      pipe.publish(2, {"version": 2})
      pipe.pull()
    assert time.monotonic() - began < 5.0  # not the stall timeout's 30 s


def test_a_worker_that_fails_before_its_section_fails_the_next_pull():
  turns = SamplerFirst()
  with LagPipeline(Stuck(turns, stuck=2, fail=True), 1, stall_timeout_s=30.0,
                   turns=turns) as pipe:
    pipe.publish(0, {"version": 0})
    began = time.monotonic()
    pipe.pull()
    pipe.publish(1, {"version": 1})
    pipe.pull()  # batch 1; batch 2 may start now, and fails before its section
    pipe.publish(2, {"version": 2})
    with pytest.raises(WorkerFailed, match="sampler broke before its first call"):
      pipe.pull()
    assert time.monotonic() - began < 5.0


def test_a_restored_pipeline_does_not_wait_for_batches_made_before_its_checkpoint():
  turns = SamplerFirst()
  with LagPipeline(Producer(turns), 2, stall_timeout_s=30.0, turns=turns) as pipe:
    pipe.publish(0, {"version": 0})
    first = _train(pipe, 4)
    arrays, host = pipe.state_dict()
  again = SamplerFirst()  # a new process: it saw none of the batches made before the save
  resumed = LagPipeline(Producer(again), 2, stall_timeout_s=30.0, turns=again)
  resumed.load_state_dict(arrays, host)
  with resumed:
    resumed.publish(4, {"version": 4})
    began = time.monotonic()
    rest = _train(resumed, 8, start=4)
  assert [i for i, _, _ in first + rest] == [(t, max(0, t - 2)) for t in range(8)]
  # Each wait is at most one section (0.03 s), never a batch the worker will not make again.
  assert time.monotonic() - began < 4 * (TRAIN_S + SECTION_S + ENV_S) + 2.0
  assert again.waited_s < 1.0


def _where(cfg, kind="colocated", platform="cpu"):
  parts = types.SimpleNamespace(
      cfg=cfg, mesh=types.SimpleNamespace(devices=types.SimpleNamespace(
          flat=[types.SimpleNamespace(platform=platform)])))
  return Topology(None, kind).sampler_first(parts)


def test_where_a_run_lets_the_sampler_go_first():
  cfg = get_config()
  assert cfg.rollout.sampler_first == "auto"
  assert _where(cfg)  # colocated on a CPU
  assert not _where(cfg, platform="gpu")
  assert not _where(cfg, kind="devices") and not _where(cfg, kind="processes")
  partial = parse_overrides(get_config(), ["--config.rollout.partial_rollouts=true"])
  assert not _where(partial)  # its batches take the versions published while they generate
  on = parse_overrides(get_config(), ["--config.rollout.sampler_first=on"])
  assert _where(on, platform="gpu") and not _where(on, kind="devices")
  off = parse_overrides(get_config(), ["--config.rollout.sampler_first=off"])
  assert not _where(off)


def test_a_bad_value_is_named():
  cfg = parse_overrides(get_config(), ["--config.rollout.sampler_first=yes"])
  with pytest.raises(ConfigError, match="rollout.sampler_first"):
    validate(cfg, 1)
