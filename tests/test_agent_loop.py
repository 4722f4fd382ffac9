"""Agents as a task (`jaxrl.serving.agents`): an `openai`-client agent plays episodes against the
run's server; each episode becomes one trajectory of exactly the tokens the server generated
(only model tokens trained), stamped with the serving version; failed and timed-out episodes are
excluded. The model is a bigram machine (`openai_models.scripted_params`) that answers every chat
prompt with one `calc` tool call, so the tokens are known in advance."""

import asyncio
import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from openai_models import CALL_JSON, TOOL_TOKENS, chain, qwen_model, scripted_params  # noqa: E402
from jaxrl.core.types import TrainBatch  # noqa: E402
from jaxrl.envs.base import Task  # noqa: E402
from jaxrl.learner.step import StepConfig, completion_logprobs  # noqa: E402
from jaxrl.rollout.multi_turn import Budget  # noqa: E402
from jaxrl.serving.agents import AgentLoop, load_agent, trajectory  # noqa: E402
from jaxrl.serving.dispatcher import Completion  # noqa: E402
from jaxrl.serving.openai import OpenAIServer  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
SEEN: dict = {}  # episode replies as the agents saw them, by task uid


async def twice(client, task):
  """Two plain turns: the second prompt extends the first prompt + reply token for token."""
  msgs = [{"role": "user", "content": task.prompt}]
  r1 = await client.chat.completions.create(model="any", messages=msgs, logprobs=True)
  msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
           {"role": "user", "content": "again"}]
  # Over the run's budget of 8: lowered, not refused, on an episode's route.
  r2 = await client.chat.completions.create(model="any", messages=msgs, temperature=0.0,
                                            max_tokens=100)
  SEEN.setdefault(task.uid, []).append([r1, r2])
  return {"answered": 1.0, "bonus": 0.5}


async def with_tool(client, task):
  """A calculator agent: runs the model's tool call and sends the result back."""
  msgs = [{"role": "user", "content": task.prompt}]
  r = await client.chat.completions.create(model="any", messages=msgs, tools=TOOLS,
                                           logprobs=True)
  call = r.choices[0].message.tool_calls[0]
  value = eval(json.loads(call.function.arguments)["expr"], {})  # "2+3" from the script
  msgs += [r.choices[0].message.model_dump(exclude_none=True),
           {"role": "tool", "tool_call_id": call.id, "content": str(value)}]
  r2 = await client.chat.completions.create(model="any", messages=msgs, tools=TOOLS,
                                            logprobs=True)
  SEEN.setdefault(task.uid, []).append([r, r2])
  return float(value == int(task.data["answer"]))


async def broken(client, task):
  if task.data["answer"] == "fail":
    raise RuntimeError("the sandbox crashed")
  if task.data["answer"] == "slow":
    await asyncio.sleep(30)
  return await twice(client, task)


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
  extra = TOOL_TOKENS + (CALL_JSON,)
  holder = {}

  def script(cfg, params, tok):
    ids = [tok.token_to_id(t) for t in extra]
    last = tok.encode_chat([{"role": "user", "content": "x"}])[-1]
    return scripted_params(cfg, params, chain([last, ids[0], ids[2], ids[1], tok.eos_id]),
                           fallback=tok.eos_id)

  tok, graphdef, params = qwen_model(tmp_path_factory.mktemp("agent"), d_model=448, tie=False,
                                     params_fn=script, extra_tokens=extra)
  server = OpenAIServer(graphdef, params, tok, model="policy", num_slots=4,
                        max_prompt_len=1024, max_new_tokens=8, compact=False,
                        prefill_buckets=(128, 1024),
                        params_source=lambda: holder["loop"].serving_source(),
                        warmup=False).start()
  server.engine.warmup(params)
  holder["graphdef"] = graphdef
  yield server, tok, params, holder
  server.stop()


def _loop(agent_server, fn, G=2, total=64, **kw):
  server, tok, params, holder = agent_server
  loop = AgentLoop(fn, server, tok, Budget(max_prompt_len=1024, max_new_tokens=8,
                                           max_total_tokens=total, max_turns=4), G, **kw)
  holder["loop"] = loop
  return loop


def _tasks(*answers):
  return [Task("calc", f"What is 2+3? ({i})", {"answer": a}, f"t{i}")
          for i, a in enumerate(answers)]


@pytest.mark.slow
def test_an_episode_is_one_trajectory_of_the_served_tokens(agent_server):
  _, tok, params, _ = agent_server
  loop = _loop(agent_server, twice)
  SEEN.clear()
  ep = loop.run(params, _tasks("5", "5"), None, 0, version=7, temperature=1.0)
  assert ep.tokens.shape == (4, 64) and not ep.failed.any()
  call = [tok.token_to_id(t) for t in (TOOL_TOKENS[0], CALL_JSON, TOOL_TOKENS[1])]
  for i, task in enumerate(ep.tasks):
    r1, r2 = SEEN[task.uid][i % 2]
    g1, g2 = r1.choices[0].model_extra["token_ids"], r2.choices[0].model_extra["token_ids"]
    assert g1 == g2 == call + [tok.eos_id]
    p1, p2 = r1.model_extra["prompt_token_ids"], r2.model_extra["prompt_token_ids"]
    obs = p2[len(p1) + len(g1):]
    assert p2[:len(p1) + len(g1)] == p1 + g1 and obs
    n = len(g1) + len(obs) + len(g2)
    # The row: the first prompt, then reply 1, the new user turn (context) and reply 2.
    assert ep.prompt_tokens[i][ep.prompt_valid[i]].tolist() == p1
    assert ep.tokens[i, :n].tolist() == g1 + obs + g2 and not ep.valid[i, n:].any()
    assert ep.mask[i, :n].tolist() == [True] * len(g1) + [False] * len(obs) + [True] * len(g2)
    assert (ep.policy_version[i][ep.mask[i]] == 7).all()
    served = [t.logprob for t in r1.choices[0].logprobs.content]
    assert ep.logprobs[i, :len(g1)].tolist() == pytest.approx(served, abs=0)
    assert ep.turns[i] == 2 and ep.metadata["agent_segments"][i] == 1
  assert ep.rewards.tolist() == [1.5] * 4
  assert ep.components == {"answered": pytest.approx([1.0] * 4), "bonus": pytest.approx([0.5] * 4)}


@pytest.mark.slow
def test_a_tool_call_turn_whose_history_re_renders_differently_is_its_own_segment(agent_server):
  _, tok, params, holder = agent_server
  SEEN.clear()
  # A row budget that holds the second request's whole prompt (the template's tool schema
  # makes it ~450 tokens).
  ep = _loop(agent_server, with_tool, G=1, total=512).run(params, _tasks("5", "6"), None, 0,
                                                           version=3, temperature=1.0)
  assert not ep.failed.any() and ep.rewards.tolist() == [1.0, 0.0] and not ep.truncated.any()
  # Qwen's template writes a past call as "<tool_call>\n{...}\n</tool_call>", not the tokens the
  # model wrote: the second request does not extend the first, so its whole prompt (context)
  # and its reply follow in the row as a second causal sequence, exactly as served.
  assert ep.metadata["agent_segments"].tolist() == [2.0, 2.0]
  call = [tok.token_to_id(t) for t in (TOOL_TOKENS[0], CALL_JSON, TOOL_TOKENS[1])]
  for i, task in enumerate(ep.tasks):
    r1, r2 = SEEN[task.uid][0]
    g1, g2 = (r.choices[0].model_extra["token_ids"] for r in (r1, r2))
    p1, p2 = (r.model_extra["prompt_token_ids"] for r in (r1, r2))
    assert g1 == call + [tok.eos_id] and p2[:len(p1) + len(g1)] != p1 + g1
    n = len(g1) + len(p2) + len(g2)
    assert ep.tokens[i, :n].tolist() == g1 + p2 + g2 and not ep.valid[i, n:].any()
    assert ep.mask[i, :n].tolist() == [True] * len(g1) + [False] * len(p2) + [True] * len(g2)
    assert ep.segment[i, :n].tolist() == [0] * len(g1) + [1] * (len(p2) + len(g2))
    assert (ep.policy_version[i][ep.mask[i]] == 3).all()
    served = [t.logprob for r in (r1, r2) for t in r.choices[0].logprobs.content]
    assert ep.logprobs[i][ep.mask[i]].tolist() == pytest.approx(served, abs=0)
  # The trainer scores the second sequence as the server did: over its own prompt alone.
  batch = TrainBatch(ep.prompt_tokens, ep.prompt_valid, ep.tokens, ep.mask, ep.logprobs,
                     np.zeros(2, np.float32), np.arange(2), np.ones(2, np.float32),
                     completion_valid=ep.valid, completion_segment=ep.segment)
  logp, _ = completion_logprobs(holder["graphdef"], params, batch, StepConfig(),
                                with_entropy=False)
  assert np.abs(np.asarray(logp)[ep.mask] - ep.logprobs[ep.mask]).max() <= 1e-5
  # Under a budget too small for it, the row is the first sequence and what fits of the second.
  cut = _loop(agent_server, with_tool, G=1).run(params, _tasks("5"), None, 0, version=3,
                                                temperature=1.0)
  assert cut.truncated.all() and cut.tokens[0].tolist() == ep.tokens[0, :64].tolist()


def test_the_calculator_example_runs_its_tool_calls(agent_server):
  """examples/calculator_agent.py's `solve` against the scripted model, which calls `calc` with
  "2+3" at every turn: the agent answers each call with "5", stops after MAX_CALLS calls, and
  its final reply (a call, not a number) earns only the tool bonus."""
  import pathlib
  import sys

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
  import calculator_agent

  _, _, params, _ = agent_server
  ep = _loop(agent_server, calculator_agent.solve, G=1).run(params, _tasks("5"), None, 0,
                                                            version=0, temperature=1.0)
  assert not ep.failed.any()
  assert ep.turns.tolist() == [calculator_agent.MAX_CALLS + 1]
  assert ep.components == {"correct": pytest.approx([0.0]), "used_tool": pytest.approx([0.1])}
  assert calculator_agent.calc('{"expr": "2+3"}') == "5"
  assert calculator_agent.calc('{"expr": "2+"}').startswith("error:")


def test_failed_and_timed_out_episodes_are_excluded(agent_server):
  _, _, params, _ = agent_server
  loop = _loop(agent_server, broken, G=1, timeout_s=3.0, max_concurrency=2)
  ep = loop.run(params, _tasks("5", "fail", "slow"), None, 0, version=1, temperature=1.0)
  assert ep.failed.tolist() == [False, True, True]
  assert ep.fail_reasons[1] == "error: RuntimeError: the sandbox crashed"
  assert ep.fail_reasons[2].startswith("timeout:")
  assert np.isnan(ep.rewards[1:]).all() and not ep.mask[1:].any() and ep.mask[0].any()
  assert ep.fail_counts() == {"error": 1, "timeout": 1}


def test_versions_follow_the_batch_each_run_serves(agent_server):
  """Forced lag at the loop's level: each batch's every token carries the version it was run
  with (the producer passes b - L), never a neighbour's."""
  _, _, params, _ = agent_server
  loop = _loop(agent_server, twice, G=1)
  for version in (0, 1, 2, 5):
    ep = loop.run(params, _tasks("5", "5"), None, 0, version=version, temperature=1.0)
    assert set(ep.policy_version[ep.mask].tolist()) == {version}


def test_trajectory_cuts_to_the_budget_and_load_agent_checks_names():
  c = Completion([1, 2, 3], [-0.1, -0.2, -0.3], [4, 4, 4], True)
  t = trajectory([([9, 9], c), ([9, 9, 1, 2, 3, 8], c)], max_total_tokens=5)
  assert (t.tokens, t.mask, t.truncated) == ([1, 2, 3, 8, 1], [True] * 3 + [False, True], True)
  assert t.logprobs == [-0.1, -0.2, -0.3, 0.0, -0.1] and t.versions == [4, 4, 4, 0, 4]
  assert load_agent("agent:test_agent_loop:twice") is twice
  for bad in ("agent:test_agent_loop", "agent:no_such_module:f", "agent:test_agent_loop:TOOLS"):
    with pytest.raises(ValueError, match="agent"):
      load_agent(bad)
