"""The mixture-of-experts layer (`jaxrl.models.moe`): routing, both grouped matmuls against a
per-token reference in numpy, the load-balancing loss's arithmetic, the model with experts, and
compiled FLOPs that scale with top-k."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import moe
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import abstract_model, init_model


def tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              mlp_dim=48, qk_norm=True, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=16)
  base.update(kw)
  return ModelConfig(**base)


def reference_moe(x, router, gate, up, down, k, norm):
  """Every token through its top-k experts one by one, in float64 numpy."""
  x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
  logits = x @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    top = np.argsort(-probs[n], kind="stable")[:k]
    w = probs[n, top] / (probs[n, top].sum() if norm else 1.0)
    for e, we in zip(top, w):
      g, u = x[n] @ gate[e], x[n] @ up[e]
      out[n] += we * ((g / (1 + np.exp(-g)) * u) @ down[e])
  return out


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("k,norm", [(2, True), (3, False), (8, True)])
def test_moe_mlp_matches_a_per_token_reference(impl, k, norm):
  cfg = tiny(num_experts_per_tok=k, norm_topk_prob=norm, moe_dispatch=impl)
  keys = jax.random.split(jax.random.key(0), 5)
  d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size
  x = jax.random.normal(keys[0], (3, 7, d))
  p = {"router": jax.random.normal(keys[1], (d, e)),
       "we_gate": jax.random.normal(keys[2], (e, d, f)) * 0.2,
       "we_up": jax.random.normal(keys[3], (e, d, f)) * 0.2,
       "we_down": jax.random.normal(keys[4], (e, f, d)) * 0.2}
  y, stats = jax.jit(lambda x, p: moe.moe_mlp(x, p, cfg, None))(x, p)
  want = reference_moe(x.reshape(-1, d), p["router"], p["we_gate"], p["we_up"], p["we_down"],
                       k, norm)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, d), want, atol=2e-5, rtol=1e-4)
  # Every token counted k times, once per selected expert.
  assert float(stats.tokens) == 21 and float(stats.counts.sum()) == 21 * k
  assert stats.experts.shape == (3, 7, k)


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_grouped_matmuls_agree_in_value_and_gradient():
  """The blocked product and `ragged_dot` on uneven groups (one empty), with their gradients."""
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (37, 5))
  w = jax.random.normal(keys[1], (4, 5, 6))
  sizes = jnp.array([20, 0, 9, 8], jnp.int32)
  g = jax.random.normal(keys[2], (37, 6))

  def loss(impl):
    return lambda x, w: jnp.sum(moe.grouped_matmul(x, w, sizes, impl) * g)

  want = np.concatenate([np.asarray(x[:20] @ w[0]), np.asarray(x[20:29] @ w[2]),
                         np.asarray(x[29:] @ w[3])])
  for impl in ("blocked", "ragged_dot"):
    np.testing.assert_allclose(moe.grouped_matmul(x, w, sizes, impl), want, atol=1e-5)
  gb = jax.grad(loss("blocked"), argnums=(0, 1))(x, w)
  gr = jax.grad(loss("ragged_dot"), argnums=(0, 1))(x, w)
  for a, b in zip(gb, gr):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert float(jnp.abs(gb[1][1]).max()) == 0.0  # the empty group's weight gets no gradient


def test_aux_loss_arithmetic():
  """E * sum_e f_e P_e pooled over layers: even routing of 2 of 4 experts gives k = 2; every
  token on experts 0 and 1 with probability 1/2 each gives E * (1 * 1/2 + 1 * 1/2) = 4."""
  even = moe.RouterStats(counts=jnp.full((2, 4), 10.0), probs=jnp.full((2, 4), 5.0),
                         tokens=jnp.array([20.0, 20.0]), experts=jnp.zeros((2, 1, 1, 2)))
  assert float(moe.aux_loss(even, 4)) == pytest.approx(2.0)
  skew = moe.RouterStats(counts=jnp.array([[20.0, 20, 0, 0]]), probs=jnp.array([[10.0, 10, 0, 0]]),
                         tokens=jnp.array([20.0]), experts=jnp.zeros((1, 1, 1, 2)))
  assert float(moe.aux_loss(skew, 4)) == pytest.approx(4.0)


# One model (scanned layers) and one token shape for the model-level tests below: the scanned
# forward, the unrolled forward, routing replay and its gradient each compile once.
TOKENS = jnp.arange(20).reshape(2, 10) * 3 % 64
POS = jnp.broadcast_to(jnp.arange(10), (2, 10))


@pytest.fixture(scope="module")
def moe_model():
  cfg = tiny()
  graphdef, params = init_model(cfg, 7)
  g_unrolled, _ = abstract_model(dataclasses.replace(cfg, scan_layers=False))
  return cfg, graphdef, g_unrolled, params


@functools.partial(jax.jit, static_argnums=0)
def moe_forward(graphdef, params, valid, routing=None):
  model = nnx.merge(graphdef, params)
  hidden, _ = model(TOKENS, POS, valid, routing=routing)
  (stats,) = moe.pop_router_stats(model)
  return hidden, stats


def test_padding_is_not_counted_in_router_statistics(moe_model):
  cfg, graphdef, _, params = moe_model
  valid = jnp.arange(10)[None, :] < jnp.array([[8], [5]])
  _, stats = moe_forward(graphdef, params, valid)
  assert stats.tokens.shape == (cfg.num_layers,)
  np.testing.assert_array_equal(stats.tokens, [13.0, 13.0])
  np.testing.assert_allclose(stats.counts.sum(-1), [26.0, 26.0])
  np.testing.assert_allclose(stats.probs.sum(-1), [13.0, 13.0], rtol=1e-6)


def test_scanned_and_unrolled_moe_models_agree(moe_model):
  _, graphdef, g_unrolled, params = moe_model
  valid = jnp.ones((2, 10), bool)
  out = [moe_forward(g, params, valid)[0] for g in (graphdef, g_unrolled)]
  np.testing.assert_allclose(out[0], out[1], atol=1e-6)


def test_bad_moe_configs_are_refused():
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    tiny(num_experts_per_tok=9)
  with pytest.raises(ValueError, match="moe_intermediate_size"):
    tiny(moe_intermediate_size=0)
  with pytest.raises(ValueError, match="moe_dispatch"):
    tiny(moe_dispatch="dense")
  with pytest.raises(ValueError, match="adapts only q, k, v, o"):
    tiny(lora_rank=4, lora_targets=("q", "up"))


def _train_flops(k: int) -> float:
  """Compiled FLOPs (XLA's cost analysis) of a forward and backward through the model with
  top-k of 8 experts, everything else the same."""
  cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_dim=64, num_experts=8, num_experts_per_tok=k,
                    moe_intermediate_size=256, moe_dispatch="blocked")
  graphdef, params = abstract_model(cfg)
  tokens = jax.ShapeDtypeStruct((4, 128), jnp.int32)
  valid = jax.ShapeDtypeStruct((4, 128), jnp.bool_)

  def loss(params, tokens, valid):
    model = nnx.merge(graphdef, params)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(tokens, pos, valid)
    stats = moe.pop_router_stats(model)
    return jnp.mean(model.logits(hidden)) + 0.01 * moe.aux_loss(stats[0], cfg.num_experts)

  compiled = jax.jit(jax.grad(loss)).lower(params, tokens, valid).compile()
  return float(compiled.cost_analysis()["flops"])


@pytest.mark.slow
def test_compiled_flops_scale_with_top_k():
  """Acceptance: top-2 of 8 costs at most 0.4x top-8 (the experts' share is 2/8 = 0.25; the
  attention, router, embedding and tile padding are the rest)."""
  f2, f8 = _train_flops(2), _train_flops(8)
  assert f2 <= 0.4 * f8, (f2, f8, f2 / f8)


@pytest.mark.slow  # fast-suite time budget (the MoE forward and gradient: tests above)
def test_experts_sharded_over_eight_devices_match_one(devices):
  """Experts split over 'fsdp' (2 data x 4 fsdp: two experts per device), rows over both batch
  axes: the loss, the load-balancing loss and every gradient match one device's within 1e-5."""
  from jaxrl.parallel import make_mesh, param_shardings
  from jaxrl.parallel.sharding import batch_sharding

  cfg = tiny(num_experts_per_tok=3)
  graphdef, params = init_model(cfg, 5)
  tokens = jax.random.randint(jax.random.key(2), (8, 12), 0, cfg.vocab_size)
  valid = jnp.arange(12)[None, :] < jnp.arange(5, 13)[:, None]

  def loss(params, tokens, valid):
    model = nnx.merge(graphdef, params)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(tokens, pos, valid)
    aux = moe.aux_loss(moe.pop_router_stats(model)[0], cfg.num_experts)
    logp = jax.nn.log_softmax(model.logits(hidden))
    nll = -jnp.sum(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
                   * valid[:, 1:]) / jnp.sum(valid[:, 1:])
    return nll + 0.1 * aux, aux

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (l1, a1), g1 = step(params, tokens, valid)
  mesh = make_mesh(2, 4, 1, devices)
  sharded = jax.device_put(params, param_shardings(params, mesh))
  assert sharded["we_gate"][...].sharding.spec[:3] == (None, "fsdp", None)
  rows = batch_sharding(mesh)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    (l8, a8), g8 = step(sharded, jax.device_put(tokens, rows), jax.device_put(valid, rows))
  np.testing.assert_allclose(l8, l1, atol=1e-5)
  np.testing.assert_allclose(a8, a1, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g8, g1)


def test_qwen3_30b_a3b_preset_counts():
  """The preset's parameter count from its shapes (no allocation): per layer attention
  D (H + 2 K) Dh + H Dh D = 2048 (32 + 8) 128 + 32 128 2048 = 18,874,368, q/k norms 256, two
  RMSNorms 4,096, router D E = 262,144, experts 3 E D F = 3 128 2048 768 = 603,979,776;
  48 layers plus embedding and head 2 V D = 622,329,856 and the final norm: 30,532,122,624.
  Active per token: 8 of 128 experts, 3,353,032,704."""
  cfg = ModelConfig.qwen3_30b_a3b()
  _, params = abstract_model(cfg)
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  assert total == 30_532_122_624
  expert = 3 * 128 * 2048 * 768
  active = total - 48 * expert + 48 * expert * 8 // 128
  assert active == 3_353_032_704


# In the slow step (fast-suite time budget); scanned and unrolled MoE models agree in
# test_scanned_and_unrolled_moe_models_agree.
@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_routing_replay(scan, moe_model):
  """Replaying the model's own routing changes nothing (mismatch 0); replaying other experts
  changes the output, counts exactly the tokens whose expert set differs, and the router still
  gets a gradient."""
  cfg, g_scanned, g_unrolled, params = moe_model
  graphdef = g_scanned if scan else g_unrolled
  valid = jnp.arange(10)[None, :] < jnp.array([[10], [6]])

  def forward(params, routing=None):
    return moe_forward(graphdef, params, valid, routing)

  hidden, own = forward(params)
  assert own.experts.shape == (cfg.num_layers, 2, 10, 2)
  again, stats = forward(params, own.experts)
  np.testing.assert_allclose(again, hidden, atol=1e-6)
  assert float(moe.routing_mismatch(stats)[0]) == 0.0

  # Other experts for every valid token of layer 0's first row: 10 of the 32 valid
  # token-layers differ (the order within a token's k does not count).
  other = own.experts.at[0, 0].set((own.experts[0, 0] + 1) % cfg.num_experts)
  swapped = own.experts.at[1].set(own.experts[1][..., ::-1])
  replayed, stats = forward(params, other.at[1].set(swapped[1]))
  overall, per_layer = moe.routing_mismatch(stats)
  np.testing.assert_allclose(per_layer, [10 / 16, 0.0])
  assert float(overall) == pytest.approx(10 / 32)
  assert float(jnp.abs(replayed - hidden).max()) > 1e-4

  grad = jax.jit(jax.grad(lambda p: jnp.sum(forward(p, other)[0] ** 2)))(params)
  assert float(jnp.abs(grad["router"][...]).max()) > 0


@pytest.mark.slow
def test_capacity_factor_drops_the_later_tokens():
  """All 6 tokens routed to experts {0, 1} (a router that prefers them), k = 2 of 8: each of
  experts 0 and 1 gets 6 assignments. Capacity ceil(1.0 x 6 x 2 / 8) = 2: tokens 0 and 1 keep
  both experts, tokens 2..5 lose both (8 of 12 assignments dropped, and their output is 0);
  factor 4.0: ceil(4 x 12 / 8) = 6, nothing dropped; 0 (dropless) never drops."""
  cfg = tiny(num_experts_per_tok=2)
  x = jax.random.normal(jax.random.key(0), (1, 6, cfg.d_model))
  k = jax.random.split(jax.random.key(1), 3)
  f = cfg.moe_intermediate_size
  p = {"router": jnp.zeros((cfg.d_model, 8)),
       "we_gate": jax.random.normal(k[0], (8, cfg.d_model, f)),
       "we_up": jax.random.normal(k[1], (8, cfg.d_model, f)),
       "we_down": jax.random.normal(k[2], (8, f, cfg.d_model))}
  # Router logits: experts 0 and 1 at +10 for every token (a bias through a constant input).
  x = x.at[..., 0].set(1.0)
  p["router"] = p["router"].at[0, :2].set(10.0).at[1:, :].set(0.0)
  out = {}
  for factor in (0.0, 1.0, 4.0):
    c = dataclasses.replace(cfg, moe_capacity_factor=factor)
    out[factor], stats = moe.moe_mlp(x, p, c, None)
    assert float(stats.dropped) == {0.0: 0, 1.0: 8, 4.0: 0}[factor]
  np.testing.assert_array_equal(out[4.0], out[0.0])
  np.testing.assert_array_equal(out[1.0][0, :2], out[0.0][0, :2])
  assert float(jnp.abs(out[1.0][0, 2:]).max()) == 0.0
  assert float(jnp.abs(out[0.0][0, 2:]).min()) > 0.0
