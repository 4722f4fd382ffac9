"""The RL loop (`jaxrl.run.loop.rl`) driven through its seams: a fake topology (its own publisher,
recording every version it publishes) and a fake sampler (fixed tokens, no model), so what is
checked is the loop's wiring alone: each batch is sampled with exactly the params object the
publisher returned for its forced-lag version, the publisher is started and closed, and every
step's metrics row says the same versions."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import parallel
from jaxrl.observe import metrics as metrics_lib
from jaxrl.pipeline.producer import RolloutProducer
from jaxrl.rollout.multi_turn import MultiTurn
from jaxrl.rollout.static_sampler import SampleOutput
from jaxrl.run import loop
from jaxrl.run.topology import Feed

from test_bad_input import _parts, _tiny_cfg  # tests/ is on sys.path


class FakeSampler:
  """Answers every prompt with the same digits: row r of a batch gets `digits[r % len]`, then
  EOS. Records the version and the params object of every call."""

  def __init__(self, tok, n_new: int, digits=("1", "2")):
    self.calls: list[tuple[int, object]] = []
    self.rows = [tok.encode(d) + [tok.eos_ids[0]] for d in digits]
    self.n_new, self.pad = n_new, tok.pad_id

  def __call__(self, params, prompts, prompt_valid, key, request_ids, temperature, top_k=0,
               top_p=1.0, version=0):
    self.calls.append((version, params))
    b = len(request_ids)
    tokens = np.full((b, self.n_new), self.pad, np.int32)
    mask = np.zeros((b, self.n_new), bool)
    for i in range(b):
      row = self.rows[i % len(self.rows)]
      tokens[i, :len(row)], mask[i, :len(row)] = row, True
    # Log-probs of a uniform sampler over the vocabulary (finite, the same for every token).
    logprobs = np.where(mask, -np.log(64.0), 0.0).astype(np.float32)
    return SampleOutput(jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(mask),
                        jnp.asarray(mask.sum(-1).astype(np.int32)))


class RecordingPublisher:
  """Publishes a copy of each version (as the colocated publisher does) and keeps it by version."""

  def __init__(self, parts):
    self.parts, self.published, self.started, self.closed = parts, {}, [], 0

  def __call__(self, version, params):
    copy = self.parts.rollout_copy(params)
    self.published[version] = copy
    return copy

  def start(self, first_batch):
    self.started.append(first_batch)

  def close(self):
    self.closed += 1


class FakeTopology:
  """Rollouts on this process, made by `sampler`, published by a `RecordingPublisher`."""

  def __init__(self, sampler):
    self.sampler, self.publisher, self.fed = sampler, None, 0

  def feed(self, parts, params, handoff, main):
    del params, handoff, main
    self.fed += 1
    self.publisher = RecordingPublisher(parts)
    turns = MultiTurn(parts.tok, parts.envs, parts.budget, parts.cfg.rollout.group_size,
                      self.sampler, self.sampler, parallel.distributed.fetch,
                      parts.cfg.env.timeout_s)
    return Feed(RolloutProducer(parts, turns), self.publisher, inline=False,
                eval_on_train=False, asynchronous_eval=True)

  def describe(self, parts, feed):
    return "rollouts: a fake sampler"


@pytest.mark.parametrize("lag", [0, 2])
def test_the_loop_samples_each_batch_with_its_forced_lag_version(lag):
  cfg = _tiny_cfg(train__steps=4, rollout__lag=lag)
  parts, params = _parts(cfg)
  sampler = FakeSampler(parts.tok, cfg.rollout.max_new_tokens)
  topology = FakeTopology(sampler)
  out, text = metrics_lib.MetricsWriter(None), io.StringIO()
  final, summary = loop.rl(parts, params, topology, loop.RunIO(out, metrics_lib.Progress(text)))
  out.close()

  assert topology.fed == 1
  assert topology.publisher.started == [0] and topology.publisher.closed == 1
  # Version 0 (the start) and one per step.
  assert sorted(topology.publisher.published) == list(range(cfg.train.steps + 1))
  # The worker makes batches 0..steps-1, and up to L more ahead (the ring holds L past the last
  # one trained on; whether it got to them before the run closed the pipeline is timing);
  # batch b is sampled with version max(0, b - L), as the very object that was published.
  made = min(len(sampler.calls), cfg.train.steps + lag)
  assert made >= cfg.train.steps, sampler.calls
  versions = [max(0, b - lag) for b in range(made)]
  assert [v for v, _ in sampler.calls[:made]] == versions
  for v, p in sampler.calls[:made]:
    assert p is topology.publisher.published[v]
  rows = [r for r in out.rows if r["phase"] == "rl"]
  assert [r["batch_id"] for r in rows] == list(range(cfg.train.steps))
  assert [r["submit_version"] for r in rows] == versions[:cfg.train.steps]
  assert [r["consume_version"] for r in rows] == list(range(cfg.train.steps))
  # Every row answered "1" or "2" with EOS: one or two tokens each.
  assert all(1.0 <= r["completion_len"] <= 2.0 for r in rows)
  assert "rollouts: a fake sampler" in text.getvalue()
  assert summary["rl/steps"] == cfg.train.steps and summary["rl/stopped_at"] is None
  # The params came back from the train state, as the same tree.
  assert jax.tree.structure(final) == jax.tree.structure(params)


def test_the_publisher_is_closed_when_a_step_fails():
  cfg = _tiny_cfg(train__steps=3)
  parts, params = _parts(cfg)
  topology = FakeTopology(FakeSampler(parts.tok, cfg.rollout.max_new_tokens))

  def fail(step, batch):
    if step == 2:
      raise RuntimeError("injected at step 2")
    return batch

  out = metrics_lib.MetricsWriter(None)
  with pytest.raises(RuntimeError, match="injected at step 2"):
    loop.rl(parts, params, topology, loop.RunIO(out, metrics_lib.Progress(io.StringIO())),
            step=loop.RLStep.build(parts, params, on_batch=fail))
  assert topology.publisher.closed == 1
  assert [r["step"] for r in out.rows if r["phase"] == "rl"] == [1]
