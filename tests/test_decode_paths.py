"""`model.decode_attention`: single-token decode over filled slots only (`jaxrl.kernels.
decode_attention`) gives today's dense decode's tokens and log-probs, in the static sampler and
in the continuous engine (slots refilling, params switched mid-rollout)."""

import functools

import jax
import numpy as np
import pytest

from conftest import tiny_model_config
from jaxrl.models import init_model
from jaxrl.models.model_config import resolve_decode_attention
from jaxrl.models.transformer import abstract_model
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.static_sampler import make_sampler

G, N, LP = 3, 8, 8
EOS = (5, 17)
PROMPTS = [[2, 3, 4, 5, 6, 7], [8, 9, 10], [11]]
SAMPLINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_k=5,
                                                               top_p=0.9)}


def _left_pad(prompts):
  tokens = np.zeros((len(prompts), LP), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, LP - len(p):] = p
  return tokens, tokens > 0


@functools.lru_cache(maxsize=None)
def _params(seed):
  # The weights do not depend on the decode implementation: built once per seed.
  return init_model(tiny_model_config(), seed)[1]


def _model(impl, seed=0):
  return abstract_model(tiny_model_config(decode_attention=impl))[0], _params(seed)


def _static(impl, sampling):
  graphdef, params = _model(impl)
  gen = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0)
  ids = np.arange(len(PROMPTS) * G)
  return gen(params, *_left_pad(PROMPTS), jax.random.key(3), ids, **sampling)


def _engine(impl, sampling, switch: bool):
  graphdef, params = _model(impl)
  _, new_params = _model(impl, seed=1)
  engine = Engine(graphdef, num_slots=4, max_prompt_len=LP, max_new_tokens=N, eos_id=EOS,
                  pad_id=0, prefill_buckets=(4, 8), steps_per_dispatch=3)
  calls = []

  def source():  # a partial rollout: new params after the first dispatch
    calls.append(1)
    return (0, params) if len(calls) == 1 else (1, new_params)
  kw = dict(params_source=source) if switch else {}
  ids = np.arange(len(PROMPTS) * G) + 100
  return engine.run(params, PROMPTS, ids, jax.random.key(4), group_size=G, **kw, **sampling)


def _same(out, ref):
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
  # Not vacuous: rows of several lengths were generated.
  lengths = np.asarray(out.mask).sum(axis=1)
  assert lengths.max() == N and lengths.min() < N


def test_auto_keeps_dense_decode_on_cpu():
  assert resolve_decode_attention("auto", "cpu") == "dense"
  assert resolve_decode_attention("auto", "gpu") == resolve_decode_attention("auto", "tpu") \
      == "xla"
  with pytest.raises(ValueError, match="decode_attention"):
    resolve_decode_attention("paged")


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_static_sampler_xla_decode_equals_dense(sampling):
  _same(_static("xla", SAMPLINGS[sampling]), _static("dense", SAMPLINGS[sampling]))


@pytest.mark.slow
@pytest.mark.parametrize("switch", [False, True], ids=["one_version", "partial"])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_engine_xla_decode_equals_dense(sampling, switch):
  out = _engine("xla", SAMPLINGS[sampling], switch)
  ref = _engine("dense", SAMPLINGS[sampling], switch)
  _same(out, ref)
  np.testing.assert_array_equal(out.versions, ref.versions)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_pallas_decode_interpreted_equals_dense(impl):
  _same(_static(impl, SAMPLINGS["sampled"]), _static("dense", SAMPLINGS["sampled"]))
  _same(_engine(impl, SAMPLINGS["greedy"], True), _engine("dense", SAMPLINGS["greedy"], True))
