"""Partial rollouts for agent tasks: a weight update published while an episode's request is being
decoded pauses the requests in flight, recomputes their KV under the new params and resumes
them; each token's version says which params made it, its log-prob is that policy's, and the
trajectory carries exactly the versions the agent was served. In a real run at lag 1 with an
update forced mid-batch, replies crossed by it carry both versions, the batch's first tokens keep
the forced lag exactly, no token is older and no episode fails."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from openai_models import qwen_model  # noqa: E402
from jaxrl import config as config_lib  # noqa: E402
from jaxrl.core.types import TrainBatch  # noqa: E402
from jaxrl.envs.base import Task  # noqa: E402
from jaxrl.learner.step import StepConfig, completion_logprobs  # noqa: E402
from jaxrl.pipeline import producer as producer_lib  # noqa: E402
from jaxrl.rollout import samplers  # noqa: E402
from jaxrl.rollout.multi_turn import Budget  # noqa: E402
from jaxrl.run import driver  # noqa: E402
from jaxrl.serving.agents import AgentLoop  # noqa: E402
from jaxrl.serving.openai import OpenAIServer  # noqa: E402

from test_bad_input import _tiny_cfg  # noqa: E402

LP, N = 128, 8
SEEN: dict = {}  # the replies each episode was served, by task uid


async def two_turns(client, task):
  """Two chat turns; the second prompt extends the first prompt + reply."""
  msgs = [{"role": "user", "content": task.prompt}]
  r1 = await client.chat.completions.create(model="any", messages=msgs, logprobs=True)
  msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
           {"role": "user", "content": "again"}]
  r2 = await client.chat.completions.create(model="any", messages=msgs, logprobs=True)
  SEEN[task.uid] = [r1, r2]
  return 1.0


REPLIES: list[list[int]] = []  # per reply of `answer_seen`, the versions it was served


async def answer(client, task):
  """One completion of the row's prompt (the built-in `add` rows); reward: the exact answer."""
  r = await client.completions.create(model="policy", prompt=task.prompt, max_tokens=3)
  return float(r.choices[0].text.strip() == task.data["answer"])


async def answer_seen(client, task):
  """`answer`, keeping each reply's per-token versions."""
  r = await client.completions.create(model="policy", prompt=task.prompt, max_tokens=3)
  REPLIES.append(r.choices[0].model_extra["policy_versions"])
  return float(r.choices[0].text.strip() == task.data["answer"])


async def streamed(client, task):
  """One streamed chat turn; keeps what the chunks carried."""
  ids, versions = [], []
  stream = await client.chat.completions.create(
      model="any", messages=[{"role": "user", "content": task.prompt}], stream=True)
  async for chunk in stream:
    extra = (chunk.choices[0].model_extra or {}) if chunk.choices else {}
    ids += extra.get("token_ids", [])
    versions += extra.get("policy_versions", [])
  SEEN[task.uid] = (ids, versions)
  return 1.0


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
  """A random tiny Qwen2-style model (version 0) and another draw of it (version 1), behind a
  server that decodes one token per dispatch, so a reply spans several dispatches."""
  tok, graphdef, params0 = qwen_model(tmp_path_factory.mktemp("v0"))
  _, _, params1 = qwen_model(tmp_path_factory.mktemp("v1"), seed=1)
  holder = {}
  server = OpenAIServer(graphdef, None, tok, model="policy", num_slots=4, max_prompt_len=LP,
                        max_new_tokens=N, steps_per_dispatch=1, compact=False,
                        prefill_buckets=(32, LP),
                        params_source=lambda: holder["loop"].serving_source(),
                        warmup=False).start()
  server.engine.warmup(params0)
  yield server, tok, graphdef, params0, params1, holder
  server.stop()


def _recompute(graphdef, params, prompt, tokens):
  """The trainer's log-probs (`completion_logprobs`, temperature 1) of one reply."""
  prompts, valid = np.zeros((1, LP), np.int32), np.zeros((1, LP), bool)
  prompts[0, LP - len(prompt):], valid[0, LP - len(prompt):] = prompt, True
  toks, mask = np.zeros((1, N), np.int32), np.zeros((1, N), bool)
  toks[0, :len(tokens)], mask[0, :len(tokens)] = tokens, True
  batch = TrainBatch(prompts, valid, toks, mask, np.zeros((1, N), np.float32),
                     np.zeros(1, np.float32), np.arange(1), np.ones(1, np.float32))
  logp, _ = completion_logprobs(graphdef, params, batch, StepConfig(), with_entropy=False)
  return np.asarray(logp)[0, :len(tokens)]


@pytest.mark.slow
def test_a_weight_update_mid_reply_pauses_and_resumes_the_requests_in_flight(two_policies):
  server, tok, graphdef, params0, params1, holder = two_policies
  engine = server.engine
  start = engine.stats["dispatch"]
  # Version 1 is published once the batch has run 3 decode dispatches: the first reply has
  # 1 + 3 tokens of version 0 by then (the first drawn at admission), the rest are version 1.
  newest = lambda: (1, params1) if engine.stats["dispatch"] >= start + 3 else None
  budget = Budget(max_prompt_len=LP, max_new_tokens=N, max_total_tokens=64, max_turns=2)
  loop = AgentLoop(two_turns, server, tok, budget, 1, newest=newest)
  holder["loop"] = loop
  SEEN.clear()
  refreshes = engine.stats["refresh"]
  tasks = [Task("t", f"What is {i}+{i}?", {}, f"t{i}") for i in range(2)]
  ep = loop.run(params0, tasks, None, 0, version=0, temperature=1.0)
  assert not ep.failed.any(), ep.fail_reasons
  assert engine.stats["refresh"] > refreshes  # the KV of the requests in flight was recomputed
  firsts, switched = [], 0
  for i, task in enumerate(ep.tasks):
    r1, r2 = SEEN[task.uid]
    served = []  # per turn
    for r in (r1, r2):
      ch = r.choices[0]
      v = ch.model_extra["policy_versions"]
      assert len(v) == len(ch.model_extra["token_ids"]) and v == sorted(v)  # never goes back
      served.append(v)
      # Each token's log-prob is that of the version stamped on it, given everything before it.
      prompt, ids = r.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]
      want = np.where(np.asarray(v) == 0, _recompute(graphdef, params0, prompt, ids),
                      _recompute(graphdef, params1, prompt, ids))
      got = np.asarray([t.logprob for t in ch.logprobs.content])
      assert np.abs(want - got).max() <= 1e-5, (v, want, got)
    firsts.append(served[0][0])
    first_reply = r1.choices[0].model_extra["policy_versions"]
    switched += len(set(first_reply)) == 2
    # The second turn starts after the update: all of it is version 1.
    assert set(r2.choices[0].model_extra["policy_versions"]) == {1}
    # The trajectory's versions are exactly those served, token for token, the second reply's
    # too (in the first turn's sequence when its prompt extends it; a random model's reply may
    # re-render differently, and then it is a second sequence of the row, cut where the row's
    # budget ends).
    kept = ep.policy_version[i][ep.mask[i]].tolist()
    assert kept == (served[0] + served[1])[:len(kept)] and len(kept) >= len(served[0])
    assert len(kept) == len(served[0]) + len(served[1]) or ep.truncated[i]
  # First-token staleness stays exact: the batch's first admission is served by its own version.
  assert min(firsts) == 0
  # A reply whose decoding the update crossed carries both versions (4 tokens of 0, then 1).
  assert switched >= 1
  r1 = SEEN[ep.tasks[firsts.index(0)].uid][0].choices[0].model_extra["policy_versions"]
  assert r1[:4] == [0] * 4 and (len(r1) <= 4 or r1[4] == 1), r1


def test_a_streamed_reply_shows_the_update_as_it_happens(two_policies):
  server, tok, _, params0, params1, holder = two_policies
  engine = server.engine
  start = engine.stats["dispatch"]
  newest = lambda: (1, params1) if engine.stats["dispatch"] >= start + 3 else None
  budget = Budget(max_prompt_len=LP, max_new_tokens=N, max_total_tokens=64, max_turns=1)
  loop = AgentLoop(streamed, server, tok, budget, 1, newest=newest)
  holder["loop"] = loop
  SEEN.clear()
  ep = loop.run(params0, [Task("t", "What is 3+4?", {}, "s0")], None, 0, version=0,
                temperature=1.0)
  assert not ep.failed.any(), ep.fail_reasons
  ids, versions = SEEN["s0"]
  # The recorded turn is exactly what the stream carried, versions included.
  n = len(ids)
  assert n == int(ep.mask[0].sum()) and ep.tokens[0, :n].tolist() == ids
  assert ep.policy_version[0, :n].tolist() == versions
  assert n > 4 and versions[:4] == [0] * 4 and set(versions[4:]) == {1}, versions


def test_without_newest_the_batch_keeps_its_version(two_policies):
  server, tok, _, params0, _, holder = two_policies
  budget = Budget(max_prompt_len=LP, max_new_tokens=N, max_total_tokens=64, max_turns=2)
  loop = AgentLoop(two_turns, server, tok, budget, 1)
  holder["loop"] = loop
  ep = loop.run(params0, [Task("t", "What is 1+1?", {}, "u0")], None, 0, version=4,
                temperature=1.0)
  assert not ep.failed.any() and set(ep.policy_version[0][ep.mask[0]].tolist()) == {4}


def test_config_accepts_partial_rollouts_for_an_agent_task():
  cfg = _tiny_cfg(task__name="agent:test_agent_partial:answer", rollout__engine="continuous",
                  rollout__partial_rollouts=True, rollout__lag=1)
  config_lib.validate(cfg, jax.device_count())


@pytest.mark.slow  # a 4-step agent run through the server: ~100 s on 2 busy cores
def test_an_agent_run_with_partial_rollouts_switches_mid_reply_and_keeps_first_tokens_exact(
    tmp_path, monkeypatch):
  # Lag 1: batch b starts on params b - 1. The switch is made deterministic through the
  # documented seam `samplers.partial_source`: for batches 1..steps-1 the second call of the
  # batch's source (the first poll, after the first decode dispatch) waits until the trainer
  # has published version b, which it does without needing batch b. So every such batch has
  # replies whose first tokens are version b - 1 and whose later tokens are version b.
  lag, steps = 1, 4
  cfg = _tiny_cfg(task__name="agent:test_agent_partial:answer_seen",
                  rollout__engine="continuous", rollout__engine_slots=8,
                  rollout__engine_steps=1, rollout__partial_rollouts=True, rollout__lag=lag,
                  train__steps=steps)
  mesh = config_lib.validate(cfg, jax.device_count())
  batch = [None]
  produce = producer_lib.RolloutProducer.produce

  def recording(self, batch_id, params, version):
    batch[0] = batch_id
    return produce(self, batch_id, params, version)

  def gated(newest, version, params):
    calls, b = [], batch[0]

    def source():
      calls.append(1)
      if not 1 <= b < steps or len(calls) < 2:
        return version, params
      deadline = time.monotonic() + 300
      while (newest() or (-1, None))[0] <= version:
        assert time.monotonic() < deadline, f"batch {b}: no params newer than {version}"
        time.sleep(0.01)
      return newest()

    return source

  monkeypatch.setattr(producer_lib.RolloutProducer, "produce", recording)
  monkeypatch.setattr(samplers, "partial_source", gated)
  REPLIES.clear()
  driver.run(cfg, str(tmp_path / "run"), mesh)
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
          .splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["batch_id"] for r in rl] == list(range(steps))
  for r in rl:
    want = min(r["batch_id"], lag)
    # The batch's first tokens keep the forced lag exactly; no token is older, none newer.
    assert r["staleness/first_token/max"] == want, r
    for kind in ("first_token", "last_token", "token_mean"):
      assert 0 <= r[f"staleness/{kind}/min"] <= r[f"staleness/{kind}/max"] <= want, (kind, r)
    if r["batch_id"] >= 1:  # switched: some rows end on the newest version
      assert r["staleness/last_token/min"] == 0, r
    assert r.get("env/failed/error", 0) == 0 and r.get("env/failed/timeout", 0) == 0, r
  # Replies whose decoding the update crossed: the old version, then the new one.
  crossed = [v for v in REPLIES if len(set(v)) == 2]
  assert crossed and all(v == sorted(v) and v[-1] - v[0] == 1 for v in crossed), REPLIES[:8]
  assert len(REPLIES) >= steps * cfg.rollout.num_prompts * cfg.rollout.group_size
