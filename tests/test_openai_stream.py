"""Token-live streaming: the server sends each token's chunk as the engine makes it (after the
decode dispatch that drew it), not once the row has ended; a reply cut by `max_tokens` and a
client that disconnects mid-stream end their row at the next dispatch, freeing its slot, and the
server keeps serving. The engine is slowed through its params source (asked before every
dispatch), so a row of 16 tokens spans well over half a second of dispatches."""

import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from openai_models import qwen_model  # noqa: E402
from jaxrl.serving.openai import OpenAIServer  # noqa: E402

N, PAUSE_S = 32, 0.05
USER = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def slow_served(tmp_path_factory):
  """A random tiny model; one decode step per dispatch, each dispatch at least PAUSE_S."""
  tok, graphdef, params = qwen_model(tmp_path_factory.mktemp("stream"))

  def source():
    time.sleep(PAUSE_S)
    return 0, params

  server = OpenAIServer(graphdef, params, tok, model="tiny", num_slots=2, max_prompt_len=128,
                        max_new_tokens=N, steps_per_dispatch=1, compact=False,
                        prefill_buckets=(32, 128), params_source=source).start()
  client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
  yield server, client, tok
  server.stop()


def _wait_for(predicate, timeout=60.0):
  t0 = time.monotonic()
  while not predicate():
    assert time.monotonic() - t0 < timeout, "timed out"
    time.sleep(0.05)


def test_chunks_arrive_while_the_row_is_still_being_generated(slow_served):
  server, client, tok = slow_served
  stats = server.engine.stats
  start, cancels = stats["dispatch"], stats["cancel"]
  seen, text = [], ""  # (token ids of the chunk, engine dispatches so far when it arrived)
  for chunk in client.completions.create(model="tiny", prompt="The answer", max_tokens=16,
                                         stream=True):
    seen.append((chunk.choices[0].model_extra.get("token_ids") or [], stats["dispatch"]))
    text += chunk.choices[0].text
  ids = [t for got, _ in seen for t in got]
  assert 8 <= len(ids) <= 16 and tok.decode(ids) == text
  # Token 1 is drawn at admission and token k (k > 1) by the row's (k-1)-th dispatch, so the
  # row's last token comes out of dispatch start + len(ids) - 1 at the earliest. The first
  # token's chunk arrived well before that, and the chunks arrived over many dispatches.
  first_at = next(d for got, d in seen if got)
  last_at = [d for got, d in seen if got][-1]
  assert first_at - start < len(ids) - 1 - 4, (first_at, start, len(ids))
  assert last_at - first_at >= 4
  if len(ids) == 16 and ids[-1] not in tok.eos_ids:
    # Cut by max_tokens (16 < the engine's 32): the row ended there, not at 32 tokens.
    _wait_for(lambda: stats["cancel"] == cancels + 1)


def test_streamed_chat_text_joins_to_its_token_ids(slow_served):
  _, client, tok = slow_served
  chunks = list(client.chat.completions.create(model="tiny", messages=USER, stream=True,
                                               logprobs=True, max_tokens=6,
                                               stream_options={"include_usage": True}))
  body = [c for c in chunks if c.choices]
  ids = [t for c in body for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
  versions = [v for c in body for v in (c.choices[0].model_extra or {}).get("policy_versions",
                                                                            [])]
  assert 1 <= len(ids) <= 6 and versions == [0] * len(ids)
  assert tok.decode(ids) == "".join(c.choices[0].delta.content or "" for c in body)
  assert sum(len(c.choices[0].logprobs.content) for c in body if c.choices[0].logprobs) == len(ids)
  assert body[-1].choices[0].finish_reason in ("stop", "length")
  assert chunks[-1].usage.completion_tokens == len(ids)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(slow_served):
  server, client, _ = slow_served
  stats, d = server.engine.stats, server.dispatcher
  cancels, rows = stats["cancel"], d.rows
  with httpx.stream("POST", f"{server.url}/completions", timeout=60,
                    json={"model": "tiny", "prompt": "The answer", "stream": True}) as s:
    assert s.status_code == 200
    got = next(line for line in s.iter_lines() if line.startswith("data: "))
    assert '"token_ids"' in got
    at = stats["dispatch"]
  # The row (budget N = 32 tokens) ends at the next dispatch after the server sees the close.
  _wait_for(lambda: d.rows == rows + 1)
  assert stats["cancel"] == cancels + 1 and stats["dispatch"] - at < N // 2
  ok = client.completions.create(model="tiny", prompt="The answer", max_tokens=2)
  assert len(ok.choices[0].model_extra["token_ids"]) >= 1
  server.check()
