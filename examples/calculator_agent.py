"""Agents for `task.name=agent:calculator_agent:<function>` (run with `PYTHONPATH=examples`),
written against the `openai` client only. Each gets an `openai.AsyncOpenAI` pointed at the run's
own server and a row of `agent.task` (`task.prompt`, `task.data["answer"]`); what it returns is
the reward.

- `solve`: a calculator-tool agent for a chat model with a tool-call format (Qwen2.5/3,
  Llama 3.1): it offers a `calc` tool, runs every call the model makes and sends the result back,
  for up to `MAX_CALLS` calls, then grades the model's last reply against the answer.
- `answer`: one completion of the row's prompt, graded by exact match (works with any model,
  the default run's character-level one included).
"""

from __future__ import annotations

import json

from jaxrl.envs.expr import ExprError, evaluate

MAX_CALLS = 3
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


async def answer(client, task) -> float:
  r = await client.completions.create(model="policy", prompt=task.prompt)
  return float(r.choices[0].text.strip() == task.data["answer"])
