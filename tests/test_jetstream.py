"""JetStream adapter: jaxrl's engine under JetStream's real orchestrator returns the same tokens
as `Engine.run`, in-process and through `scripts/serve.py`'s gRPC server.

Needs the `jetstream` extra (`scripts/install_jetstream.sh`); skipped without it. Any exception
on JetStream's engine threads SIGKILLs the process, so run these with `PYTHONUNBUFFERED=1
pytest -s -m jetstream` when one dies without a report.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

pytest.importorskip("jetstream")

from conftest import tiny_model_config  # noqa: E402
from processes import free_port  # noqa: E402
from jaxrl.data.tokenizer import CharTokenizer  # noqa: E402
from jaxrl.models import init_model  # noqa: E402
from jaxrl.rollout.engine import Engine  # noqa: E402
from jaxrl.serving.jetstream_engine import (BOS_SENTINEL, JaxrlJetStreamEngine,  # noqa: E402
                                            JaxrlTokenizer, orchestrator)

from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.jetstream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE = os.path.join(ROOT, "scripts", "serve.py")
N, SLOTS, PROMPT_LEN = 10, 2, 16
# 30 characters + pad + eos = the tiny model's 32 ids.
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,?"
# 5 prompts for 2 slots: slots are reused, and requests queue behind the busy ones.
PROMPTS = ["hello world", "abc", "the quick brown", "z", "jax"]


class TwoEndTokenizer(CharTokenizer):
  """A character tokenizer whose model also ends at 'u' (id 22), which this model (seed 0)
  emits early for some prompts: both ways a request ends (an end id, the token budget) run,
  and the second end id checks that every `eos_ids` entry is a JetStream stop token."""

  eos_ids = (1, 22)


@pytest.fixture(scope="module")
def model():
  graphdef, params = init_model(tiny_model_config(), seed=0)
  return graphdef, params, TwoEndTokenizer(ALPHABET)


def _reference_engine(graphdef, stop, pad_id):
  return Engine(graphdef, num_slots=SLOTS, max_prompt_len=PROMPT_LEN, max_new_tokens=N,
                eos_id=tuple(sorted(stop)), pad_id=pad_id)


@pytest.fixture(scope="module")
def reference(model):
  """jaxrl's own engine for the tiny model, with the end ids JetStream stops at (pad too)."""
  graphdef, _, tok = model
  return _reference_engine(graphdef, set(tok.eos_ids) | {tok.pad_id}, tok.pad_id)


def _reference(engine, params, prompts, *, temperature=0.0, top_k=0, top_p=1.0, seed=0):
  """What the JetStream stream must be: `Engine.run` with request r = the r-th submitted prompt
  and the same end ids, minus the final end token (JetStream does not stream it)."""
  stop = set(engine.eos_ids)
  out = engine.run(params, prompts, np.arange(len(prompts)), jax.random.key(seed),
                   temperature=temperature, top_k=top_k, top_p=top_p)
  rows = []
  for tokens, n in zip(out.tokens, out.lengths):
    row = [int(t) for t in tokens[:n]]
    rows.append(row[:-1] if row[-1] in stop else row)
  return rows


async def _decode(client, request):
  tokens, text = [], []
  async for response in client.Decode(request):
    for sample in response.stream_content.samples:
      tokens += list(sample.token_ids)
      text.append(sample.text)
  return tokens, "".join(text)


def _text_request(text, max_tokens):
  return jetstream_pb2.DecodeRequest(
      text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens)


def _drive(engine, params, requests):
  """Runs `requests` through a real Driver + LLMOrchestrator (interleaved, in-process) ->
  [(tokens, text)] in request order. Requests are submitted in order, so the r-th one is the
  engine's r-th insert (its sampling stream)."""
  async def main():
    driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                                 prefill_params=[params], generate_params=[params],
                                 interleaved_mode=True)
    try:
      client = orchestrator.LLMOrchestrator(driver=driver)
      return await asyncio.wait_for(
          asyncio.gather(*(_decode(client, r) for r in requests)), timeout=120)
    finally:
      driver.stop()
  return asyncio.run(main())


def test_orchestrator_streams_the_engine_greedy_tokens(model, reference):
  graphdef, params, tok = model
  engine = JaxrlJetStreamEngine(graphdef, params, tok, num_slots=SLOTS, max_prompt_len=PROMPT_LEN,
                                max_new_tokens=N)
  assert engine.tokenizer.stop_tokens == {0, 1, 22} == set(reference.eos_ids)
  assert engine.max_prefill_length == 16
  engine.warmup()
  want = _reference(reference, params, [tok.encode(p) for p in PROMPTS])
  # Not vacuous: some rows stop at the second end id, some run the whole budget.
  assert {len(w) for w in want} >= {N} and min(len(w) for w in want) < N - 1

  # Text requests (server-side tokenization), a token request (verbatim ids: the BOS that
  # JetStream prepends is the sentinel prefill drops), and a request cut by its own max_tokens.
  requests = [_text_request(p, 100) for p in PROMPTS] + [
      jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(
          token_ids=tok.encode(PROMPTS[2])), max_tokens=100),
      _text_request(PROMPTS[0], 3)]
  got = _drive(engine, params, requests)
  for p, (tokens, text), w in zip(PROMPTS, got, want):
    assert tokens == w, p
    assert text == tok.decode(w), p
  assert got[len(PROMPTS)] == (want[2], "")  # token requests stream ids only
  assert got[len(PROMPTS) + 1][0] == want[0][:3]


def test_orchestrator_samples_like_the_engine(model, reference):
  """Sampling settings fixed at construction; request r draws with fold_in(key(seed), r) in
  both, so the sampled streams match too, whatever slot each request lands in."""
  graphdef, params, tok = model
  sampling = dict(temperature=0.8, top_k=6, top_p=0.95, seed=3)
  engine = JaxrlJetStreamEngine(graphdef, params, tok, num_slots=SLOTS, max_prompt_len=PROMPT_LEN,
                                max_new_tokens=N, **sampling)
  prompts = [tok.encode(p) for p in PROMPTS]
  want = _reference(reference, params, prompts, **sampling)
  greedy = _reference(reference, params, prompts)
  assert want != greedy  # not vacuous: sampling changed some stream
  got = _drive(engine, params, [_text_request(p, 100) for p in PROMPTS])
  assert [t for t, _ in got] == want


def test_tokenizer_adapter_pads_to_jetstream_buckets(model):
  _, _, tok = model
  jt = JaxrlTokenizer(tok)
  padded, n = jt.encode("abc", is_bos=True, max_prefill_length=32, jax_padding=False)
  # No BOS: a character tokenizer has none, and is_bos is ignored for text.
  assert n == 3 and padded.shape == (16,) and list(padded[:4]) == [2, 3, 4, 0]
  # An empty prompt starts from the EOS id (no BOS): prefill needs one real token.
  padded, n = jt.encode("", max_prefill_length=16, jax_padding=False)
  assert n == 1 and padded[0] == 1
  assert jt.bos_id == BOS_SENTINEL and jt.decode([3]) == "b" and jt.decode([1]) == ""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Qwen2 directory: jaxrl weights via `save_hf` next to a byte-level BPE
  tokenizer with Qwen2.5's special tokens and two end ids."""
  from hf_fixtures import qwen_files

  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.models.hf_checkpoint import save_hf

  path = qwen_files(tmp_path_factory.mktemp("hf") / "tiny-qwen2")
  tok = HFTokenizer.from_dir(path)
  cfg = tiny_model_config(vocab_size=tok.vocab_size + 13, qkv_bias=True, tie_embeddings=True,
                          rope_theta=1e6)
  _, params = init_model(cfg, seed=0)
  save_hf(path, cfg, params, architecture="Qwen2ForCausalLM")
  return path


def test_serve_script_answers_one_grpc_request(hf_dir, tmp_path):
  import grpc

  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.models.hf_checkpoint import load_hf

  path = hf_dir
  port = free_port()
  log_path = tmp_path / "serve.log"
  prompt = "What is 12 + 30?"
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
        [sys.executable, SERVE, "--hf_path", path, "--host", "127.0.0.1", "--port", str(port),
         "--slots", str(SLOTS), "--max_prompt_len", str(PROMPT_LEN), "--max_new_tokens", str(N)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
  try:
    # The expected tokens, computed while the server loads and compiles.
    tok = HFTokenizer.from_dir(path)
    _, graphdef, params = load_hf(path)
    engine = _reference_engine(graphdef, set(tok.eos_ids) | {tok.pad_id}, tok.pad_id)
    want = _reference(engine, params, [tok.encode(prompt)])[0]

    deadline = time.monotonic() + 240
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
      while True:
        if proc.poll() is not None:
          pytest.fail(f"serve.py exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
          grpc.channel_ready_future(channel).result(timeout=2)
          break
        except grpc.FutureTimeoutError:
          if time.monotonic() > deadline:
            pytest.fail(f"serve.py did not listen within 240 s:\n{log_path.read_text()}")
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
      tokens, text = [], []
      for response in stub.Decode(_text_request(prompt, 100), timeout=60):
        for sample in response.stream_content.samples:
          tokens += list(sample.token_ids)
          text.append(sample.text)
    text = "".join(text)
    assert tokens == want and tokens
    # Per-token streaming text equals the whole completion's text when no token splits a
    # UTF-8 character (see the adapter's docstring); the ids are exact either way.
    full = tok.decode(want)
    assert text.strip() and (text == full or "\ufffd" in text), (text, full)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log_path.read_text()
    assert "serving on 127.0.0.1" in log_path.read_text()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)


def test_serve_loads_a_run_checkpoint(hf_dir, tmp_path):
  """`--run_dir`: architecture and tokenizer from the run's hf_base/, weights from the chosen
  checkpoint step (here different weights from the directory the run started from)."""
  import importlib.util
  import json

  from jaxrl.runtime import checkpoint
  from jaxrl.cli.export import METADATA_DIR, copy_metadata
  from jaxrl.models.hf_checkpoint import load_hf

  path = hf_dir
  cfg, _, base_params = load_hf(path)
  run_dir = tmp_path / "run"
  copy_metadata(path, str(run_dir / METADATA_DIR))
  (run_dir / "config.json").write_text(json.dumps({
      "model": {"param_dtype": "float32", "scan_layers": cfg.scan_layers},
      "tokenizer": {"chat_template": True, "system_prompt": "Be brief."}}))
  # Stand-ins for trained weights: distinct per step and from the starting directory.
  trained = {step: jax.tree.map(lambda x, s=step: x + s, base_params) for step in (3, 7)}
  with checkpoint.Checkpointer(checkpoint.checkpoint_dir(str(run_dir))) as ckpt:
    for step, params in trained.items():
      ckpt.save(step, {"train": {"params": params}}, {})

  spec = importlib.util.spec_from_file_location("serve", SERVE)
  serve = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(serve)
  for step, want in ((None, 7), (3, 3)):
    graphdef, params, tok, got = serve.load_run(str(run_dir), step, None, chat=True)
    assert got == want
    jax.tree.map(np.testing.assert_array_equal, params, trained[want])
  # --chat renders one user turn with the run's system prompt.
  assert tok.encode_prompt("hi") == tok.encode(
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
      "<|im_start|>assistant\n")
  with pytest.raises(FileNotFoundError, match="hf_base"):
    serve.load_run(path, None, None, chat=False)


def test_serve_script_help():
  out = subprocess.run([sys.executable, SERVE, "--help"], capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stderr
  for flag in ("--hf_path", "--run_dir", "--step", "--host", "--port", "--slots",
               "--max_prompt_len", "--max_new_tokens", "--temperature", "Orchestrator", "SIGTERM"):
    assert flag in out.stdout, flag
