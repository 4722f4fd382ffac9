"""examples/verifiers_calculator.py: the calculator task as a `verifiers` environment, evaluated by
`vf-eval` against `python -m jaxrl.serve --openai` on local rows.

verifiers pins `openai<3`, so it may live in its own environment: the test runs the example with
the interpreter `JAXRL_VERIFIERS_PYTHON` names (one with `verifiers` installed), else with this
one when it has `verifiers`, else it is skipped."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python() -> str:
  python = os.environ.get("JAXRL_VERIFIERS_PYTHON")
  if python:
    return python
  if importlib.util.find_spec("verifiers") is None:
    pytest.skip("verifiers is not installed (or set JAXRL_VERIFIERS_PYTHON to a python that "
                "has it)")
  return sys.executable


def _tool_model(path):
  """A bigram machine that answers every chat prompt with the tool call calc("2+3")."""
  from openai_models import CALL_JSON, TOOL_TOKENS, chain, qwen_model, scripted_params

  extra = TOOL_TOKENS + (CALL_JSON,)

  def script(cfg, params, tok):
    ids = [tok.token_to_id(t) for t in extra]
    last = tok.encode_chat([{"role": "user", "content": "x"}])[-1]  # "\n" after "assistant"
    return scripted_params(cfg, params, chain([last, ids[0], ids[2], ids[1], tok.eos_id]),
                           fallback=tok.eos_id)

  qwen_model(path, d_model=448, tie=False, params_fn=script, extra_tokens=extra)


@pytest.mark.slow  # compiles and serves a tiny model, then runs vf-eval: ~60 s on 2 busy cores
def test_verifiers_drives_the_jaxrl_server(tmp_path):
  python = _python()
  pytest.importorskip("starlette")
  model = str(tmp_path / "m")
  _tool_model(model)
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": str(a + b)})
                          + "\n" for a, b in [(2, 3), (7, 8), (40, 2)]))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  server = subprocess.Popen([sys.executable, "-m", "jaxrl.serve", "--openai", "--hf", model,
                             "--port", "0", "--max_prompt_len", "1024", "--max_new_tokens", "8",
                             "--num_slots", "4"], stderr=subprocess.PIPE, text=True, env=env)
  try:
    url = None
    for line in server.stderr:
      m = re.search(r"serving 'm' at (http://127\.0\.0\.1:\d+/v1)", line)
      if m:
        url = m.group(1)
        threading.Thread(target=server.stderr.read, daemon=True, name="serve-stderr").start()
        break
    assert url, "the server never said where it listens"
    out = subprocess.run([python, os.path.join(ROOT, "examples", "verifiers_calculator.py"),
                          "--base_url", url, "--model", "m", "--path", str(rows),
                          "--output_dir", str(tmp_path / "out")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
  finally:
    server.terminate()
    server.wait(60)
  (traces,) = glob.glob(str(tmp_path / "out" / "*" / "traces.jsonl"))
  episodes = [json.loads(line) for line in open(traces)]
  assert sorted(e["task"]["data"]["answer"] for e in episodes) == ["15", "42", "5"]
  for e in episodes:
    (trace,) = e["traces"]
    assert e["ok"] and not e["errors"], e["errors"]
    roles = [n["message"]["role"] for n in trace["nodes"]]
    # system, user, then MAX_CALLS rounds of (a tool call, the tool's result), then the last
    # reply, which is again a tool call, so it has no text and scores 0 on every row.
    assert roles == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"], roles
    assert all(n["message"]["tool_calls"][0]["name"] == "calc"
               for n in trace["nodes"] if n["message"]["role"] == "assistant")
    assert [n["message"]["content"] for n in trace["nodes"]
            if n["message"]["role"] == "tool"] == ["5"] * 3  # the example's calc of "2+3"
    assert trace["rewards"]["correct"]["score"] == 0.0
