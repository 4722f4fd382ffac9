"""The calculator task of `calculator_agent.py` as a `verifiers` environment (the PyPI package,
0.4's `verifiers.v1` API), on local rows, evaluated against any OpenAI-compatible endpoint, e.g.
`python -m jaxrl.serve --openai`:

    python examples/verifiers_calculator.py --base_url http://127.0.0.1:8000/v1 --model NAME \\
        [-n 8] [--path rows.jsonl] [--output_dir outputs]

It needs only `verifiers` (which pins `openai<3`; jaxrl is not imported, so it can run from its
own environment: `pip install verifiers`). The module is at once the taskset and its harness,
which is how verifiers finds them by id (`verifiers_calculator`, importable from this directory):

- `CalculatorTaskset`: rows of a JSONL file (`--env.taskset.path`; {"question", "answer"} per
  line) or, without one, `ROWS` additions written here; the reward is exact match of the last
  reply with the answer.
- `CalculatorHarness`: the agent loop of `calculator_agent.solve`, run in-process (verifiers'
  harness contract allows it: every model call goes through the interception endpoint it is
  given): it offers a `calc` tool, runs each call the model makes and sends the result back, up
  to `MAX_CALLS` calls, then the model's last reply is graded. The built-in harnesses (`bash`,
  `null`) instead install their program with `uv` at run time, which needs the network.

`main` runs `vf-eval` with the subprocess runtime (no container, no sandbox service), the eval
client pointed at `--base_url`, without its worker pool, dashboard or upload; the traces land in
`<output_dir>/<run>/traces.jsonl`.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

MAX_CALLS = 3
SYSTEM = "Use the calc tool, then give only the number."
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an arithmetic expression with + - * / ( ).",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]
ROWS = [{"question": f"What is {a}+{b}?", "answer": str(a + b)}
        for a, b in [(12, 30), (7, 8), (25, 17), (3, 9), (41, 2), (16, 16), (5, 60), (9, 11)]]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calc(arguments: str) -> str:
  """The tool: the value of `{"expr": ...}` (numbers, + - * / and parentheses only), or an
  error message the model sees."""
  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](value(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")
  try:
    v = value(ast.parse(json.loads(arguments)["expr"], mode="eval").body)
  except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError) as e:
    return f"error: {e}"
  return str(int(v)) if float(v).is_integer() else str(v)


class CalculatorData(vf.TaskData):
  answer: str


class CalculatorTask(vf.Task[CalculatorData]):
  @vf.reward
  async def correct(self, trace: vf.Trace) -> float:
    return float((trace.last_reply or "").strip() == self.data.answer)


class CalculatorConfig(vf.TasksetConfig):
  path: str = ""  # a JSONL file of {"question", "answer"} rows; "" = ROWS


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
  def load(self) -> list[CalculatorTask]:
    rows = ROWS
    if self.config.path:
      with open(self.config.path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [CalculatorTask(CalculatorData(idx=i, prompt=r["question"], answer=str(r["answer"])),
                           self.config.task) for i, r in enumerate(rows)]


class CalculatorHarnessConfig(vf.HarnessConfig):
  pass


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
  APPENDS_SYSTEM_PROMPT = True
  EXECUTES_CODE = False
  NEEDS_CONTAINER = False

  async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                   tool_interception_url=None) -> ProgramResult:
    import openai

    _, prompt = self.resolve_text_prompt(data)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
    calls = 0
    try:
      while True:
        r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                 tools=TOOLS)
        message = r.choices[0].message
        if not message.tool_calls or calls >= MAX_CALLS:
          break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
          calls += 1
          messages.append({"role": "tool", "tool_call_id": call.id,
                           "content": calc(call.function.arguments)})
    finally:
      await client.close()
    return ProgramResult(exit_code=0, stdout=json.dumps({"tool_calls": calls}), stderr="")


__all__ = ["CalculatorTaskset", "CalculatorHarness"]


def main(argv: list[str] | None = None) -> None:
  import argparse

  from verifiers.v1.cli.eval.main import main as vf_eval

  p = argparse.ArgumentParser(description="Evaluate the calculator task with verifiers.")
  p.add_argument("--base_url", required=True, help="an OpenAI-compatible API, .../v1")
  p.add_argument("--model", required=True, help="the model name the endpoint serves")
  p.add_argument("-n", type=int, default=len(ROWS), help="rows to evaluate")
  p.add_argument("--path", default="", help="JSONL rows {question, answer} (default: ROWS)")
  p.add_argument("--output_dir", default="outputs", help="where verifiers writes the run")
  p.add_argument("--temperature", type=float, default=0.0)
  args = p.parse_args(argv)
  here = os.path.dirname(os.path.abspath(__file__))
  if here not in sys.path:  # verifiers imports the taskset and harness by id
    sys.path.insert(0, here)
  os.environ.setdefault("OPENAI_API_KEY", "none")
  vf_eval(["verifiers_calculator", "--env.taskset.path", args.path,
           "--env.agent.runtime.type", "subprocess", "--model", args.model,
           "--client.base_url", args.base_url, "--client.api_key_var", "OPENAI_API_KEY",
           "--sampling.temperature", str(args.temperature), "-n", str(args.n),
           "--output_dir", args.output_dir, "--no-rich", "--no-push"])


if __name__ == "__main__":
  main()
