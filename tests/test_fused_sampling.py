"""The sampler's fused decode step (`static_sampler.pick_tokens(fused=True)`): no [rows, vocab]
float32 array a step beyond the logits themselves, counted in the compiled program, with the
same tokens as the separate form for the same keys and log-probs within 1e-5 (static sampler,
continuous engine, partial rollouts)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model_config
from jaxrl.models import init_model
from jaxrl.models.logprobs import token_logprobs
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.static_sampler import make_sampler, pick_tokens, resolve_fused_sampling

# 301 > the one-hot embedding's vocabulary bound, so the only [rows, V] arrays are the sampler's.
V, P, G, N, LP = 301, 2, 3, 6, 4
ROWS = P * G
EOS = (5,)
PROMPTS = [[2, 3, 4], [8, 9, 10, 11]]
SAMPLINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7),
             "truncated": dict(temperature=0.9, top_k=7, top_p=0.8)}


def _model(seed=0):
  # A wide init: peaked logits, so rows end at different lengths.
  return init_model(tiny_model_config(vocab_size=V, init_std=0.3), seed)


def _left_pad(prompts):
  tokens = np.zeros((len(prompts), LP), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, LP - len(p):] = p
  return tokens, tokens > 0


# --- the compiled program's [rows, V] float32 buffers -------------------------------------------

def _computations(text):
  """(name -> instruction lines of each computation of an HLO module's text, the entry's name)."""
  comps, body, entry = {}, None, None
  for line in text.split("\n"):
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
      entry = name if line.startswith("ENTRY") else entry
      body = comps.setdefault(name, [])
    elif body is not None:
      body.append(line)
  return comps, entry


def _callees(line):
  return re.findall(r"(?:calls|to_apply|body|condition)=(%[\w.\-]+)", line) + [
      c for group in re.findall(r"branch_computations=\{([^}]*)\}", line)
      for c in re.findall(r"%[\w.\-]+", group)]


def step_buffers(text, shape):
  """Instructions producing an array of `shape` (e.g. "f32[6,301]") that the program keeps in
  memory on the untruncated path: in every computation reached from the entry except fusion
  bodies (their values live in registers) and conditional branches that sort (top-k/top-p
  truncation, which sorts each row by design); parameters, tuple reads and bitcasts are views,
  not buffers."""
  comps, entry = _computations(text)
  assert entry is not None, "no ENTRY computation in the HLO text"
  fused = set(re.findall(r"calls=(%[\w.\-]+)", text))

  def sorts(name, seen=()):
    lines = comps.get(name, [])
    return any(" sort(" in l for l in lines) or any(
        sorts(c, seen + (name,)) for l in lines for c in _callees(l) if c not in seen)

  out, todo, seen = [], [entry], set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\S+) ([\w\-]+)\(", line)
      if (name not in fused and m and m.group(2).startswith(shape + "{")
          and m.group(3) not in ("parameter", "get-tuple-element", "bitcast")):
        out.append((name, m.group(1), m.group(3)))
      branches = re.findall(r"branch_computations=\{([^}]*)\}", line)
      for c in _callees(line):
        if branches and c in branches[0] and sorts(c):
          continue
        todo.append(c)
  return out


def _decode_hlo(fused):
  graphdef, params = _model()
  gen = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0,
                     fused_sampling=fused)
  cache, first, lens = gen.prefill(params, *_left_pad(PROMPTS))
  args = (params, cache, first, lens, jax.random.key(0), jnp.arange(ROWS, dtype=jnp.int32),
          jnp.float32(0.7), jnp.int32(0), jnp.float32(1.0))
  return gen.decode.lower(*args).compile().as_text()


@pytest.mark.slow
def test_fused_decode_step_keeps_one_rows_by_vocab_array():
  shape = f"f32[{ROWS},{V}]"
  fused, separate = step_buffers(_decode_hlo(True), shape), step_buffers(_decode_hlo(False), shape)
  # The fused program: the loop body's logits (the matmul's output), nothing else; token 0 is
  # drawn from prefill's logits, an argument.
  assert len(fused) == 1, fused
  assert fused[0][2] in ("fusion", "dot", "custom-call"), fused
  # The separate form keeps the scaled logits (twice) and the exponentials of the log-sum-exp,
  # in the loop body and for token 0: the count above can fail.
  assert len(separate) >= 4, separate


@pytest.mark.slow
def test_engine_step_keeps_one_rows_by_vocab_array():
  graphdef, params = _model()
  shape = f"f32[{4},{V}]"
  counts = {}
  for fused in (True, False):
    engine = Engine(graphdef, num_slots=4, max_prompt_len=LP, max_new_tokens=N, eos_id=EOS,
                    pad_id=0, prefill_buckets=(LP,), steps_per_dispatch=3, fused_sampling=fused)
    state = engine.init_decode_state(params)
    text = engine.generate.lower(params, state, 0, 3).compile().as_text()
    counts[fused] = step_buffers(text, shape)
  assert len(counts[True]) == 1, counts[True]
  assert len(counts[False]) >= 2, counts[False]


# --- same tokens, log-probs within 1e-5 ---------------------------------------------------------

def _same(out, ref):
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5,
                             rtol=0)


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_static_sampler_fused_equals_separate(sampling):
  graphdef, params = _model()
  outs = {}
  for fused in (True, False):
    gen = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0,
                       fused_sampling=fused)
    outs[fused] = gen(params, *_left_pad(PROMPTS), jax.random.key(3), np.arange(ROWS),
                      **SAMPLINGS[sampling])
  _same(outs[True], outs[False])
  assert np.asarray(outs[True].mask).sum() > ROWS  # not vacuous: several tokens a row


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_engine_partial_rollout_fused_equals_separate(sampling):
  graphdef, params = _model()
  _, new_params = _model(seed=1)
  outs = {}
  for fused in (True, False):
    engine = Engine(graphdef, num_slots=4, max_prompt_len=LP, max_new_tokens=N, eos_id=EOS,
                    pad_id=0, prefill_buckets=(LP,), steps_per_dispatch=2, fused_sampling=fused)
    calls = []

    def source():  # a partial rollout: new params after the first dispatch
      calls.append(1)
      return (0, params) if len(calls) == 1 else (1, new_params)
    outs[fused] = engine.run(params, PROMPTS, np.arange(ROWS) + 100, jax.random.key(4),
                             group_size=G, params_source=source, **SAMPLINGS[sampling])
  _same(outs[True], outs[False])
  np.testing.assert_array_equal(outs[True].versions, outs[False].versions)
  assert (np.asarray(outs[True].versions) == 1).any()  # the switch happened


def test_pick_tokens_log_probs_are_the_contract():
  # The fused log-prob is `log_softmax(logits / T)[token]` (`token_logprobs`), per-row settings.
  logits = jax.random.normal(jax.random.key(0), (5, 1000)) * 4
  keys = jax.random.split(jax.random.key(1), 5)
  temperature = jnp.array([0.0, 0.5, 1.0, 1.7, 0.3])
  tok, lp = pick_tokens(logits, 2, keys, temperature, jnp.zeros(5, jnp.int32), jnp.ones(5),
                        fused=True)
  want = token_logprobs(logits, tok, temperature)
  np.testing.assert_allclose(np.asarray(lp), np.asarray(want), atol=1e-5, rtol=0)
  assert int(tok[0]) == int(jnp.argmax(logits[0]))  # temperature 0: greedy


def test_auto_is_separate_on_cpu_only():
  assert resolve_fused_sampling(None, "cpu") is False
  assert resolve_fused_sampling(None, "gpu") and resolve_fused_sampling(None, "tpu")
  assert resolve_fused_sampling(True, "cpu") and not resolve_fused_sampling(False, "gpu")
