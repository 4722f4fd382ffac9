"""`python -m jaxrl.evaluate --endpoint URL`: a bad or unreachable endpoint ends as one line naming
the URL before anything is written; against `python -m jaxrl.serve --openai` on a tiny Hugging
Face checkpoint, greedy evaluation through the endpoint gives the in-process evaluation's numbers
and per-row correctness, and an agent task plays its episodes through it."""

import http.server
import json
import os
import re
import subprocess
import sys
import threading

import pytest

from jaxrl import recipes
from jaxrl.cli import evaluate
from jaxrl.run.inputs import task_source
from processes import free_port

pytest.importorskip("openai")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _fails(capsys, argv) -> str:
  assert evaluate.main(argv) == 1
  err = capsys.readouterr().err
  assert err.startswith("jaxrl: ") and err.count("\n") == 1, err
  return err


class _Fake(http.server.BaseHTTPRequestHandler):
  """GET /v1/models: a list naming the model "m"; anything else: 404."""

  def do_GET(self):  # noqa: N802
    body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                   "owned_by": "x"}]}).encode()
    status = 200 if self.path == "/v1/models" else 404
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


@pytest.fixture
def fake_server():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
  t = threading.Thread(target=server.serve_forever, daemon=True, name="fake-openai")
  t.start()
  yield f"http://127.0.0.1:{server.server_address[1]}"
  server.shutdown()
  t.join(10)


def test_bad_endpoints_end_as_one_line_naming_the_url_and_write_nothing(tmp_path, capsys,
                                                                        fake_server):
  out = tmp_path / "eval.json"
  closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
  err = _fails(capsys, ["--endpoint", closed, "--out", str(out)])
  assert f"cannot reach the endpoint {closed}" in err
  err = _fails(capsys, ["--endpoint", fake_server, "--out", str(out)])  # no /v1: GET /models 404s
  assert f"the endpoint {fake_server} answered GET /models with HTTP 404" in err
  err = _fails(capsys, ["--endpoint", fake_server + "/v1", "--model", "x", "--out", str(out)])
  assert f"--model='x': the endpoint {fake_server}/v1 serves 'm'" in err
  err = _fails(capsys, ["--endpoint", "127.0.0.1:8000/v1", "--out", str(out)])
  assert "--endpoint='127.0.0.1:8000/v1' is not an http:// or https:// URL" in err
  err = _fails(capsys, ["--endpoint", fake_server + "/v1", "--concurrency", "0"])
  assert "--concurrency=0 must be >= 1" in err
  # A bad key or task is named before the endpoint is asked anything.
  err = _fails(capsys, ["--endpoint", closed, "--config.val.bach_size=3"])
  assert "val.bach_size" in err and "endpoint" not in err
  err = _fails(capsys, ["--endpoint", closed, "--task", "nope"])
  assert "unknown task 'nope'" in err
  assert not out.exists() and not list(tmp_path.iterdir())


def test_endpoint_flags_need_endpoint(capsys):
  with pytest.raises(SystemExit) as e:
    evaluate.main(["--hf", "x", "--model", "m"])
  assert e.value.code == 1
  assert "--model, --concurrency and --timeout need --endpoint" in capsys.readouterr().err


def _answering_model(path):
  """A bigram machine that answers every chat prompt "#### 3" then <|im_end|> (so exactly the
  rows whose answer is 3 are solved) -> its tokenizer."""
  from openai_models import chain, qwen_model, scripted_params

  extra = ("#### 3",)

  def script(cfg, params, tok):
    last = tok.encode_chat([{"role": "user", "content": "x"}])[-1]  # "\n" after "assistant"
    return scripted_params(cfg, params, chain([last, tok.token_to_id(extra[0]), tok.eos_id]),
                           fallback=tok.eos_id)

  tok, _, _ = qwen_model(path, d_model=448, tie=False, params_fn=script, extra_tokens=extra)
  return tok


def _serve(model_dir, *flags):
  """`python -m jaxrl.serve --openai --hf model_dir` on a free port -> (process, its URL)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-m", "jaxrl.serve", "--openai", "--hf", model_dir,
                           "--port", "0", *flags], stderr=subprocess.PIPE, text=True, env=env)
  for line in proc.stderr:
    m = re.search(r"serving '[^']+' at (http://127\.0\.0\.1:\d+/v1)", line)
    if m:
      # Keep reading its stderr, so a chatty server never blocks on a full pipe.
      threading.Thread(target=proc.stderr.read, daemon=True, name="serve-stderr").start()
      return proc, m.group(1)
  proc.wait(10)
  raise AssertionError("the server never said where it listens")


@pytest.mark.slow  # a served and an in-process tiny model, compiled: ~3 min on 2 busy cores
def test_greedy_evaluation_through_the_endpoint_equals_in_process(tmp_path, monkeypatch):
  pytest.importorskip("starlette")
  model = str(tmp_path / "m")
  _answering_model(model)
  data = tmp_path / "qa.jsonl"
  data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"})
                          + "\n" for a in range(4) for b in range(5)))
  recipe = os.path.join(os.path.dirname(recipes.__file__), "qwen2_5_0_5b_gsm8k.py")
  common = ["--config", recipe, "--task", "math", "--split", "train", "--batch_size", "8",
            f"--config.task.path={data}", "--config.task.val_path=",
            "--config.model.dtype=float32", "--config.rollout.max_new_tokens=8"]
  multi_turn = ["--config", recipe, "--task", "guess", "--config.model.dtype=float32",
                "--config.rollout.max_new_tokens=8", "--config.rollout.max_turns=3",
                "--config.rollout.max_total_tokens=24"]
  proc, url = _serve(model, "--max_prompt_len", "256", "--max_new_tokens", "8",
                     "--num_slots", "4")
  try:
    via = tmp_path / "via.json"
    assert evaluate.main(["--endpoint", url, "--concurrency", "3", "--out", str(via),
                          *common]) == 0
    # The agent task through the same endpoint: `answer` sends each row's prompt as a
    # completion with model="policy", which the evaluation serves as the endpoint's model "m".
    # A multi-turn task whose completion budget (24 tokens) ends episodes before max_turns.
    guess = tmp_path / "guess.json"
    assert evaluate.main(["--endpoint", url, "--out", str(guess), *multi_turn]) == 0
    monkeypatch.syspath_prepend(EXAMPLES)
    agent = tmp_path / "agent.json"
    assert evaluate.main(["--endpoint", url, "--out", str(agent), "--task",
                          "agent:calculator_agent:answer", "--config.task.val_size=6"]) == 0
  finally:
    proc.terminate()
    proc.wait(60)
  here = tmp_path / "here.json"
  assert evaluate.main(["--hf", model, "--out", str(here), *common]) == 0
  got, want = json.loads(via.read_text()), json.loads(here.read_text())
  assert (got["endpoint"], got["model"], got["prompts"]) == (url, "m", want["prompts"])
  # 20 rows, a seeded 10% held out: 18 train prompts. Every reply is "#### 3" + EOS (2 tokens);
  # exactly the rows whose answer is 3 are solved.
  solved = {r["uid"]: r["solved"] for r in got["rows"]}
  assert len(solved) == 18 and all(r["length"] == 2 and r["error"] is None for r in got["rows"])
  flags = [a for a in ["--endpoint", url, *common] if not a.startswith("--config.")]
  cfg = evaluate.build_config(evaluate.parser().parse_args(flags),
                              [a for a in common if a.startswith("--config.")])
  answers = {t.uid: t.data["answer"] for t in task_source(cfg).split("train")}
  assert solved == {uid: answers[uid] == "3" for uid in solved}, solved
  assert 0 < got["accuracy"] < 1
  for key in ("accuracy", "pass@1", "avg_length"):
    assert got[key] == want[key], key
  for key in ("val/reward", "val/turns/mean", "val/terminated_frac", "val/truncated_frac",
              "val/failed_frac", "val/env_calls"):
    assert got["metrics"][key] == want["metrics"][key], key
  guess_here = tmp_path / "guess_here.json"
  assert evaluate.main(["--hf", model, "--out", str(guess_here), *multi_turn]) == 0
  got, want = json.loads(guess.read_text()), json.loads(guess_here.read_text())
  assert got["metrics"] == want["metrics"]
  assert 1 < got["metrics"]["val/turns/mean"] < 3 and got["metrics"]["val/truncated_frac"] == 1
  # The agent's requests were served (model rewritten): every episode made one request and got
  # a reply of one token (the bigram machine's EOS after a plain-text prompt's last token).
  a = json.loads(agent.read_text())
  assert a["prompts"] == 6 and a["metrics"]["val/failed_frac"] == 0.0
  assert all(r["turns"] == 1 and r["length"] == 1 for r in a["rows"]), a["rows"]
