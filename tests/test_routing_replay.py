"""Routing replay in runs (docs/moe.md): the samplers record each generated token's experts, the
batch carries them through the data plane and packing, and the train step replays them
(`moe.routing_replay = rollout`) or only compares them with its own router
(`moe/routing_mismatch*`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import PREFIX, ConfigError, validate
from jaxrl.core.types import TrainBatch
from jaxrl.learner import packing, routing
from jaxrl.learner.step import StepConfig, build_train_step, completion_logprobs, make_optimizer
from jaxrl.models import ModelConfig, init_model
from jaxrl.parallel import make_mesh
from jaxrl.pipeline.batch_meta import BatchMeta
from jaxrl.pipeline.row_store import DataPlane
from jaxrl.recipes import default, default_moe
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.multi_turn import Episodes
from jaxrl.rollout.static_sampler import make_sampler

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=48, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16)
EOS, PAD, N, G = 63, 0, 6, 2
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 9], [8, 8, 2]]


@pytest.fixture(scope="module")
def model():
  return init_model(CFG, 0)


def _left(prompts, lp=5):
  toks = np.zeros((len(prompts), lp), np.int32)
  for i, p in enumerate(prompts):
    toks[i, lp - len(p):] = p
  return toks, toks > 0


def _sample(graphdef, params, engine: bool):
  """(tokens, mask, logprobs, routing) of G samples of each prompt, as host arrays."""
  ids = np.arange(len(PROMPTS) * G)
  if engine:
    eng = Engine(graphdef, num_slots=4, max_prompt_len=5, max_new_tokens=N, eos_id=EOS,
                 pad_id=PAD, steps_per_dispatch=3)
    out = eng.run(params, PROMPTS, ids, jax.random.key(1), 1.0, group_size=G)
  else:
    toks, valid = _left(PROMPTS)
    out = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=EOS, pad_id=PAD)(
        params, toks, valid, jax.random.key(1), ids, 1.0)
  return tuple(np.asarray(x) for x in (out.tokens, out.mask, out.logprobs, out.routing))


def _batch(tokens, mask, logprobs, routing) -> TrainBatch:
  toks, valid = _left(PROMPTS)
  b = len(tokens)
  return TrainBatch(
      prompt_tokens=jnp.repeat(toks, G, 0), prompt_valid=jnp.repeat(valid, G, 0),
      tokens=jnp.asarray(tokens), mask=jnp.asarray(mask), rollout_logprobs=jnp.asarray(logprobs),
      rewards=jnp.zeros(b), group_id=jnp.repeat(jnp.arange(b // G), G),
      temperature=jnp.ones(b), routing=None if routing is None else jnp.asarray(routing))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _policy_pass(graphdef, params, batch, cfg, packed=None, k=None):
  """The policy's log-probs and routing metrics (`packed`: of its micro-batch `k`, 1 stream)."""
  router: list = []
  logp, _ = completion_logprobs(graphdef, params, batch, cfg, with_entropy=False,
                                packed=None if packed is None else (packed, k, 1),
                                router_stats=router)
  return logp, routing.mismatch_means(router)


def _score(model, batch, **cfg):
  """(log-probs [B, N], routing metrics) of the policy's pass over `batch`."""
  logp, got = _policy_pass(*model, batch, StepConfig(**cfg))
  return np.asarray(logp), {k: float(s / max(float(c), 1.0)) for k, (s, c) in got.items()} | {
      "recorded": float(got["moe/routing_mismatch"][1])}


def _fed(mask):
  """Tokens the sampler fed back (every generated token but each row's last)."""
  return int(np.maximum(mask.sum(1) - 1, 0).sum())


@pytest.mark.slow
@pytest.mark.parametrize("engine", [False, True], ids=["static", "engine"])
def test_recorded_routing_is_the_models_own(model, engine):
  """Same params in the sampler and the trainer: every fed token's recorded experts are the
  trainer's own top-k (mismatch 0 over exactly the fed tokens); the last token and padding have
  none (-1)."""
  tokens, mask, logprobs, rec = _sample(*model, engine)
  assert rec.shape == (len(PROMPTS) * G, N, CFG.num_layers, CFG.num_experts_per_tok)
  assert rec.dtype == np.int16
  known = rec[..., 0, 0] >= 0
  lengths = mask.sum(1)
  np.testing.assert_array_equal(known, np.arange(N)[None, :] < (lengths - 1)[:, None])
  _, m = _score(model, _batch(tokens, mask, logprobs, rec))
  assert m["recorded"] == _fed(mask) * CFG.num_layers > 0
  assert m["moe/routing_mismatch/own"] == m["moe/routing_mismatch"] == 0.0
  assert m["moe/routing_mismatch/layer_1"] == 0.0


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_engine_records_what_the_static_sampler_records(model):
  a, b = _sample(*model, False), _sample(*model, True)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[3], b[3])


@pytest.mark.slow
def test_partial_rollout_refresh_rerecords_the_fed_tokens(model):
  """A switch of params version mid-batch (partial rollouts, `refresh_kv`) recomputes the fed
  tokens' experts under the new params: switching to params whose routers are permuted records
  the permuted experts for every token fed before the switch too."""
  graphdef, params = model
  perm = jnp.roll(jnp.arange(CFG.num_experts), 1)  # expert e's weights move to slot e + 1
  moved = jax.tree_util.tree_map_with_path(
      lambda path, x: x[..., perm] if "router" in jax.tree_util.keystr(path) else
      x[:, perm] if any(w in jax.tree_util.keystr(path) for w in ("we_gate", "we_up", "we_down"))
      else x, params)
  calls = []

  def source():
    calls.append(1)
    return (0, params) if len(calls) == 1 else (1, moved)

  eng = Engine(graphdef, num_slots=6, max_prompt_len=5, max_new_tokens=N, eos_id=EOS,
               pad_id=PAD, steps_per_dispatch=2, compact=False)
  ids = np.arange(len(PROMPTS) * G)
  base = eng.run(params, PROMPTS, ids, jax.random.key(1), 1.0, group_size=G)
  got = eng.run(params, PROMPTS, ids, jax.random.key(1), 1.0, group_size=G,
                params_source=source)
  assert eng.stats["refresh"] == 1
  # The same function (experts renamed), so the same tokens; every recorded expert renamed.
  np.testing.assert_array_equal(got.tokens, base.tokens)
  known = base.routing >= 0
  np.testing.assert_array_equal(got.routing[known], (base.routing[known] + 1) % CFG.num_experts)
  assert (got.routing[~known] == -1).all()


@pytest.mark.parametrize("layout", [
    {}, pytest.param({"shared_prompts": G, "pack_prompts": True}, marks=pytest.mark.slow),
    pytest.param({"shared_prompts": G, "pack_prompts": False}, marks=pytest.mark.slow)],
    ids=["rows", "grouped_packed", "grouped_two_pass"])
def test_replay_uses_the_given_experts(model, layout):
  """Replaying the sampler's experts gives the sampler's log-probs; forcing other experts
  changes the log-probs, the experts used equal the given ones (mismatch 0) while the trainer's
  own router disagrees on every recorded token-layer (1.0); without replay the given experts
  change nothing but the metrics."""
  tokens, mask, logprobs, rec = _sample(*model, False)
  lp_own, _ = _score(model, _batch(tokens, mask, logprobs, None), **layout)
  lp, m = _score(model, _batch(tokens, mask, logprobs, rec), routing_replay=True, **layout)
  np.testing.assert_allclose(lp[mask], logprobs[mask], atol=2e-5)
  assert m["moe/routing_mismatch"] == 0.0

  # Every recorded expert shifted by one: {a, b} -> {a + 1, b + 1} (mod 8) is another set.
  forced = np.where(rec >= 0, (rec + 1) % CFG.num_experts, -1).astype(rec.dtype)
  lp_f, m = _score(model, _batch(tokens, mask, logprobs, forced), routing_replay=True, **layout)
  changed = np.abs(lp_f - lp_own)[mask]
  assert changed.max() > 1e-3
  # Token 0's log-prob comes from the prompt alone (trainer-routed): unchanged.
  np.testing.assert_allclose(lp_f[:, 0], lp_own[:, 0], atol=1e-6)
  assert m["moe/routing_mismatch"] == 0.0
  assert m["moe/routing_mismatch/own"] == m["moe/routing_mismatch/layer_0"] == 1.0

  lp_c, m = _score(model, _batch(tokens, mask, logprobs, forced), routing_replay=False, **layout)
  np.testing.assert_array_equal(lp_c, lp_own)
  assert m["moe/routing_mismatch"] == m["moe/routing_mismatch/own"] == 1.0


@pytest.mark.slow
def test_routing_stays_with_its_token_through_packing(model):
  """Rows packed end to end (in reversed order): each completion token's packed experts are its
  own, prompt positions have none, and replaying other experts through the packed rows gives
  the unpacked rows' log-probs."""
  graphdef, params = model
  tokens, mask, logprobs, rec = _sample(*model, False)
  forced = np.where(rec >= 0, (rec + 3) % CFG.num_experts, -1).astype(rec.dtype)
  rev = slice(None, None, -1)
  batch = _batch(tokens[rev], mask[rev], logprobs[rev], forced[rev])
  b, lp = batch.prompt_tokens.shape
  budget = 16
  streams = packing.capacity(b, lp, N, budget)
  packed = packing.pack(batch.prompt_tokens, batch.prompt_valid, batch.tokens, batch.mask,
                        batch.temperature, group=0, budget=budget, streams=streams,
                        routing=batch.routing)
  flat = np.asarray(packed.routing).reshape(streams * budget, CFG.num_layers, -1)
  slot = np.asarray(packed.slot)
  on = slot >= 0
  np.testing.assert_array_equal(flat[slot[on]], np.asarray(batch.routing)[on])
  shared = np.asarray(packed.shared).reshape(-1)
  assert (flat[shared] == -1).all() and shared.any()

  cfg = StepConfig(routing_replay=True)
  want, _ = _policy_pass(graphdef, params, batch, cfg)
  got = np.zeros((b, N), np.float32)
  for k in range(int(packed.used)):
    part, _ = _policy_pass(graphdef, params, batch, cfg, packed, jnp.int32(k))
    got += np.asarray(part)
  np.testing.assert_allclose(got[batch.mask], np.asarray(want)[batch.mask], atol=2e-5)


def test_routing_survives_the_data_plane_and_episodes(devices):
  """Rows stored and read back in another order keep their own experts; so do episodes
  selected and joined."""
  n = 8
  rng = np.random.default_rng(0)
  rec = rng.integers(-1, 8, (n, N, 2, 2)).astype(np.int16)
  tokens = np.arange(n * N, dtype=np.int32).reshape(n, N)
  dp = DataPlane(make_mesh(4, 2, 1))
  meta = BatchMeta("train", tuple(f"r{i}" for i in range(n)), np.arange(n) // 2,
                   np.full(n, N), np.zeros(n))
  dp.put(meta, {"tokens": tokens, "routing": rec})
  perm = rng.permutation(n)
  got = dp.get(meta.subset(perm), ["tokens", "routing"])
  np.testing.assert_array_equal(np.asarray(got["tokens"]), tokens[perm])
  np.testing.assert_array_equal(np.asarray(got["routing"]), rec[perm])

  z = lambda *s: np.zeros(s, np.float32)
  ep = Episodes(tasks=[None] * n, prompt_tokens=z(n, 3), prompt_valid=z(n, 3), tokens=tokens,
                valid=z(n, N), mask=z(n, N), logprobs=z(n, N), policy_version=z(n, N),
                rewards=z(n), components={}, metadata={}, turns=z(n), terminated=z(n),
                truncated=z(n), failed=z(n), fail_reasons=[None] * n, env_calls=0,
                env_calls_by_env={}, routing=rec)
  joined = Episodes.concat([ep.select(perm[:3]), ep.select(perm[3:])])
  np.testing.assert_array_equal(joined.routing, rec[perm])
  np.testing.assert_array_equal(joined.tokens, tokens[perm])


@pytest.mark.slow
def test_train_step_reports_routing_mismatch(model):
  """The jitted step (micro-batched, replaying) logs the used mismatch (0) and the trainer's
  own router's (the forced half of the rows), overall and per layer."""
  graphdef, params = model
  tokens, mask, logprobs, rec = _sample(*model, False)
  forced = np.where(rec >= 0, (rec + 1) % CFG.num_experts, -1).astype(rec.dtype)
  forced[: len(forced) // 2] = rec[: len(rec) // 2]  # half the rows as sampled
  batch = _batch(tokens, mask, logprobs, forced)._replace(
      rewards=jnp.arange(len(tokens), dtype=jnp.float32))
  own_half = _fed(mask[len(mask) // 2:]) / _fed(mask)
  step, init = build_train_step(graphdef, make_optimizer(1e-3), StepConfig(
      routing_replay=True, num_microbatches=3), make_mesh(1, 1, 1), params)
  _, m = step(init(jax.tree.map(jnp.copy, params)), batch)
  assert float(m["moe/routing_mismatch/own"]) == pytest.approx(own_half, abs=1e-6)
  assert float(m["moe/routing_mismatch/layer_1"]) == pytest.approx(own_half, abs=1e-6)
  assert float(m["moe/routing_mismatch"]) == 0.0


def test_routing_replay_on_a_dense_model_is_one_config_line():
  cfg = default.get_config()
  cfg.moe.routing_replay = "rollout"
  with pytest.raises(ConfigError) as info:
    validate(cfg, 1)
  assert str(info.value).startswith(f"{PREFIX}moe.routing_replay:")
  assert len(str(info.value).splitlines()) == 1
  cfg = default_moe.get_config()
  cfg.moe.routing_replay = "rollout"
  validate(cfg, 1)
