"""Agents for `task.name=agent:calculator_agent:<function>` (run with `PYTHONPATH=examples`),
written against the `openai` client only. Each gets an `openai.AsyncOpenAI` pointed at the run's
own server and a row of `agent.task` (`task.prompt`, `task.data["answer"]`); what it returns is
the reward.

- `solve`: a calculator-tool agent for a chat model with a tool-call format (Qwen2.5/3,
  Llama 3.1): it offers a `calc` tool, runs every call the model makes and sends the result back,
  for up to `MAX_CALLS` calls, then grades the model's last reply against the answer.
- `answer`: one completion of the row's prompt, graded as `add` grades (`graded`; works with
  any model, the default run's character-level one included).
- `tool`: two completions around `calc` for the default run's character-level model: a draft,
  the tool's result appended as context, the answer (one trajectory; see its docstring).
- `draft`: the model drafts first, then answers a fresh prompt the tool's result wrote (two
  causal sequences of one row, both trained; see its docstring).
"""

from __future__ import annotations

import json

from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs.expr import ExprError, evaluate

MAX_CALLS = 3
# The default run's tokenizer for task `add` (jaxrl.run.inputs: one id per character of the
# task's alphabet): what `tool` encodes the tool's text with.
ADD_TOKENIZER = CharTokenizer("0123456789+=")
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an arithmetic expression with + - * / ( ).",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]


def calc(arguments: str) -> str:
  """The tool: the value of `{"expr": ...}`, or an error message the model sees."""
  try:
    return str(evaluate(json.loads(arguments)["expr"]).value)
  except (ValueError, KeyError, TypeError, ExprError) as e:
    return f"error: {e}"


async def solve(client, task) -> dict[str, float]:
  messages = [{"role": "system", "content": "Use the calc tool, then give only the number."},
              {"role": "user", "content": f"What is {task.prompt.rstrip('=')}?"}]
  calls = 0
  while True:
    r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = r.choices[0].message
    if not message.tool_calls or calls >= MAX_CALLS:
      break
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
      calls += 1
      messages.append({"role": "tool", "tool_call_id": call.id,
                       "content": calc(call.function.arguments)})
  correct = (message.content or "").strip() == task.data["answer"]
  return {"correct": float(correct), "used_tool": 0.1 * float(calls > 0)}


def graded(choice, answer: str) -> float:
  """1.0 iff a completion choice is exactly `answer` and ended by the model's end of sequence
  (`finish_reason` "stop"), the rule of the built-in `add`: a reply cut by `max_tokens` scores 0
  even when its text is right."""
  return float(choice.finish_reason == "stop" and choice.text.strip() == answer)


async def answer(client, task) -> float:
  r = await client.completions.create(model="policy", prompt=task.prompt)
  return graded(r.choices[0], task.data["answer"])


async def lookup(client, task) -> float:
  """One completion whose prompt the tool wrote, for the default run's character-level model:
  the agent runs `calc` on the row's expression first and, when the value v has at most two
  digits, asks the model `f"{v:02d}+00="` (an `add` prompt whose answer is the tool's result,
  copied) instead of the row's own prompt; a larger value leaves the row's prompt as it is. The
  reply is graded as `add` grades. Using the tool's output is what the model learns: to copy
  the first operand of `v+00`."""
  value = int(calc(json.dumps({"expr": task.prompt.rstrip("=")})))
  prompt = f"{value:02d}+00=" if value < 100 else task.prompt
  r = await client.completions.create(model="policy", prompt=prompt)
  return graded(r.choices[0], task.data["answer"])


async def tool(client, task) -> dict[str, float]:
  """Two turns over the completions API around the `calc` tool, for the default run's
  character-level model. Turn 1: the model drafts an answer to the row's prompt ("07+35=").
  The agent runs `calc` on the row's expression and appends its result and "=" after the draft,
  as context ("07+35=41<eos>42="). Turn 2: the model answers; the reward is that answer graded as
  `add` grades (`graded`). The tool's result is what makes the answer right: copying it solves
  every row, while the model's own sums are right for a third of them after the warm-up.

  Turn 2's prompt is token ids: turn 1's prompt and reply exactly as the server returned them
  (`prompt_token_ids`, `token_ids`, the end of sequence included), then the tool's text in the
  run's tokenizer (the character tokenizer over `add`'s alphabet). It extends turn 1 token for
  token, so the episode is one trajectory: draft and answer trained, the tool's result context.
  It needs `rollout.max_total_tokens=12` (draft, result and answer, up to 4 tokens each)."""
  r1 = (await client.completions.create(model="policy", prompt=task.prompt)).choices[0]
  result = calc(json.dumps({"expr": task.prompt.rstrip("=")}))
  context = list(r1.prompt_token_ids) + list(r1.token_ids) + ADD_TOKENIZER.encode(result + "=")
  r2 = (await client.completions.create(model="policy", prompt=context)).choices[0]
  want = task.data["answer"]
  # Partial credit (under 1, so held-out accuracy still counts exact answers only): the share
  # of the answer's characters the reply has in place.
  near = sum(a == b for a, b in zip(r2.text, want)) / len(want) if r2.text else 0.0
  return {"correct": graded(r2, want), "digits": 0.1 * near}


async def draft(client, task) -> float:
  """Two completions around `calc` for the default run's character-level model, the second a
  prompt of its own. Turn 1: the model drafts an answer to the row's prompt ("07+35="). The
  agent runs `calc` on the row's expression and, when the value v has at most two digits,
  asks the model `f"{v:02d}+00="` (as `lookup` does; a larger value asks the row's prompt
  again). Turn 2's prompt does not extend turn 1's prompt and reply, so it is the episode's
  second causal sequence (`TrainBatch.completion_segment`): it sees only its own tokens, as
  the server generated it, and both replies are trained with the episode's reward, turn 2's
  answer graded as `add` grades. Needs `rollout.max_total_tokens=16` (draft, then the second
  prompt and its reply)."""
  await client.completions.create(model="policy", prompt=task.prompt)
  value = int(calc(json.dumps({"expr": task.prompt.rstrip("=")})))
  prompt = f"{value:02d}+00=" if value < 100 else task.prompt
  r = await client.completions.create(model="policy", prompt=prompt)
  return graded(r.choices[0], task.data["answer"])
