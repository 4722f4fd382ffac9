"""Slot engine: same samples as the static sampler (every decode program of the driver), the
batched driver bit-identical to one call per prompt and row, one prefill per group, the log-prob
contract, version stamps across a mid-request params switch, and no recompiles once warm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model_config
from jaxrl.models import init_model, token_logprobs
from jaxrl.rollout.engine import Engine, default_buckets
from jaxrl.rollout.static_sampler import make_sampler
from jaxrl.learner.step import StepConfig, completion_logprobs
from jaxrl.core.types import TrainBatch

G, N, LP = 3, 8, 8
# Two end ids that this model (seed 0) emits for these prompts: 5 ends rows at their first
# token under sampling and 17 ends others mid-way, so both the EOS test and slot reuse run.
EOS = (5, 17)
PROMPTS = [[2, 3, 4, 5, 6, 7], [8, 9, 10], [11]]  # buckets 8, 4 and 4
SAMPLED = dict(temperature=0.7, top_k=5, top_p=0.9)


def _left_pad(prompts):
  tokens = np.zeros((len(prompts), LP), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, LP - len(p):] = p
  return tokens, tokens > 0


def _engine(graphdef, **kw):
  # 4 slots for 9 rows: slots are reused, and a group straddles dispatches (3 + 1 members, then
  # the remaining 2 wait for free slots with the prefix kept).
  return Engine(graphdef, num_slots=4, max_prompt_len=LP, max_new_tokens=N, eos_id=EOS,
                pad_id=0, prefill_buckets=(4, 8), steps_per_dispatch=3, **kw)


@pytest.fixture(scope="module")
def setup():
  """An engine with the full decode program only (every slot over the whole cache)."""
  cfg = tiny_model_config()
  graphdef, params = init_model(cfg, seed=0)
  return cfg, graphdef, params, _engine(graphdef, compact=False)


@pytest.fixture(scope="module")
def windowed(setup):
  """The default engine with a cache window of 8 (of S = 16), so that every decode program
  runs: at most half the slots busy, only those are decoded; else rows whose positions stay
  under the window decode over its 8 cache slots, the others over all 16."""
  cfg, graphdef, params, _ = setup
  engine = _engine(graphdef, short_window=8)
  assert engine.programs() == [((1, None),), ((2, None),), ((4, None),), ((4, 8),),
                               ((3, 8), (1, None))]
  return cfg, graphdef, params, engine


@pytest.fixture(scope="module")
def sampler(setup):
  _, graphdef, _, _ = setup
  return make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=0)


@pytest.fixture(scope="module")
def switch(setup):
  """Different params for the partial-rollout tests and a cache-free forward (compiled once)."""
  cfg, graphdef, _, _ = setup
  _, new_params = init_model(cfg, seed=1)

  @jax.jit
  def forward_logits(params, seq):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(seq, jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape),
                      jnp.ones(seq.shape, bool))
    return model.logits(hidden)

  return new_params, forward_logits


def _run(setup, key=1, ids=None, prompts=PROMPTS, **kw):
  _, _, params, engine = setup
  ids = np.arange(len(prompts) * G) + 100 if ids is None else ids
  return engine.run(params, prompts, ids, jax.random.key(key), group_size=G, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_engine_matches_static_sampler(setup, sampler, sampling):
  _, _, params, _ = setup
  ids = np.arange(len(PROMPTS) * G) + 100
  ref = sampler(params, *_left_pad(PROMPTS), jax.random.key(1), ids, **sampling)
  out = _run(setup, ids=ids, **sampling)
  ref_tokens, ref_mask, ref_lps = map(np.asarray, (ref.tokens, ref.mask, ref.logprobs))
  np.testing.assert_array_equal(out.tokens, ref_tokens)
  np.testing.assert_array_equal(out.mask, ref_mask)
  np.testing.assert_array_equal(out.lengths, np.asarray(ref.lengths))
  # Not bit-equal: the engine's prompt sits right-padded in a wider cache, so attention sums
  # run over a different number of (zero-weight) slots.
  np.testing.assert_allclose(out.logprobs, ref_lps, atol=1e-5)
  np.testing.assert_array_equal(out.versions, np.where(out.mask, 0, -1))
  # Not vacuous: some rows end early (at an EOS, kept in the mask), some run the full budget.
  assert out.lengths.min() < N and out.lengths.max() == N
  ends = {int(out.tokens[r, n - 1]) for r, n in enumerate(out.lengths) if n < N}
  assert ends <= set(EOS) and ends
  if sampling is SAMPLED:  # sampled: both ids end some row
    assert ends == set(EOS)


def _one_call_per_step(engine, params, prompts, ids, key, temperature, top_k, top_p):
  """`Engine.run`'s schedule through the single-prompt API: one `prefill` per prompt, one
  `insert` per row, one `generate` over every slot per dispatch -> (tokens, logprobs, lengths,
  versions) in row order."""
  rows = [(p, r) for r, p in enumerate(np.repeat(np.arange(len(prompts)), G))]
  out = [np.zeros((len(rows), N), np.int32), np.zeros((len(rows), N), np.float32),
         np.zeros(len(rows), np.int32), np.zeros((len(rows), N), np.int32)]
  state, free, slot_row, prefixes = engine.init_decode_state(params), list(range(4)), {}, {}
  setting = (np.float32(temperature), np.int32(top_k), np.float32(top_p), np.int32(0))
  while rows or slot_row:
    while free and rows:
      p, r = rows.pop(0)
      if p not in prefixes:
        prefixes[p] = engine.prefill(params, prompts[p])
      slot = free.pop(0)
      state = engine.insert(prefixes[p], state, np.int32(slot), np.int32(ids[r]), key, *setting)
      slot_row[slot] = r
    state = engine.generate(params, state, np.int32(0), np.int32(engine.steps_per_dispatch))
    got = jax.device_get((state.done, state.tokens, state.logprobs, state.count, state.versions))
    for slot in [s for s in slot_row if got[0][s]]:
      r = slot_row.pop(slot)
      out[0][r], out[1][r], out[2][r], out[3][r] = (x[slot] for x in got[1:])
      free.append(slot)
  return out


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_batched_driver_is_bit_identical_to_one_call_per_prompt_and_row(setup):
  # Full-width decode: batching prefills and inserts into a few dispatches, overlapping the
  # host's bookkeeping with the next dispatch and reading snapshots must not change one bit.
  _, _, params, engine = setup
  ids, key = np.arange(len(PROMPTS) * G) + 100, jax.random.key(1)
  engine.stats.clear()
  out = engine.run(params, PROMPTS, ids, key, group_size=G, **SAMPLED)
  ref = _one_call_per_step(engine, params, PROMPTS, ids, key, **SAMPLED)
  for name, want in zip(("tokens", "logprobs", "lengths", "versions"), ref):
    np.testing.assert_array_equal(getattr(out, name), want, err_msg=name)
  # One prefill dispatch per length bucket (8 and 4); one insert dispatch per round of
  # admissions (4 rows at first, then as slots free up), not one per row.
  assert engine.stats["prefill_call"] == 2 and engine.stats["insert"] == 9
  assert engine.stats["insert_call"] < 9 and engine.stats["compact"] == 0


@pytest.mark.slow  # several engine programs (fast-suite time budget)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_compacted_and_windowed_programs_give_the_static_samplers_tokens(windowed, sampler,
                                                                         sampling):
  _, _, params, engine = windowed
  engine.stats.clear()
  ids = np.arange(len(PROMPTS) * G) + 100
  # PROMPTS mix rows that outgrow the window with rows that do not; one- and two-token prompts
  # keep every busy slot under it for a while.
  for prompts in (PROMPTS, [[2, 3], [4], [6, 7]]):
    ref = sampler(params, *_left_pad(prompts), jax.random.key(1), ids, **sampling)
    out = engine.run(params, prompts, ids, jax.random.key(1), group_size=G, **sampling)
    np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens))
    np.testing.assert_array_equal(out.lengths, np.asarray(ref.lengths))
    np.testing.assert_allclose(out.logprobs, np.asarray(ref.logprobs), atol=1e-5)
  # Not vacuous: every kind of program ran.
  assert engine.stats["split"] and engine.stats["short"] and engine.stats["compact"]


def test_group_shares_one_prefill_and_streams_whole_groups(setup):
  _, _, _, engine = setup
  engine.stats.clear()
  groups = {}
  out = _run(setup, on_finish=lambda p, o: groups.setdefault(p, o), **SAMPLED)
  # 3 prompts x 3 samples: 3 prefills (one per prompt, not 9), 9 inserts into 4 slots.
  assert engine.stats["prefill"] == len(PROMPTS) and engine.stats["insert"] == 9
  assert sorted(groups) == [0, 1, 2]
  for p, o in groups.items():
    for name in ("tokens", "logprobs", "mask", "lengths", "versions"):
      np.testing.assert_array_equal(getattr(o, name), getattr(out, name)[p * G:(p + 1) * G])
  # Group members differ (distinct request ids), and the seed reproduces.
  assert len({tuple(r) for r in out.tokens[:G]}) > 1
  np.testing.assert_array_equal(_run(setup, **SAMPLED).tokens, out.tokens)


def test_engine_logprobs_equal_trainer_recompute(setup):
  _, graphdef, params, _ = setup
  out = _run(setup, temperature=1.6)
  b = len(PROMPTS) * G
  prompts, valid = _left_pad(PROMPTS)
  batch = TrainBatch(np.repeat(prompts, G, 0), np.repeat(valid, G, 0), out.tokens, out.mask,
                     out.logprobs, np.zeros(b, np.float32), np.arange(b) // G,
                     np.full(b, 1.6, np.float32))
  recomputed, _ = completion_logprobs(graphdef, params, batch, StepConfig(), with_entropy=False)
  diff = np.abs(np.where(out.mask, np.asarray(recomputed) - out.logprobs, 0.0))
  assert diff.max() <= 1e-4, diff.max()
  assert (out.logprobs[~out.mask] == 0).all()
  assert out.mask.sum() > b and np.abs(out.logprobs[out.mask]).mean() > 0.1


def _teacher_forced_logits(forward_logits, params, prompts, tokens):
  """[R, N, V] logits of each completion token given its prompt and the tokens before it, from
  one cache-free forward per row (prompt + completion right-padded)."""
  rows = [p for p in prompts for _ in range(G)]
  seq = np.zeros((len(rows), LP + N), np.int32)
  for r, p in enumerate(rows):
    seq[r, :len(p)], seq[r, len(p):len(p) + N] = p, tokens[r]
  full = np.asarray(forward_logits(params, seq))
  # The logits predicting completion token t sit at position len(prompt) - 1 + t.
  return np.stack([full[r, len(p) - 1:len(p) - 1 + N] for r, p in enumerate(rows)])


@pytest.mark.parametrize("sampling,engine_kind", [
    (dict(temperature=0.0), "full"), (dict(temperature=0.0), "windowed"), (SAMPLED, "full"),
    pytest.param(SAMPLED, "windowed", marks=pytest.mark.slow)],  # the fast suite's budget
    ids=["greedy-full", "greedy-windowed", "sampled-full", "sampled-windowed"])
def test_partial_rollout_switches_params_between_dispatches(request, switch, sampling,
                                                            engine_kind):
  setup = request.getfixturevalue("setup" if engine_kind == "full" else "windowed")
  _, _, params, engine = setup
  new_params, forward_logits = switch

  def source_switching_after_first_dispatch():
    calls = []

    def source():
      # Called before admission (v0), then after every dispatch (v1 from the first on).
      calls.append(1)
      return (0, params) if len(calls) == 1 else (1, new_params)
    return source

  engine.stats.clear()
  out = _run(setup, params_source=source_switching_after_first_dispatch(), steps=2, **sampling)
  v, m = out.versions, out.mask
  assert engine.stats["refresh"] == 1
  # The first 4 rows got slots at once: token 0 from insert and tokens 1-2 from the first
  # dispatch are v0, the rest v1. Later rows were prefilled after the switch: all v1.
  for r in range(out.tokens.shape[0]):
    n = out.lengths[r]
    want = np.where(np.arange(n) < 3, 0, 1) if r < 4 else np.ones(n, int)
    np.testing.assert_array_equal(v[r, :n], want, err_msg=f"row {r}")
    assert (v[r, n:] == -1).all()
  assert (v[:4] == 1).any() and (v == 0).any()

  # Each token is what its stamped version produces given the same prefix: the log-probs
  # equal the stamped params' teacher-forced ones, and greedy tokens are those params' argmax.
  temperature = sampling["temperature"]

  def stamped_logprobs(out):
    lg = {ver: _teacher_forced_logits(forward_logits, p, PROMPTS, out.tokens)
          for ver, p in ((0, params), (1, new_params))}
    lps = {ver: np.asarray(token_logprobs(x, out.tokens, temperature)) for ver, x in lg.items()}
    return lg, lps, np.where(out.mask, np.where(out.versions == 1, lps[1], lps[0]), 0)

  lg, lps, want_lp = stamped_logprobs(out)
  np.testing.assert_allclose(np.where(m, out.logprobs, 0), want_lp, atol=1e-4)
  # Not vacuous: the two versions disagree about these tokens.
  assert np.abs(np.where(m, lps[1] - lps[0], 0)).max() > 1e-2
  if temperature == 0.0:
    want_tok = np.where(v == 1, lg[1].argmax(-1), lg[0].argmax(-1))
    np.testing.assert_array_equal(np.where(m, out.tokens, 0), np.where(m, want_tok, 0))
  else:
    # The KV refresh is what makes this exact: keeping the old params' KV of the prefix, the
    # tokens after the switch are stamped v1 but scored by neither policy.
    engine.refresh_kv = False
    try:
      stale = _run(setup, params_source=source_switching_after_first_dispatch(), steps=2,
                   **sampling)
    finally:
      engine.refresh_kv = True
    _, _, want_stale = stamped_logprobs(stale)
    after_switch = stale.mask[:4] & (stale.versions[:4] == 1)
    assert after_switch.any()
    assert np.abs(stale.logprobs[:4] - want_stale[:4])[after_switch].max() > 1e-3


@pytest.mark.parametrize("engine_kind", ["full", "windowed"])
def test_no_recompile_once_warm(request, engine_kind):
  setup = request.getfixturevalue("setup" if engine_kind == "full" else "windowed")
  _, _, params, engine = setup
  engine.warmup(params)  # every prefill bucket (8 and 4), the inserts, every decode program
  # Every trace of a jitted function in this process is counted (JAX's own monitoring event),
  # so nothing can be compiled below without this test seeing it, whichever jit cache it is in.
  traces = []
  listener = lambda event, _secs, **_: traces.append(event) if event.endswith(
      "jaxpr_trace_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    engine.warmup(params)  # warm already: a second warm-up traces nothing
    assert traces == []
    _check_no_recompile(setup)
    assert traces == []
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  with pytest.raises(ValueError, match="prompt 1 has 9 tokens"):
    _run(setup, prompts=[[2], [3] * 9, [4]])
  with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
    _run(setup, prompts=[[], [3], [4]])


def _check_no_recompile(setup):
  # Other lengths in the same buckets (7, 5 -> 8; 2 -> 4), other sampling settings, version,
  # request ids, steps per dispatch and key: nothing new to compile.
  _run(setup, **SAMPLED)
  _run(setup, key=3, ids=np.arange(9) * 7, prompts=[[3] * 7, [4] * 5, [6, 7]], temperature=1.3,
       top_k=0, top_p=0.8, version=5, steps=5)
  _run(setup, prompts=[[9] * 8, [2, 2, 2, 2], [12]], temperature=0.0)


def test_default_buckets_are_powers_of_two_up_to_the_limit():
  assert default_buckets(100) == (16, 32, 64, 100)
  assert default_buckets(64) == (16, 32, 64)
  assert default_buckets(8) == (8,)
