"""Sampler contract (SPEC §1): logprobs equal the trainer's recompute, RNG per request, masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model_config
from jaxrl.models import init_model
from jaxrl.rollout.static_sampler import FILTER_ROWS, filter_logits, make_sampler
from jaxrl.learner.step import StepConfig, completion_logprobs
from jaxrl.core.types import TrainBatch

G, N = 4, 8
EOS = 1


@pytest.fixture(scope="module")
def setup():
  cfg = tiny_model_config()
  graphdef, params = init_model(cfg, seed=0)
  gen = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0)
  # Three prompts of lengths 6, 3 and 1, left-padded to 6.
  prompts = np.array([[2, 3, 4, 5, 6, 7], [0, 0, 0, 8, 9, 10], [0, 0, 0, 0, 0, 11]], np.int32)
  return graphdef, params, gen, prompts, prompts > 0


def _sample(setup, key=0, temperature=0.7, request_ids=None, **kw):
  graphdef, params, gen, prompts, valid = setup
  ids = np.arange(len(prompts) * G) if request_ids is None else request_ids
  return gen(params, prompts, valid, jax.random.key(key), ids, temperature, **kw)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_sampler_logprobs_equal_trainer_recompute(setup, temperature):
  graphdef, params, _, prompts, valid = setup
  out = _sample(setup, temperature=temperature)
  b = len(prompts) * G
  batch = TrainBatch(np.repeat(prompts, G, 0), np.repeat(valid, G, 0), out.tokens, out.mask,
                     out.logprobs, np.zeros(b, np.float32), np.arange(b) // G,
                     np.full(b, temperature, np.float32))
  # The trainer's own path: hidden states through the fused log-prob kernel.
  recomputed, _ = completion_logprobs(graphdef, params, batch, StepConfig(), with_entropy=False)
  diff = np.abs(np.where(out.mask, np.asarray(recomputed) - np.asarray(out.logprobs), 0.0))
  assert diff.max() <= 1e-4, diff.max()
  # The comparison is not vacuous: tokens were generated and log-probs are not all ~0.
  assert out.mask.sum() > b and np.abs(np.asarray(out.logprobs)[np.asarray(out.mask)]).mean() > 0.1


def test_group_members_differ_and_seed_reproduces(setup):
  a = _sample(setup, key=5)
  b = _sample(setup, key=5)
  c = _sample(setup, key=6)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
  tokens = np.asarray(a.tokens).reshape(3, G, N)
  for p in range(3):
    distinct = {tuple(row) for row in tokens[p]}
    assert len(distinct) > 1, f"all {G} samples of prompt {p} are identical"


def test_a_sample_depends_only_on_key_and_request_id(setup):
  # Permuting request ids within a group permutes the samples: each row's randomness is
  # fold_in(key, request_id), independent of its position in the batch.
  ids = np.arange(3 * G)
  perm = ids.copy()
  perm[:G] = perm[:G][::-1]
  a = np.asarray(_sample(setup, request_ids=ids).tokens)
  b = np.asarray(_sample(setup, request_ids=perm).tokens)
  np.testing.assert_array_equal(a[:G], b[:G][::-1])
  np.testing.assert_array_equal(a[G:], b[G:])


def test_mask_covers_tokens_up_to_first_eos_then_padding(setup):
  out = _sample(setup, temperature=1.0)
  tokens, mask, lengths, lps = map(np.asarray, (out.tokens, out.mask, out.lengths, out.logprobs))
  np.testing.assert_array_equal(lengths, mask.sum(1))
  for t, m, lp in zip(tokens, mask, lps):
    n = m.sum()
    assert m[:n].all() and not m[n:].any()  # a prefix
    assert (t[n:] == 0).all() and (lp[n:] == 0).all()
    eos = np.flatnonzero(t[:n] == EOS)
    if n < N:  # stopped early: exactly at its first EOS
      assert len(eos) == 1 and eos[0] == n - 1
    else:
      assert len(eos) <= 1 and (len(eos) == 0 or eos[0] == N - 1)


def test_top_k_1_and_tiny_top_p_are_greedy(setup):
  greedy = np.asarray(_sample(setup, temperature=0.0).tokens)
  np.testing.assert_array_equal(np.asarray(_sample(setup, temperature=1.0, top_k=1).tokens),
                                greedy)
  np.testing.assert_array_equal(np.asarray(_sample(setup, temperature=1.0, top_p=1e-6).tokens),
                                greedy)


def test_filter_logits_keeps_the_nucleus():
  z = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keep = lambda k, p: np.isfinite(np.asarray(filter_logits(z, jnp.int32(k), jnp.float32(p))))[0]
  np.testing.assert_array_equal(keep(0, 1.0), [1, 1, 1, 1])
  np.testing.assert_array_equal(keep(2, 1.0), [1, 1, 0, 0])
  # Mass before token i: 0, .5, .8, .95. p = 0.8 keeps i with mass-before < 0.8: tokens 0, 1.
  np.testing.assert_array_equal(keep(0, 0.8), [1, 1, 0, 0])
  np.testing.assert_array_equal(keep(0, 0.81), [1, 1, 1, 0])
  np.testing.assert_array_equal(keep(1, 0.99), [1, 0, 0, 0])


def test_filter_logits_by_row_blocks_is_each_rows_own():
  # 3 blocks of FILTER_ROWS rows, sorted a block at a time, against each row filtered alone; a
  # filter that mixed rows (a block's threshold, a shifted reshape) would differ.
  rows = 3 * FILTER_ROWS
  z = jax.random.normal(jax.random.key(0), (rows, 50)) * 3
  for k, p in ((0, 0.9), (5, 1.0), (7, 0.6)):
    blocks = np.asarray(filter_logits(z, jnp.int32(k), jnp.float32(p)))
    alone = np.stack([np.asarray(filter_logits(z[i:i + 1], jnp.int32(k), jnp.float32(p)))[0]
                      for i in range(rows)])
    np.testing.assert_array_equal(blocks, alone)
    assert 0 < np.isfinite(blocks).mean() < 1


def test_changing_temperature_top_k_top_p_does_not_recompile(setup):
  _sample(setup, temperature=0.9)
  graphdef, params, gen, prompts, valid = setup
  before = (gen.prefill._cache_size(), gen.decode._cache_size())
  for t, k, p in [(0.3, 0, 1.0), (1.2, 5, 0.9), (0.0, 0, 1.0)]:
    _sample(setup, temperature=t, top_k=k, top_p=p)
  assert (gen.prefill._cache_size(), gen.decode._cache_size()) == before


def test_several_eos_ids_each_end_a_row(setup):
  # Two ids that greedy decoding actually emits, taken from an EOS-free run: every row must
  # stop at the first of either, exactly where the free run first emitted one.
  graphdef, params, _, prompts, valid = setup
  free = make_sampler(graphdef, num_samples=1, max_new_tokens=N, eos_id=10**6, pad_id=0)
  ref = np.asarray(free(params, prompts, valid, jax.random.key(0), np.arange(3), 0.0).tokens)
  eos = (int(ref[0, 2]), int(ref[1, 4]))
  two = make_sampler(graphdef, num_samples=1, max_new_tokens=N, eos_id=eos, pad_id=0)
  out = two(params, prompts, valid, jax.random.key(0), np.arange(3), 0.0)
  for row in range(3):
    hits = [t for t in range(N) if ref[row, t] in eos]
    end = hits[0] + 1 if hits else N
    assert int(out.lengths[row]) == end
    np.testing.assert_array_equal(np.asarray(out.tokens)[row, :end], ref[row, :end])
    assert (np.asarray(out.tokens)[row, end:] == 0).all()
  assert int(out.lengths[0]) <= 3 and int(out.lengths[1]) <= 5
  with pytest.raises(ValueError, match="eos_id"):
    make_sampler(graphdef, num_samples=1, max_new_tokens=N, eos_id=(), pad_id=0)
