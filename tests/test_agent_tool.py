"""The calculator example's agents for the default character-level model
(examples/calculator_agent.py): `answer` and `tool` grade as the built-in `add` grades (a reply
cut by the token budget scores 0), and `tool`'s two turns around the `calc` tool become one
trajectory of exactly the tokens the server generated, the tool's result as context."""

import asyncio
import pathlib
import sys
import types

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from jaxrl.data.tokenizer import CharTokenizer  # noqa: E402
from jaxrl.envs.arithmetic import AddSource  # noqa: E402
from jaxrl.models import ModelConfig, init_model  # noqa: E402
from jaxrl.rollout.multi_turn import Budget  # noqa: E402
from jaxrl.serving.agents import AgentLoop  # noqa: E402
from jaxrl.serving.openai import OpenAIServer  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import calculator_agent  # noqa: E402

BUDGET = Budget(max_prompt_len=6, max_new_tokens=4, max_total_tokens=12, max_turns=2)


class _Completions:
  """A stand-in for `client.completions`: replies with the given choices, in order."""

  def __init__(self, choices):
    self.choices, self.prompts = list(choices), []

  async def create(self, *, model, prompt, **kw):
    self.prompts.append(prompt)
    text, reason = self.choices.pop(0)
    return types.SimpleNamespace(choices=[types.SimpleNamespace(
        text=text, finish_reason=reason, prompt_token_ids=[2, 3], token_ids=[4, 1])])


def _play(fn, choices, answer="42"):
  client = types.SimpleNamespace(completions=_Completions(choices))
  task = types.SimpleNamespace(prompt="07+35=", data={"answer": answer})
  return asyncio.run(fn(client, task)), client.completions.prompts


@pytest.mark.parametrize("reason,want", [("stop", 1.0), ("length", 0.0)])
def test_answer_grades_as_add_does(reason, want):
  # "42" then padding (decoded to nothing) fills the budget without an end of sequence: `add`
  # scores it 0, and so must the agent, or RL rewards replies the built-in task rejects.
  assert _play(calculator_agent.answer, [("42", reason)])[0] == want


def test_tool_appends_the_calculators_result_and_grades_the_second_turn():
  value, prompts = _play(calculator_agent.tool, [("41", "stop"), ("42", "stop")])
  tok = calculator_agent.ADD_TOKENIZER
  assert prompts == ["07+35=", [2, 3, 4, 1] + tok.encode("42=")]
  assert value == {"correct": 1.0, "digits": pytest.approx(0.1)}
  value, _ = _play(calculator_agent.tool, [("42", "stop"), ("41", "stop")])
  assert value == {"correct": 0.0, "digits": pytest.approx(0.05)}


def test_lookup_asks_the_tools_result_as_an_add_prompt():
  assert _play(calculator_agent.lookup, [("42", "stop")]) == (1.0, ["42+00="])
  client = types.SimpleNamespace(completions=_Completions([("122", "stop")]))
  task = types.SimpleNamespace(prompt="57+65=", data={"answer": "122"})
  # 122 has three digits: no two-digit operand holds it, so the row's own prompt is asked.
  assert asyncio.run(calculator_agent.lookup(client, task)) == 1.0
  assert client.completions.prompts == ["57+65="]


def test_draft_answers_the_tools_result_as_a_prompt_of_its_own():
  # The draft ("41") is not graded; the answer to the tool's prompt is.
  assert _play(calculator_agent.draft, [("41", "stop"), ("42", "stop")]) == (
      1.0, ["07+35=", "42+00="])
  assert _play(calculator_agent.draft, [("42", "stop"), ("41", "stop")])[0] == 0.0


@pytest.fixture(scope="module")
def char_server():
  source = AddSource(num_digits=2, seed=0, dev_size=10, val_size=10)
  tok = CharTokenizer(source.alphabet)
  assert tok.alphabet == calculator_agent.ADD_TOKENIZER.alphabet  # the run's tokenizer
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=1, num_heads=2,
                    num_kv_heads=2, head_dim=16, mlp_dim=64)
  graphdef, params = init_model(cfg, seed=0)
  holder = {}
  server = OpenAIServer(graphdef, None, tok, model="policy", num_slots=8,
                        max_prompt_len=BUDGET.max_prompt_len + BUDGET.max_total_tokens,
                        max_new_tokens=BUDGET.max_new_tokens, compact=False,
                        params_source=lambda: holder["loop"].serving_source(),
                        warmup=False).start()
  yield server, tok, params, source, holder
  server.stop()


def _recorded(agent, seen):
  """`agent`, keeping every choice the server returned to it in `seen[task.uid]`."""
  async def recorded(client, task):
    create = client.completions.create

    async def recording(**kw):
      r = await create(**kw)
      seen.setdefault(task.uid, []).append(r.choices[0])
      return r

    client.completions.create = recording
    return await agent(client, task)
  return recorded


@pytest.mark.slow
def test_a_tool_episode_is_one_trajectory_of_the_served_tokens(char_server):
  server, tok, params, source, holder = char_server
  seen = {}
  loop = AgentLoop(_recorded(calculator_agent.tool, seen), server, tok, BUDGET, 1)
  holder["loop"] = loop
  tasks = source.split("val")[:6]
  ep = loop.run(params, tasks, None, 0, version=5, temperature=1.0)
  assert not ep.failed.any() and ep.turns.tolist() == [2] * 6
  assert ep.metadata["agent_segments"].tolist() == [1.0] * 6
  for i, task in enumerate(ep.tasks):
    c1, c2 = seen[task.uid]
    g1, g2 = c1.model_extra["token_ids"], c2.model_extra["token_ids"]
    p1, p2 = c1.model_extra["prompt_token_ids"], c2.model_extra["prompt_token_ids"]
    obs = tok.encode(str(int(task.data["answer"])) + "=")
    assert p1 == tok.encode(task.prompt) and p2 == p1 + g1 + obs
    assert tok.decode(g1) == c1.text and tok.decode(g2) == c2.text
    n = len(g1) + len(obs) + len(g2)
    # The row: the first prompt, the draft (trained), the tool's result (context), the answer.
    assert ep.prompt_tokens[i][ep.prompt_valid[i]].tolist() == p1
    assert ep.tokens[i, :n].tolist() == g1 + obs + g2 and not ep.valid[i, n:].any()
    assert ep.mask[i, :n].tolist() == [True] * len(g1) + [False] * len(obs) + [True] * len(g2)
    assert (ep.policy_version[i][ep.mask[i]] == 5).all()
    want = float(c2.finish_reason == "stop" and c2.text.strip() == task.data["answer"])
    assert ep.components["correct"][i] == want
  assert np.isfinite(ep.rewards).all()


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_a_draft_episode_is_two_sequences_of_the_served_tokens(char_server):
  server, tok, params, source, holder = char_server
  seen = {}
  budget = Budget(max_prompt_len=6, max_new_tokens=4, max_total_tokens=16, max_turns=2)
  loop = AgentLoop(_recorded(calculator_agent.draft, seen), server, tok, budget, 1)
  holder["loop"] = loop
  tasks = [t for t in source.split("val") if int(t.data["answer"]) < 100][:6]
  ep = loop.run(params, tasks, None, 0, version=5, temperature=1.0)
  assert not ep.failed.any() and not ep.truncated.any()
  assert ep.metadata["agent_segments"].tolist() == [2.0] * len(tasks)
  for i, task in enumerate(ep.tasks):
    c1, c2 = seen[task.uid]
    g1, g2 = c1.model_extra["token_ids"], c2.model_extra["token_ids"]
    p1, p2 = c1.model_extra["prompt_token_ids"], c2.model_extra["prompt_token_ids"]
    assert p2 == tok.encode(f"{int(task.data['answer']):02d}+00=")
    # The row: the first prompt, the draft (trained), then the tool's prompt (context) and the
    # answer (trained) as the second sequence.
    n = len(g1) + len(p2) + len(g2)
    assert ep.prompt_tokens[i][ep.prompt_valid[i]].tolist() == p1
    assert ep.tokens[i, :n].tolist() == g1 + p2 + g2 and not ep.valid[i, n:].any()
    assert ep.mask[i, :n].tolist() == [True] * len(g1) + [False] * len(p2) + [True] * len(g2)
    assert ep.segment[i, :n].tolist() == [0] * len(g1) + [1] * (len(p2) + len(g2))
    assert (ep.policy_version[i][ep.mask[i]] == 5).all()
    assert ep.rewards[i] == float(c2.finish_reason == "stop" and
                                  c2.text.strip() == task.data["answer"])


CALLS: list[str] = []


async def counted(client, task):
  """`answer`, counting the episodes it plays."""
  CALLS.append(task.uid)
  return await calculator_agent.answer(client, task)


@pytest.mark.slow  # three dev passes, each building a run's parts: 94 s on 2 busy cores
def test_the_warmups_dev_accuracy_is_the_rows_own_task_unless_asked():
  import jax

  from jaxrl import config as config_lib
  from jaxrl.run import parts as parts_lib
  from jaxrl.run.validation import Evaluator

  from test_bad_input import _tiny_cfg

  def dev_pass(**over):
    cfg = _tiny_cfg(**over)
    parts, params = parts_lib.build_parts(cfg, config_lib.validate(cfg, jax.device_count()))
    return Evaluator(parts, asynchronous=False).evaluate(params, "dev")

  CALLS.clear()
  builtin = dev_pass()
  agent = dev_pass(task__name="agent:test_agent_tool:counted")
  # The same params (same seed, same alphabet), the same rows, the same sampler: the same pass,
  # and no episode was played through the agent.
  assert agent == builtin and CALLS == []
  dev_pass(task__name="agent:test_agent_tool:counted", agent__warmup_through_agent=True)
  assert len(CALLS) == 16  # task.dev_size rows, one sample each


def test_every_episode_of_a_batch_runs_at_once_by_default(char_server):
  """max_concurrency=0: all of a batch's episodes are in flight together (an agent that waits
  for all six to start finishes), over one connection pool; with a bound of 2 the first four
  give up waiting (two at a time) before the last two start."""
  server, tok, params, source, holder = char_server
  tasks = source.split("val")[:3]
  started = []

  async def together(client, task):
    started.append(task.uid)
    for _ in range(50):
      if len(started) >= 6:
        return await calculator_agent.answer(client, task)
      await asyncio.sleep(0.01)
    raise RuntimeError(f"only {len(started)} episodes started")

  for bound, failed in ((0, [False] * 6), (2, [True] * 4 + [False] * 2)):
    started.clear()
    loop = AgentLoop(together, server, tok, BUDGET, 2, max_concurrency=bound)
    holder["loop"] = loop
    ep = loop.run(params, tasks, None, 0, version=0, temperature=1.0)
    assert ep.failed.tolist() == failed, ep.fail_reasons
