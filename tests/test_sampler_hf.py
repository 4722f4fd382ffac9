"""Sampler parity with `transformers` (SPEC §1): on the same tiny random checkpoint, jaxrl's greedy
generation emits the same tokens as `model.generate`, stopping at the same EOS, and the sampler's
log-probs equal `log_softmax(hf_logits / T)` at the drawn tokens within 1e-4 (f32, CPU).

The prompts have different lengths, so jaxrl's left padding (positions counted from each row's
first real token, padded keys masked) is exercised against HF running each prompt unpadded.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.parity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_fixtures import random_hf_model  # noqa: E402  (tests/ is on sys.path)
from jaxrl.data.tokenizer import left_pad  # noqa: E402
from jaxrl.models.hf_checkpoint import load_hf  # noqa: E402
from jaxrl.rollout.static_sampler import make_sampler  # noqa: E402

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=97, rms_norm_eps=1e-6,
              # At the default 0.02 the layers barely move the residual stream: a tied model then
              # greedily repeats its last prompt token, and top-2 logit gaps are ~1e-3.
              initializer_range=0.2)
# name -> (config class, model class, extra config, torch seed, jaxrl scan_layers). The scanned
# Llama also covers the decode path that slices stacked layer weights inside the loop.
VARIANTS = {
  "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), 1, False),
  "llama_untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False), 1, True),
  "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False,
                                                           head_dim=32), 3, False),
}
V = COMMON["vocab_size"]
N = 12  # max_new_tokens
PAD = 0
# Four prompts of different lengths (1 .. 10), left-padded to 11 so every row has padding.
PROMPT_LEN = 11
_rng = np.random.default_rng(7)
PROMPTS = [list(map(int, _rng.integers(1, V, size=n))) for n in (7, 3, 10, 1)]
# A top-2 logit gap below this along the reference trajectory would make greedy equality depend on
# f32 rounding (jax vs torch kernels differ by ~1e-5 in the logits), not on correctness.
MIN_MARGIN = 1e-3


def _hf_model(variant: str):
  config_cls, arch, extra, seed, _ = VARIANTS[variant]
  return random_hf_model(config_cls, arch, seed, **COMMON, **extra)


def _hf_logits(model, seqs) -> list[np.ndarray]:
  """float32 logits [len(seq), V] of each unpadded sequence, from one right-padded batch (causal
  attention: padding after a sequence cannot reach its positions)."""
  width = max(map(len, seqs))
  ids = torch.tensor([list(s) + [PAD] * (width - len(s)) for s in seqs], dtype=torch.long)
  with torch.no_grad():
    logits = model(ids).logits.float().numpy()
  return [logits[i, :len(s)] for i, s in enumerate(seqs)]


def _hf_greedy_uncut(model, prompt) -> tuple[list[int], np.ndarray]:
  """Greedy continuation of N tokens with no EOS, by a full forward per step (no cache, so an
  anchor independent of `generate`), and the logits [N, V] each token was chosen from."""
  seq, steps = list(prompt), []
  for _ in range(N):
    steps.append(_hf_logits(model, [seq])[0][-1])
    seq.append(int(np.argmax(steps[-1])))
  return seq[len(prompt):], np.stack(steps)


def _cut(tokens, eos) -> list[int]:
  """Tokens up to and including the first one in `eos`."""
  for i, tok in enumerate(tokens):
    if tok in eos:
      return list(tokens[:i + 1])
  return list(tokens)


def _choose_eos(uncut) -> tuple[int, int]:
  """Two EOS ids the greedy continuations actually hit (from around positions 3 and 5 of the first
  two rows), such that each id ends some row after at least 3 tokens and at least one row never
  ends (so decoding keeps running past finished rows)."""
  for a in uncut[0][3:N - 2]:
    for b in uncut[1][5:N - 2]:
      if a == b:
        continue
      ends = [_cut(row, {a, b}) for row in uncut]
      last = [row[-1] if row[-1] in (a, b) else None for row in ends]
      if a in last and b in last and None in last and all(len(row) >= 3 for row in ends):
        return a, b
  raise AssertionError(f"no usable EOS pair in the greedy continuations {uncut}; pick another seed")


def _log_softmax(logits, temperature) -> np.ndarray:
  z = logits.astype(np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


G = 3  # samples per prompt


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
  """These models are tiny: torch's intra-op threads only spin against XLA's (a forward took
  ~40x longer with 2 threads than with 1 on a loaded 2-core machine)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def setup(request, tmp_path_factory):
  """One tiny checkpoint on disk, loaded by both libraries; HF's greedy continuations and the two
  EOS ids they hit; and one jaxrl sampler (one compile) shared by the greedy and sampling tests."""
  variant = request.param
  model = _hf_model(variant)
  path = tmp_path_factory.mktemp(variant) / "hf"
  model.save_pretrained(str(path), safe_serialization=True)
  cfg, graphdef, params = load_hf(str(path), scan_layers=VARIANTS[variant][4])
  assert cfg.param_dtype == "float32" and cfg.dtype == "float32"
  uncut, step_logits = zip(*[_hf_greedy_uncut(model, p) for p in PROMPTS])
  eos = _choose_eos(uncut)
  gen = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=eos, pad_id=PAD)
  prompts, valid = left_pad(PROMPTS, PROMPT_LEN, PAD)

  def sample(key, temperature, top_k=0, top_p=1.0):
    out = gen(params, prompts, valid, jax.random.key(key), np.arange(len(PROMPTS) * G),
              temperature, top_k, top_p)
    return tuple(np.asarray(x) for x in (out.tokens, out.logprobs, out.mask, out.lengths))

  return dict(variant=variant, model=model, uncut=uncut, step_logits=step_logits, eos=eos,
              sample=sample)


def _check_rows(variant, tokens, logprobs, mask, lengths, eos):
  """Row invariants: the mask is a prefix of `lengths` tokens that ends at the first EOS (or at
  the limit); after it, pad tokens with log-prob 0."""
  for row in range(len(tokens)):
    n = int(lengths[row])
    assert mask[row, :n].all() and not mask[row, n:].any(), (variant, row, mask[row])
    assert (tokens[row, n:] == PAD).all() and (logprobs[row, n:] == 0).all(), (variant, row)
    got = tokens[row, :n].tolist()
    assert not set(got[:-1]) & set(eos) and (n == N or got[-1] in eos), (variant, row, got, eos)


def test_greedy_generation_matches_transformers(setup):
  variant, model, eos = setup["variant"], setup["model"], setup["eos"]
  margins = [np.diff(np.sort(s, -1)[:, -2:], axis=-1).min() for s in setup["step_logits"]]
  # Guard against near-ties: with every top-2 logit gap along HF's trajectory this large, argmax
  # is decided by the model, not by f32 rounding (jax and torch logits differ by ~1e-5 here), so
  # exact token equality is a fair requirement. (The seeds in VARIANTS were chosen for this.)
  assert min(margins) > MIN_MARGIN, (variant, margins)
  expected = [_cut(row, set(eos)) for row in setup["uncut"]]
  assert min(map(len, expected)) < N and max(map(len, expected)) == N

  # The reference: HF's cached `generate` with the two EOS ids, one unpadded prompt at a time,
  # agrees with the uncached continuation cut at the first EOS.
  for prompt, want in zip(PROMPTS, expected):
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=N, eos_token_id=list(eos), pad_token_id=PAD)
    assert out[0, len(prompt):].tolist() == want, variant

  tokens, logprobs, mask, lengths = setup["sample"](0, 0.0)
  _check_rows(variant, tokens, logprobs, mask, lengths, eos)
  worst = 0.0
  for row in range(len(tokens)):
    want, n = expected[row // G], len(expected[row // G])
    assert tokens[row, :n].tolist() == want and lengths[row] == n, (variant, row, tokens[row], want)
    # Greedy log-probs are taken at T = 1.
    ref = _log_softmax(setup["step_logits"][row // G][:n], 1.0)[np.arange(n), want]
    worst = max(worst, float(np.abs(logprobs[row, :n] - ref).max()))
  assert worst <= 1e-4, (variant, worst)
  # Not vacuous: both EOS ids ended a row, and some row ran to the limit without one.
  last = {int(tokens[row, lengths[row] - 1]) for row in range(len(tokens))}
  assert set(eos) <= last and not last <= set(eos), (variant, eos, last)


# (temperature, top_k, top_p, key): the log-prob is over the full vocabulary even when truncated.
SAMPLING = [(0.7, 0, 1.0, 1), (1.0, 0, 1.0, 1), (0.7, 20, 0.9, 1)]


@pytest.mark.parametrize("temperature,top_k,top_p,key", SAMPLING)
def test_sampler_logprobs_match_transformers(setup, temperature, top_k, top_p, key):
  variant, model, eos = setup["variant"], setup["model"], setup["eos"]
  tokens, logprobs, mask, lengths = setup["sample"](key, temperature, top_k, top_p)
  _check_rows(variant, tokens, logprobs, mask, lengths, eos)

  # Each row's prompt and generated tokens (through its EOS) through HF in one batch; the logits
  # predicting generated token t sit at position len(prompt) - 1 + t.
  gen_tokens = [tokens[row, :lengths[row]].tolist() for row in range(len(tokens))]
  prompts = [PROMPTS[row // G] for row in range(len(tokens))]
  hf = _hf_logits(model, [p + g for p, g in zip(prompts, gen_tokens)])
  warpers = []
  if top_k:
    warpers.append(transformers.TopKLogitsWarper(top_k))
  if top_p < 1.0:
    warpers.append(transformers.TopPLogitsWarper(top_p))
  worst = 0.0
  for row, (p, g, logits) in enumerate(zip(prompts, gen_tokens, hf)):
    logits, n = logits[len(p) - 1:-1], len(g)
    ref = _log_softmax(logits, temperature)[np.arange(n), g]
    worst = max(worst, float(np.abs(logprobs[row, :n] - ref).max()))
    # Every drawn token lies in the support HF's own top-k / top-p warpers keep.
    z = torch.from_numpy(logits) / temperature
    for warp in warpers:
      z = warp(None, z)
    assert torch.isfinite(z).numpy()[np.arange(n), g].all(), (variant, row, g)
  assert worst <= 1e-4, (variant, worst)
  # Not vacuous: group members differ, some rows end early on EOS and some run to the limit.
  assert lengths.min() < N and lengths.max() == N, (variant, lengths)
  assert all(len({tuple(r) for r in tokens[i:i + G].tolist()}) > 1
             for i in range(0, len(tokens), G)), variant
  assert np.abs(logprobs[mask]).mean() > 0.1, variant
