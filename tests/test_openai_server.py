"""The OpenAI-compatible server against the `openai` package's own client: chat (with and without
tools, streamed and not) and completions parse in the client's types, the returned token ids
decode to the returned text, the log-probs equal the trainer's recompute, and bad requests get
OpenAI error objects while the server keeps serving."""

import functools
import json

import httpx
import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from openai_models import CALL_JSON, TOOL_TOKENS, chain, qwen_model, scripted_params  # noqa: E402
from jaxrl.core.types import TrainBatch  # noqa: E402
from jaxrl.learner.step import StepConfig, completion_logprobs  # noqa: E402
from jaxrl.serving.openai import OpenAIServer  # noqa: E402

LP, N = 128, 12
USER = [{"role": "user", "content": "What is 12 + 30?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A random tiny Qwen2-style model (real tokenizer and checkpoint files) behind the server."""
  tok, graphdef, params = qwen_model(tmp_path_factory.mktemp("random"))
  server = OpenAIServer(graphdef, params, tok, model="tiny", num_slots=4, max_prompt_len=LP,
                        max_new_tokens=N, compact=False, prefill_buckets=(32, LP)).start()
  client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
  yield server, client, tok, graphdef, params
  server.stop()


@pytest.fixture(scope="module")
def tool_served(tmp_path_factory):
  """A bigram machine that answers every chat prompt with one tool call, then <|im_end|>."""
  extra = TOOL_TOKENS + (CALL_JSON,)

  def script(cfg, params, tok):
    ids = [tok.token_to_id(t) for t in extra]
    # A chat prompt ends with "<|im_start|>assistant\n": its last token starts the call.
    last = tok.encode_chat(USER)[-1]
    return scripted_params(cfg, params, chain([last, ids[0], ids[2], ids[1], tok.eos_id]),
                           fallback=tok.eos_id)

  tok, graphdef, params = qwen_model(tmp_path_factory.mktemp("tools"), d_model=448, tie=False,
                                     params_fn=script, extra_tokens=extra)
  server = OpenAIServer(graphdef, params, tok, model="tiny-tools", num_slots=2,
                        max_prompt_len=1024, max_new_tokens=8, compact=False,
                        prefill_buckets=(128, 1024)).start()
  client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
  yield server, client, tok
  server.stop()


def test_chat_parses_and_token_ids_decode_to_the_text(served):
  server, client, tok, _, _ = served
  r = client.chat.completions.create(model="tiny", messages=USER, logprobs=True, n=2,
                                     temperature=1.0, max_tokens=N)
  assert isinstance(r, ChatCompletion) and len(r.choices) == 2
  want_prompt = tok.encode_chat(USER)
  assert r.model_extra["prompt_token_ids"] == want_prompt
  for ch in r.choices:
    ids = ch.model_extra["token_ids"]
    assert ch.model_extra["prompt_token_ids"] == want_prompt
    assert 1 <= len(ids) <= N and tok.decode(ids) == ch.message.content
    assert [t.logprob for t in ch.logprobs.content] == pytest.approx(
        [t.logprob for t in ch.logprobs.content])
    assert len(ch.logprobs.content) == len(ids)
    assert ch.model_extra["policy_versions"] == [0] * len(ids)
    assert ch.finish_reason == ("stop" if ids[-1] in tok.eos_ids else "length")
  assert r.usage.prompt_tokens == len(want_prompt)
  assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)


def _recompute(graphdef, params, rows, temperature):
  """The trainer's log-probs (`completion_logprobs`) of each (prompt, completion) row."""
  b = len(rows)
  prompts, valid = np.zeros((b, LP), np.int32), np.zeros((b, LP), bool)
  tokens, mask = np.zeros((b, N), np.int32), np.zeros((b, N), bool)
  for i, (p, c) in enumerate(rows):
    prompts[i, LP - len(p):], valid[i, LP - len(p):] = p, True
    tokens[i, :len(c)], mask[i, :len(c)] = c, True
  batch = TrainBatch(prompts, valid, tokens, mask, np.zeros((b, N), np.float32),
                     np.zeros(b, np.float32), np.arange(b), np.full(b, temperature, np.float32))
  logp, _ = _jitted_logprobs(graphdef)(params, batch)
  return np.asarray(logp), mask


@functools.lru_cache(maxsize=None)
def _jitted_logprobs(graphdef):
  # One program for both temperatures (a batch field), not a compile per small op.
  return jax.jit(lambda params, batch: completion_logprobs(graphdef, params, batch, StepConfig(),
                                                           with_entropy=False))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_trainer_recompute(served, temperature):
  server, client, tok, graphdef, params = served
  chat = client.chat.completions.create(model="tiny", messages=USER, logprobs=True, n=3,
                                        temperature=temperature)
  comp = client.completions.create(model="tiny", prompt=["What is", [5, 6, 7, 8]], logprobs=0,
                                   temperature=temperature)
  assert isinstance(comp, Completion) and len(comp.choices) == 2
  rows, got = [], []
  for ch in chat.choices:
    rows.append((ch.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]))
    got.append([t.logprob for t in ch.logprobs.content])
  for ch in comp.choices:
    rows.append((ch.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]))
    got.append(ch.logprobs.token_logprobs)
    assert tok.decode(ch.model_extra["token_ids"]) == ch.text
  assert comp.choices[1].model_extra["prompt_token_ids"] == [5, 6, 7, 8]
  assert comp.choices[0].model_extra["prompt_token_ids"] == tok.encode("What is")
  want, mask = _recompute(graphdef, params, rows, temperature)
  served_lp = np.zeros_like(want)
  for i, g in enumerate(got):
    served_lp[i, :len(g)] = g
  diff = np.abs(np.where(mask, want - served_lp, 0))
  assert diff.max() <= 1e-5, diff.max()
  # Not vacuous: a random model over ~400 ids gives log-probs far from 0.
  assert np.abs(served_lp[mask]).mean() > 1.0


def test_streamed_chat_and_completion_join_to_their_token_ids(served):
  _, client, tok, _, _ = served
  chunks = list(client.chat.completions.create(model="tiny", messages=USER, stream=True,
                                               logprobs=True,
                                               stream_options={"include_usage": True}))
  assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
  body = [c for c in chunks if c.choices]
  text = "".join(c.choices[0].delta.content or "" for c in body)
  ids = [t for c in body for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
  assert ids and tok.decode(ids) == text
  assert body[0].choices[0].delta.role == "assistant"
  assert body[-1].choices[0].finish_reason in ("stop", "length")
  assert chunks[-1].usage.completion_tokens == len(ids)
  parts = list(client.completions.create(model="tiny", prompt="The answer", stream=True))
  ids = [t for p in parts for t in (p.choices[0].model_extra or {}).get("token_ids", [])]
  assert tok.decode(ids) == "".join(p.choices[0].text for p in parts)


def test_models_lists_the_served_model(served):
  _, client, _, _, _ = served
  assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.slow  # its own model and server: ~30 s on 2 busy cores
def test_tool_calls_are_parsed_into_tool_calls(tool_served):
  _, client, tok = tool_served
  r = client.chat.completions.create(model="tiny-tools", messages=USER, tools=TOOLS)
  ch = r.choices[0]
  call_ids = [tok.token_to_id(t) for t in (TOOL_TOKENS[0], CALL_JSON, TOOL_TOKENS[1])]
  assert ch.model_extra["token_ids"] == call_ids + [tok.eos_id]
  assert ch.finish_reason == "tool_calls" and ch.message.content is None
  (call,) = ch.message.tool_calls
  assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "2+3"}
  # The tools were rendered into the prompt by the template.
  assert '"name": "calc"' in tok.decode(r.model_extra["prompt_token_ids"])
  # Without tools the same reply stays text.
  plain = client.chat.completions.create(model="tiny-tools", messages=USER)
  assert plain.choices[0].message.tool_calls is None
  assert plain.choices[0].message.content == f"<tool_call>{CALL_JSON}</tool_call>"
  # Streamed: the call arrives as a tool_calls delta.
  chunks = list(client.chat.completions.create(model="tiny-tools", messages=USER, tools=TOOLS,
                                               stream=True))
  deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
  assert [d.function.name for d in deltas] == ["calc"]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  # The call goes back into the conversation (arguments as the JSON string the client holds).
  follow = USER + [ch.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "5"}]
  again = client.chat.completions.create(model="tiny-tools", messages=follow, tools=TOOLS)
  text = tok.backend_tokenizer.decode(again.model_extra["prompt_token_ids"],
                                      skip_special_tokens=False)
  assert '{"name": "calc", "arguments": {"expr": "2+3"}}' in text and "<tool_response>\n5" in text


def _post(server, path, content, **kw):
  return httpx.post(f"{server.url}{path}", content=content,
                    headers={"content-type": "application/json"}, timeout=60, **kw)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
  server, client, _, _, _ = served
  r = _post(server, "/chat/completions", b'{"model": "tiny", "messages": [')
  assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4o", messages=USER)
  assert e.value.body["code"] == "model_not_found"
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                             "content": "word " * 400}])
  assert e.value.body["code"] == "context_length_exceeded"
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt=list(range(1, LP + 2)))
  assert e.value.body["code"] == "context_length_exceeded"
  for tools, param in [([{"type": "function", "function": {"name": ""}}], "tools[0].function"),
                       ([{"type": "retrieval"}], "tools[0]"),
                       ([{"type": "function", "function": {"name": "f", "parameters": []}}],
                        "tools[0].function.parameters")]:
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model="tiny", messages=USER, tools=tools)
    assert e.value.body["param"] == param, e.value.body
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=USER, temperature=-1)
  assert e.value.body["param"] == "temperature"
  with pytest.raises(openai.BadRequestError):
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=N + 1)
  r = httpx.get(f"{server.url}/nowhere", timeout=60)
  assert r.status_code == 404 and "error" in r.json()
  # A client that drops its stream after the first event.
  with httpx.stream("POST", f"{server.url}/chat/completions", timeout=60,
                    json={"model": "tiny", "messages": USER, "stream": True}) as s:
    assert s.status_code == 200
    first = next(s.iter_lines())
    assert first.startswith("data: ")
  ok = client.chat.completions.create(model="tiny", messages=USER)
  assert ok.choices[0].model_extra["token_ids"]
  server.check()
  assert httpx.get(f"{server.url[:-3]}/health", timeout=60).json()["status"] == "ok"


def test_concurrent_clients_are_batched_into_engine_runs(served):
  import concurrent.futures

  server, client, tok, _, _ = served
  d = server.dispatcher
  batches, rows = d.batches, d.rows
  with concurrent.futures.ThreadPoolExecutor(12) as pool:
    replies = list(pool.map(lambda i: client.completions.create(
        model="tiny", prompt=f"What is {i}", max_tokens=4), range(12)))
  assert all(tok.decode(r.choices[0].model_extra["token_ids"]) == r.choices[0].text
             for r in replies)
  assert d.rows - rows == 12
  # 12 requests, each waiting while a run is in flight: fewer runs than requests.
  assert d.batches - batches < 12


def test_a_dead_engine_thread_fails_its_requests_and_says_so(served):
  from jaxrl.serving.dispatcher import Dispatcher, Job

  server = served[0]

  def broken_source():
    raise RuntimeError("params are gone")

  d = Dispatcher(server.engine, broken_source).start()
  future = d.submit(Job([5, 6, 7]))
  with pytest.raises(RuntimeError, match="params are gone"):
    future.result(timeout=60)
  assert not d.alive() and isinstance(d.error, RuntimeError)
  with pytest.raises(RuntimeError, match="the engine thread failed"):
    d.submit(Job([5, 6, 7]))
