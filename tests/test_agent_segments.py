"""Rows of several causal sequences (`TrainBatch.completion_segment`): an agent episode whose
later request does not extend the one before keeps that request's prompt and reply in the row as
a sequence of its own, and every pass of the trainer (per row, shared prompts, token packing)
scores each sequence exactly as if it were a row of its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model_config
from jaxrl.core.types import TrainBatch
from jaxrl.learner import packing
from jaxrl.learner.step import StepConfig, build_train_step, completion_logprobs, make_optimizer
from jaxrl.models import init_model
from jaxrl.models.logprobs import left_positions, segment_positions
from jaxrl.parallel import make_mesh
from jaxrl.serving.agents import trajectory
from jaxrl.serving.dispatcher import Completion


def test_segment_positions_restart_at_each_sequence():
  seg = jnp.array([[-1, -1, 0, 0, 0, 1, 1, -1, 1, 2, 2, -1],
                   [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1]])
  # Row 0: sequence 0 at 0, 1, 2; sequence 1 at 0, 1 with its hole skipped (then 2); 2 at 0, 1.
  # A broken form that counted on across sequences would give 3, 4, -, 5, 6, 7 after the first.
  assert segment_positions(seg).tolist() == [[0, 0, 0, 1, 2, 0, 1, 0, 2, 0, 1, 0],
                                             [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0]]
  # One sequence per row: the left-padded rows' own positions at every real token.
  real = np.asarray(seg[1:]) >= 0
  assert (np.asarray(segment_positions(seg[1:]))[real] ==
          np.asarray(left_positions(seg[1:] >= 0))[real]).all()


def _reply(tokens, version=5):
  return Completion(tokens=list(tokens), logprobs=[-0.5] * len(tokens),
                    versions=[version] * len(tokens), hit_eos=True)


def test_a_turn_that_does_not_extend_the_last_is_its_own_sequence_in_the_row():
  # Turn 1: prompt [1 2 3], reply [10 11]. Turn 2 extends it: adds [4] then replies [12].
  # Turn 3 re-renders the history ([1 2 9 ...] is not [1 2 3 10 11 4 12]): its whole prompt is
  # context of sequence 1, then its reply [13 14]. Turn 4 extends turn 3: adds [6], replies [15].
  turns = [([1, 2, 3], _reply([10, 11])), ([1, 2, 3, 10, 11, 4], _reply([12])),
           ([1, 2, 9, 7], _reply([13, 14], 6)), ([1, 2, 9, 7, 13, 14, 6], _reply([15], 6))]
  t = trajectory(turns, 64)
  assert t.prompt == [1, 2, 3] and t.segments == 2 and not t.truncated
  assert t.tokens == [10, 11, 4, 12, 1, 2, 9, 7, 13, 14, 6, 15]
  assert t.mask == [1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1]
  assert t.segment == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
  assert [v for v, m in zip(t.versions, t.mask) if m] == [5, 5, 5, 6, 6, 6]
  # Every served token is in the row once, as served: nothing re-tokenised, nothing dropped.
  assert [x for x, m in zip(t.tokens, t.mask) if m] == [10, 11, 12, 13, 14, 15]
  cut = trajectory(turns, 9)
  assert cut.truncated and cut.tokens == t.tokens[:9] and cut.segment == t.segment[:9]


@pytest.fixture(scope="module")
def model():
  cfg = tiny_model_config()
  return init_model(cfg, seed=0)


def _rows(rng, n_rows, lp, n):
  """Rows of three sequences each and the same sequences as rows of their own (prompt: the row's
  prompt or a later sequence's context; completion: its reply)."""
  prompts, pvalid = np.zeros((n_rows, lp), np.int32), np.zeros((n_rows, lp), bool)
  tokens, valid = np.zeros((n_rows, n), np.int32), np.zeros((n_rows, n), bool)
  mask, seg = np.zeros((n_rows, n), bool), np.zeros((n_rows, n), np.int32)
  alone = []  # (row, start in the row's completion, prompt, reply) of every sequence
  word = lambda k: rng.integers(2, 60, size=k).tolist()
  for i in range(n_rows):
    p = word(rng.integers(2, lp + 1))
    prompts[i, lp - len(p):], pvalid[i, lp - len(p):] = p, True
    at, parts = 0, []
    for s in range(3):
      ctx = [] if s == 0 else word(rng.integers(2, 5))
      reply = word(rng.integers(1, 4))
      for x, m in [(x, False) for x in ctx] + [(x, True) for x in reply]:
        tokens[i, at], valid[i, at], mask[i, at], seg[i, at] = x, True, m, s
        at += 1
      parts.append((i, at - len(reply), p if s == 0 else ctx, reply))
    seg[i, at:] = 2
    alone += parts
  return (prompts, pvalid, tokens, valid, mask, seg), alone


def _batch(prompts, pvalid, tokens, valid, mask, seg=None, rollout=None):
  b = len(prompts)
  return TrainBatch(prompts, pvalid, tokens, mask,
                    np.zeros(tokens.shape, np.float32) if rollout is None else rollout,
                    np.arange(b, dtype=np.float32) % 2, np.arange(b, dtype=np.int32) // 2,
                    np.full(b, 0.9, np.float32), completion_valid=valid,
                    completion_segment=seg)


@pytest.mark.slow
def test_every_pass_scores_each_sequence_as_a_row_of_its_own(model):
  graphdef, params = model

  def logprobs(batch, cfg=StepConfig(), packed=None):
    # Jitted (one program per pass; op by op each small op would compile on its own).
    run = lambda params, batch: completion_logprobs(graphdef, params, batch, cfg,
                                                    with_entropy=False, packed=packed)
    return jax.jit(run)(params, batch)

  (prompts, pvalid, tokens, valid, mask, seg), alone = _rows(np.random.default_rng(0), 4, 6, 24)
  # The reference: each sequence as its own row (left-padded prompt, its reply).
  lp, n = 8, 4
  ap, av = np.zeros((len(alone), lp), np.int32), np.zeros((len(alone), lp), bool)
  at, am = np.zeros((len(alone), n), np.int32), np.zeros((len(alone), n), bool)
  for r, (_, _, p, reply) in enumerate(alone):
    ap[r, lp - len(p):], av[r, lp - len(p):] = p, True
    at[r, :len(reply)], am[r, :len(reply)] = reply, True
  ref, _ = logprobs(_batch(ap, av, at, am, am))
  want = np.zeros(tokens.shape, np.float32)
  for r, (i, start, _, reply) in enumerate(alone):
    want[i, start:start + len(reply)] = np.asarray(ref)[r, :len(reply)]

  batch = _batch(prompts, pvalid, tokens, valid, mask, seg)
  per_row, _ = logprobs(batch)
  shared, _ = logprobs(batch, StepConfig(shared_prompts=2))
  streams = packing.capacity(4, 6, 24, 32)
  packed = packing.pack(prompts, pvalid, tokens, valid, batch.temperature, group=0, budget=32,
                        streams=streams, segment=seg)
  by_packing, _ = logprobs(batch, packed=(packed, 0, streams))
  for got in (per_row, shared, by_packing):
    got = np.where(mask, np.asarray(got), 0.0)
    np.testing.assert_allclose(got, want, atol=2e-5)
  # Not vacuous: the same rows read as one sequence each score the later replies otherwise.
  flat, _ = logprobs(batch._replace(completion_segment=None))
  later = mask & (seg > 0)
  assert np.abs(np.asarray(flat)[later] - want[later]).max() > 1e-2
  assert np.abs(want[mask]).min() > 0  # every trained token was scored


@pytest.mark.slow  # three train steps compiled: ~20 s on 2 cores
def test_the_train_step_takes_rows_of_several_sequences_in_every_form(model):
  # The same batch through the per-row, shared-prompt and packed steps: one loss, one update.
  graphdef, params = model
  (prompts, pvalid, tokens, valid, mask, seg), _ = _rows(np.random.default_rng(1), 4, 6, 24)
  batch = jax.tree.map(jnp.asarray, _batch(prompts, pvalid, tokens, valid, mask, seg))
  optimizer = make_optimizer(1e-2)
  out = {}
  for name, cfg in {"rows": StepConfig(), "shared": StepConfig(shared_prompts=2),
                    "packed": StepConfig(pack_tokens=32)}.items():
    step, init = build_train_step(graphdef, optimizer, cfg, make_mesh(1, 1, 1), params)
    state, metrics = step(init(jax.tree.map(jnp.copy, params)), batch)
    out[name] = (float(metrics["loss"]), float(metrics["grad_norm"]), state.params)
  # The loss (about 0: one update, ratio 1, advantages +-1 in every group) and the gradient's
  # norm agree across the forms.
  loss, norm = ([v[k] for v in out.values()] for k in (0, 1))
  assert np.isfinite(loss).all() and max(loss) - min(loss) < 1e-6, loss
  assert min(norm) > 0.1 and max(norm) - min(norm) < 1e-5 * max(norm), norm
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), out["rows"][2], params)
  assert max(jax.tree.leaves(moved)) > 1e-3  # the update happened (a step of lr 1e-2)
