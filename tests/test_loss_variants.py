"""The loss variants users bring from other trainers (TRL's GRPO definitions): batch-std
advantages and the std's ddof, importance-weighted reference KL, KL terms reduced like the policy
term, SAPO; against the NumPy references (tests/losses_numpy.py), their properties, their config
keys, and a few train steps each.

The TRL mapping these follow (trl/trainer/grpo_trainer.py): `scale_rewards` "group" / "batch" /
"none" = `advantage.estimator` grpo / grpo_batch_std / dr_grpo with `advantage.std_ddof=1`;
`use_bias_correction_kl` = `ref_kl.importance_weighted`; `beta * per_token_kl` added before the
`loss_type` reduction = `ref_kl.reduction="policy"`; `loss_type="sapo"` = `loss.policy="sapo"`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxrl.losses as L
import losses_numpy as ref  # tests/ is on sys.path (rootdir-less test modules)
from loss_checks import close, kl_inputs, rounded, tol
from conftest import tiny_model_config
from jaxrl import parallel
from jaxrl.config import ConfigError, parse_overrides, validate
from jaxrl.recipes.default import get_config
from jaxrl.models import init_model
from jaxrl.learner.rl import rl_step_config
from jaxrl.learner.step import (StepConfig, build_train_step, completion_logprobs, make_optimizer,
                              shard_params)
from jaxrl.core.types import TrainBatch

B, N = 6, 5
DTYPES = [jnp.float32, jnp.bfloat16]
PROPS = settings(max_examples=20, deadline=None, database=None)


def make(seed, b=B, n=N, mask=None):
  """Random log-probs with ratios on both sides of 1 and a padding row."""
  rng = np.random.default_rng(seed)
  lp = -rng.uniform(0.05, 3.0, (b, n))
  lp_old = lp - rng.choice([-1.0, 1.0], (b, n)) * rng.uniform(0.0, 1.0, (b, n))
  lp_gen = lp_old + rng.normal(0.0, 0.3, (b, n))
  lp_ref = lp + rng.choice([-1.0, 1.0], (b, n)) * rng.uniform(0.05, 1.0, (b, n))
  if mask is None:
    mask = rng.random((b, n)) < 0.7
    mask[-1] = False
    mask[0, 0] = True
  return dict(lp=lp, lp_old=lp_old, lp_gen=lp_gen, lp_ref=lp_ref, adv=rng.normal(size=b),
              mask=np.asarray(mask, bool), cot=rng.normal(size=(b, n)))


# --- 1. advantages scaled by the batch std; the std's ddof --------------------------------------


def adv(estimator, rewards, group_id, valid=None, **kw):
  r = jnp.asarray(rewards, jnp.float32)
  v = None if valid is None else jnp.asarray(valid, bool)
  return np.asarray(L.compute_advantages(estimator, r, jnp.asarray(group_id), v, **kw))


def test_grpo_batch_std_golden():
  # Groups [1, 0] and [3, 3]: group means 1/2 and 3; batch mean 7/4, squared deviations
  # (9 + 49 + 25 + 25) / 16 = 6.75. ddof 0: std sqrt(6.75 / 4) = 1.299 -> +-0.5 / 1.299 = +-0.3849;
  # ddof 1 (TRL's nanstd): sqrt(6.75 / 3) = 1.5 -> +-1/3. The constant group gets exactly 0.
  # grpo (group std 1/2) would give +-1: the batch std shrinks this easy-to-separate group.
  r, g = [1, 0, 3, 3], [0, 0, 1, 1]
  np.testing.assert_allclose(adv("grpo_batch_std", r, g, eps=0.0),
                             [0.5 / math.sqrt(6.75 / 4), -0.5 / math.sqrt(6.75 / 4), 0, 0],
                             rtol=1e-6)
  np.testing.assert_allclose(adv("grpo_batch_std", r, g, eps=0.0, ddof=1), [1 / 3, -1 / 3, 0, 0],
                             rtol=1e-6)
  np.testing.assert_allclose(adv("grpo", r, g, eps=0.0), [1, -1, 0, 0], rtol=1e-6)
  # TRL's eps 1e-4: 0.5 / (1.5 + 1e-4) = 0.333311.
  np.testing.assert_allclose(adv("grpo_batch_std", r, g, eps=1e-4, ddof=1)[:2],
                             [0.5 / 1.5001, -0.5 / 1.5001], rtol=1e-6)
  # grpo's std takes the ddof as well: group [1, 0] sample std sqrt(0.5) -> +-0.7071.
  np.testing.assert_allclose(adv("grpo", r, g, eps=0.0, ddof=1)[:2], [0.7071068, -0.7071068],
                             rtol=1e-6)


def test_grpo_batch_std_zero_spread_and_invalid_samples():
  # Every group constant but the batch spread (std 1): the centred values are rounding residues
  # of 0.3 etc. and must come out exactly 0, not residue / std.
  r = np.repeat(np.float32([0.3, 1.7, -2.1]), 3)
  np.testing.assert_array_equal(adv("grpo_batch_std", r, np.repeat([0, 1, 2], 3), eps=0.0), 0.0)
  # A batch without spread: 0 (not 0/0), also with ddof 1 and a single valid sample.
  np.testing.assert_array_equal(adv("grpo_batch_std", [2.0] * 4, [0, 0, 1, 1], eps=0.0), 0.0)
  np.testing.assert_array_equal(
      adv("grpo_batch_std", [1.0, np.nan], [0, 0], [True, False], ddof=1), 0.0)
  # Invalid samples (NaN/inf rewards) are out of the group mean and the batch std: the batch is
  # [1, 0, 2, 4] -> mean 7/4, squared deviations (9 + 49 + 1 + 81) / 16 = 8.75, std
  # sqrt(8.75 / 4) = 1.479; A = [0.5, -0.5, 0, 0, -1, 1] / 1.479.
  r = [1.0, 0.0, np.nan, np.inf, 2.0, 4.0]
  valid = [1, 1, 0, 0, 1, 1]
  s = math.sqrt(8.75 / 4)
  np.testing.assert_allclose(adv("grpo_batch_std", r, [0, 0, 0, 1, 1, 1], valid, eps=0.0),
                             [0.5 / s, -0.5 / s, 0, 0, -1 / s, 1 / s], rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_batch_std_matches_numpy_values_and_gradients(ddof, dtype):
  rng = np.random.default_rng(1)
  b = 24
  r = rng.normal(size=b)
  g = rng.choice([5, -2, 11, 40, 3], size=b)
  valid = rng.random(b) < 0.8
  cot = rng.normal(size=b)
  rj, r64 = rounded(r, dtype)
  f = lambda x: L.compute_advantages("grpo_batch_std", x, jnp.asarray(g), jnp.asarray(valid),
                                     ddof=ddof)
  close(f(rj), ref.advantages("grpo_batch_std", r64, g, valid, ddof=ddof), **tol(dtype))
  grad = jax.grad(lambda x: jnp.sum(f(x) * cot))(rj)
  assert grad.dtype == dtype
  fd = ref.fd_grad(lambda x: np.sum(ref.advantages("grpo_batch_std", x, g, valid, ddof=ddof) *
                                    cot), r64)
  close(grad, fd, **tol(dtype, grad=True))
  assert np.all(np.asarray(grad, np.float32)[~valid] == 0)


# Discrete rewards, as verifiers give: an affine map keeps which of them are equal in float32.
rewards_st = hnp.arrays(np.float64, 12, elements=st.sampled_from([-1.0, 0.0, 0.25, 0.5, 1.0, 2.0]))


@PROPS
@given(r=rewards_st, scale=st.floats(0.1, 10), shift=st.floats(-10, 10),
       groups=st.sampled_from([np.arange(12) // 4, np.arange(12) % 3, np.zeros(12, int)]))
def test_property_grpo_batch_std_is_affine_invariant_and_one_group_is_grpo(r, scale, shift,
                                                                            groups):
  # (a r + b - mean_g(a r + b)) / std_batch(a r + b) = (r - mean_g) / std_batch for a > 0.
  base = adv("grpo_batch_std", r, groups, eps=0.0, ddof=1)
  moved = adv("grpo_batch_std", r * scale + shift, groups, eps=0.0, ddof=1)
  np.testing.assert_allclose(moved, base, rtol=1e-3, atol=1e-3)
  assert np.all(np.isfinite(base))
  # With one group the batch std is the group std: grpo_batch_std == grpo.
  one = np.zeros(12, int)
  np.testing.assert_allclose(adv("grpo_batch_std", r, one, eps=0.0, ddof=1),
                             adv("grpo", r, one, eps=0.0, ddof=1), rtol=1e-5, atol=1e-5)


# --- 2. importance-weighted (bias-corrected) KL --------------------------------------------------


def test_importance_weighted_kl_golden():
  # lp -1, base -2, behaviour -1.5: w = e^0.5 = 1.6487, d = 1, k3 = e^-1 = 0.3679, value
  # w k3 = 0.6065; gradient w k3 + w (1 - e^-1) = w d = 1.6487. An unweighted k3 would give
  # 0.3679 with gradient 0.6321; a detached w (TRL does not detach) would give 1.0422.
  lp, base, mu = jnp.array([-1.0]), jnp.array([-2.0]), jnp.array([-1.5])
  w = math.exp(0.5)
  close(L.importance_weighted_kl(lp, base, mu, "k3"), [w * math.exp(-1)], rtol=1e-6)
  g = jax.grad(lambda x: jnp.sum(L.importance_weighted_kl(x, base, mu, "k3")))(lp)
  close(g, [w], rtol=1e-6)
  # Base and behaviour are constants.
  for arg in (1, 2):
    def f(z, arg=arg):
      args = [lp, base, mu]
      args[arg] = z
      return jnp.sum(L.importance_weighted_kl(*args, "k3"))
    assert float(jax.grad(f)([lp, base, mu][arg])[0]) == 0.0
  # Sequence level: one row, lp - mu = [0.2, 0.6] -> w = e^0.4 for both tokens.
  w_seq = L.importance_weight(jnp.array([[-1.0, -1.0]]), jnp.array([[-1.2, -1.6]]),
                              level="sequence")
  close(w_seq, [[math.exp(0.4)] * 2], rtol=1e-6)
  with pytest.raises(ValueError, match="unknown importance level"):
    L.importance_weight(lp, mu, level="row")


def test_importance_weighted_kl_on_policy_keeps_the_value_and_adds_the_score_term():
  # lp_behaviour = sg(lp): w = 1, so the value is the plain estimate; the gradient gains
  # k * grad lp (the score-function term): k3 -> k3 + k3' = d, i.e. k2's gradient.
  x = make(2)
  m, lp, base = x["mask"], jnp.asarray(x["lp"], jnp.float32), jnp.asarray(x["lp_ref"],
                                                                          jnp.float32)
  for est in L.KL_ESTIMATORS:
    f = lambda z: L.importance_weighted_kl(z, base, jax.lax.stop_gradient(z), est, m)
    close(f(lp), L.kl_estimate(lp, base, est, m), rtol=1e-6)
    kv, kg = ref.kl(x["lp"], x["lp_ref"], est, m)
    close(jax.grad(lambda z: jnp.sum(f(z)))(lp), kv + kg, rtol=1e-5, atol=1e-6)
  g3 = jax.grad(lambda z: jnp.sum(L.importance_weighted_kl(z, base, jax.lax.stop_gradient(z),
                                                           "k3", m)))(lp)
  close(g3, jax.grad(lambda z: jnp.sum(L.kl_estimate(z, base, "k2", m)))(lp), rtol=1e-5,
        atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_importance_weighted_kl_matches_numpy(estimator, level, dtype):
  x = make(4)
  m = x["mask"]
  lp, lp64 = rounded(x["lp"], dtype)
  base, base64 = rounded(x["lp_ref"], dtype)
  mu, mu64 = rounded(x["lp_gen"], dtype)
  f = lambda z: L.importance_weighted_kl(z, base, mu, estimator, m, level=level)
  close(f(lp), ref.importance_weighted_kl(lp64, base64, mu64, estimator, m, level), **tol(dtype))
  g = jax.grad(lambda z: jnp.sum(f(z) * x["cot"]))(lp)
  assert g.dtype == dtype
  fd = ref.fd_grad(lambda z: np.sum(ref.importance_weighted_kl(z, base64, mu64, estimator, m,
                                                               level) * x["cot"]), lp64)
  close(g, fd, **tol(dtype, grad=True))


# --- 3. KL terms reduced like the policy term -----------------------------------------------------


def test_kl_reduction_policy_follows_the_loss_reduction():
  # Dr. GRPO: reduction seq_mean_token_sum_norm with norm_len 4. One row of three tokens with
  # k2 = d^2 / 2 = [0.5, 2, 0] (d = [1, -2, 0]) and zero advantages: the KL term is
  # coef * (2.5 / 4) / 1 row = 0.5 * 0.625 = 0.3125 with "policy"; "token_mean" would give
  # 0.5 * 2.5 / 3 = 0.4167 and "seq_mean" the same here (one row).
  lp = jnp.array([[-1.0, -3.0, -1.0]])
  base = jnp.array([[-2.0, -1.0, -1.0]])
  mask = jnp.ones((1, 3), bool)
  for red, want in (("policy", 0.3125), ("token_mean", 0.5 * 2.5 / 3)):
    cfg = L.ObjectiveConfig(policy="reinforce", reduction="seq_mean_token_sum_norm", norm_len=4,
                            ref_kl_coef=0.5, ref_kl_estimator="k2", ref_kl_reduction=red)
    loss, _ = L.objective(cfg, lp, lp, jnp.zeros(1), mask, L.global_counts(cfg, mask),
                          lp_ref=base)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  cfg = L.ObjectiveConfig(reduction="seq_mean_token_sum", rollout_kl_reduction="policy",
                          ref_kl_reduction="seq_mean")
  assert cfg.kl_reduction("policy") == "seq_mean_token_sum"
  assert cfg.reductions() == ("seq_mean_token_mean", "seq_mean_token_sum")
  with pytest.raises(ValueError, match="unknown KL reduction 'sum'"):
    cfg.kl_reduction("sum")


def run(cfg, x, rows=slice(None), counts=None, dtype=jnp.float32):
  """(loss, stats, grad wrt lp) of the objective on rows `rows` of `x`."""
  sub = {k: np.asarray(v)[rows] for k, v in x.items()}
  counts = L.global_counts(cfg, x["mask"]) if counts is None else counts
  cast = lambda k: jnp.asarray(np.asarray(sub[k], np.float32), dtype)
  f = lambda lp: L.objective(cfg, lp, cast("lp_old"), sub["adv"], sub["mask"], counts,
                             lp_gen=cast("lp_gen"), lp_ref=cast("lp_ref"))
  (loss, s), g = jax.value_and_grad(f, has_aux=True)(cast("lp"))
  return loss, s, g


VARIANTS = [
    # (policy, reduction, KL reductions, importance-weighted ref KL)
    ("sapo", "token_mean", "policy", False),
    ("sapo", "seq_mean_token_mean", "token_mean", True),
    ("ppo", "seq_mean_token_sum_norm", "policy", True),
    ("gspo", "seq_mean_token_mean", "policy", True),  # sequence-level weight
    ("cispo", "seq_mean_token_sum", "seq_mean", True),
    ("reinforce", "token_mean", "policy", True),
]


def variant_config(policy, reduction, kl_red, weighted, **kw):
  base = dict(policy=policy, reduction=reduction, eps_low=0.2, eps_high=0.28,
              sapo_tau_pos=1.5, sapo_tau_neg=2.5, rollout_kl_coef=0.3, rollout_kl_estimator="k2",
              rollout_kl_reduction=kl_red, ref_kl_coef=0.4, ref_kl_estimator="k3",
              ref_kl_reduction=kl_red, ref_kl_importance_weighted=weighted,
              norm_len=7 if reduction.endswith("norm") else None)
  base.update(kw)
  return L.ObjectiveConfig(**base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy,reduction,kl_red,weighted", VARIANTS)
def test_objective_variants_match_numpy(policy, reduction, kl_red, weighted, dtype):
  x = make(14)
  cfg = variant_config(policy, reduction, kl_red, weighted)
  loss, s, g = run(cfg, x, dtype=dtype)
  r = {k: rounded(x[k], dtype)[1] for k in ("lp", "lp_old", "lp_gen", "lp_ref")}
  cnt = ref.counts(cfg, x["mask"])
  f = lambda lp: ref.objective(cfg, lp, r["lp_old"], x["adv"], x["mask"], cnt, lp_gen=r["lp_gen"],
                               lp_ref=r["lp_ref"], lp_sg=r["lp"])
  e_loss, e_metrics = f(r["lp"])
  close(loss, e_loss, **tol(dtype))
  got = L.stats.finalize(s)
  for k in ("loss/policy", "ratio/mean", "rollout_kl", "ref_kl"):
    close(got[k], e_metrics[k], err_msg=k, **tol(dtype))
  close(g, ref.fd_grad(lambda z: f(z)[0], r["lp"]), **tol(dtype, grad=True))


def test_weighted_ref_kl_uses_the_policy_ratio_base():
  # ratio_base "rollout": w = exp(lp - lp_gen); "trainer": exp(lp - lp_old). lp = -1 everywhere,
  # lp_old = -1 (w = 1), lp_gen = -1.5 (w = e^0.5), lp_ref = -2 (d = 1, k3 = e^-1): the ref_kl
  # metric is 0.3679 and 0.6065.
  lp = jnp.full((2, 3), -1.0)
  mask = jnp.ones((2, 3), bool)
  for base, want in (("trainer", math.exp(-1)), ("rollout", math.exp(-0.5))):
    cfg = L.ObjectiveConfig(policy="reinforce", ratio_base=base, ref_kl_coef=1.0,
                            ref_kl_importance_weighted=True)
    _, s = L.objective(cfg, lp, lp, jnp.zeros(2), mask, L.global_counts(cfg, mask),
                       lp_gen=jnp.full((2, 3), -1.5), lp_ref=jnp.full((2, 3), -2.0))
    np.testing.assert_allclose(float(L.stats.finalize(s)["ref_kl"]), want, rtol=1e-6)


# --- 4. SAPO --------------------------------------------------------------------------------------


def test_sapo_golden():
  # tau 1 (A > 0), 1.05 (A <= 0). Row 0: A = 1, r = 2: loss -4 sigmoid(1) = -2.9242, gradient
  # -4 s (1 - s) r = -4 * 0.7311 * 0.2689 * 2 = -1.5729. Row 1: A = -1, r = 1: loss
  # (4 / 1.05) * 0.5 = 1.9048, gradient +1 (= -A, as every loss at r = 1). Row 2: A = 1, r = e^2
  # = 7.39: PPO would clip (zero gradient); SAPO's gate is nearly flat but not quite:
  # -4 s (1 - s) r with s = sigmoid(6.389) = 0.99832 -> -0.0495.
  lp = jnp.asarray([[math.log(2.0)], [0.0], [2.0]])
  old = jnp.zeros((3, 1))
  a = jnp.asarray([1.0, -1.0, 1.0])
  m = jnp.ones((3, 1), bool)
  out = L.sapo(lp, old, a, m)
  s = 1 / (1 + math.exp(-(math.exp(2) - 1)))
  close(out.loss[:, 0], [-4 / (1 + math.exp(-1)), 4 / 1.05 * 0.5, -4 * s], rtol=1e-6)
  close(out.ratio[:, 0], [2.0, 1.0, math.exp(2)], rtol=1e-6)
  np.testing.assert_array_equal(out.clipped, 0.0)  # no hard clip
  g = jax.grad(lambda z: jnp.sum(L.sapo(z, old, a, m).loss))(lp)
  s1 = 1 / (1 + math.exp(-1))
  close(g[:, 0], [-4 * s1 * (1 - s1) * 2, 1.0, -4 * s * (1 - s) * math.exp(2)], rtol=1e-4)
  assert -0.05 < float(g[2, 0]) < -0.049
  # tau_pos 4: a narrower trust region: the gradient at r = 2 is -4 s (1 - s) 2 with
  # s = sigmoid(4) = 0.982 -> -0.1413 (vs -1.5729 at tau 1).
  g4 = jax.grad(lambda z: jnp.sum(L.sapo(z, old, a, m, tau_pos=4.0).loss))(lp)
  s4 = 1 / (1 + math.exp(-4))
  close(g4[0, 0], -8 * s4 * (1 - s4), rtol=1e-5)
  with pytest.raises(ValueError, match="dual clip"):
    L.sapo(lp, old, a, m, dual_clip=3.0)
  assert L.policy_loss("sapo", lp, old, a, m).loss.shape == (3, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adv_shape", ["row", "token"])
def test_sapo_matches_numpy_with_its_temperatures(adv_shape, dtype):
  x = make(7)
  m = x["mask"]
  lp, lp64 = rounded(x["lp"], dtype)
  old, old64 = rounded(x["lp_old"], dtype)
  a = x["adv"] * 2 if adv_shape == "row" else np.random.default_rng(8).normal(size=m.shape) * 2
  kw = dict(tau_pos=2.0, tau_neg=3.0)
  out = L.policy_loss("sapo", lp, old, a, m, **kw)
  e_loss, e_ratio, _ = ref.policy("sapo", lp64, old64, a, m, **kw)
  close(out.loss, e_loss, **tol(dtype))
  close(out.ratio, e_ratio, **tol(dtype))
  g = jax.grad(lambda z: jnp.sum(L.policy_loss("sapo", z, old, a, m, **kw).loss * x["cot"]))(lp)
  assert g.dtype == dtype
  fd = ref.fd_grad(lambda z: np.sum(ref.policy("sapo", z, old64, a, m, **kw)[0] * x["cot"]),
                   lp64)
  close(g, fd, **tol(dtype, grad=True))


@PROPS
@given(log_r=hnp.arrays(np.float64, (B, N), elements=st.floats(-2, 1.5)),
       a=hnp.arrays(np.float64, B, elements=st.floats(-3, 3).filter(lambda v: abs(v) > 1e-3)),
       tau=st.floats(0.5, 4.0))
def test_property_sapo_gradient_never_vanishes_and_has_the_sign_of_minus_a(log_r, a, tau):
  # d/dlp [-A f(r)] = -A 4 s (1 - s) r: never 0 (PPO's clip zeroes it outside its band) and of
  # sign -A. (Over tau (r - 1) ~ 16, float32 rounds s to 1 and the gradient to 0: the ratios
  # here, up to e^1.5, stay below that for every tau drawn.)
  m = np.ones((B, N), bool)
  g = np.asarray(jax.grad(lambda z: jnp.sum(L.sapo(z, jnp.zeros((B, N)), a, m, tau_pos=tau,
                                                   tau_neg=tau).loss))(
      jnp.asarray(log_r, jnp.float32)))
  assert np.all(np.isfinite(g))
  assert np.all(np.sign(g) == -np.sign(a)[:, None])
  # At r = 1 the gradient is exactly -A: the on-policy step is plain REINFORCE.
  g1 = jax.grad(lambda z: jnp.sum(L.sapo(z, jax.lax.stop_gradient(z), a, m, tau_pos=tau,
                                         tau_neg=tau).loss))(jnp.asarray(log_r, jnp.float32))
  close(g1, np.repeat(-a[:, None], N, 1), rtol=1e-5, atol=1e-6)


# --- hypothesis properties of the new KL terms ----------------------------------------------------

masks = hnp.arrays(bool, (B, N))


@jax.jit
def weighted_kl_terms(lp, base, mu, mask):
  """Value and gradient of each importance-weighted estimator, both levels (one compile)."""
  out = {}
  for est in L.KL_ESTIMATORS:
    for level in ("token", "sequence"):
      out[f"{est}/{level}"] = jax.value_and_grad(lambda z: jnp.sum(
          L.importance_weighted_kl(z, base, mu, est, mask, level=level)))(lp)
  for red in L.REDUCTIONS:  # "policy" KL reduction under every loss reduction
    cfg = L.ObjectiveConfig(policy="reinforce", reduction=red, ref_kl_coef=1.0,
                            ref_kl_importance_weighted=True, ref_kl_reduction="policy",
                            rollout_kl_coef=1.0, rollout_kl_reduction="policy")
    cnt = L.global_counts(cfg, mask)
    out[f"objective/{red}"] = jax.value_and_grad(lambda z: L.objective(
        cfg, z, mu, jnp.zeros(B), mask, cnt, lp_gen=base, lp_ref=base)[0])(lp)
  return out


@PROPS
@given(mask=masks, seed=st.integers(0, 2**31), sign=hnp.arrays(bool, (B, N)))
def test_property_weighted_and_policy_reduced_kl_terms_have_a_gradient(mask, seed, sign):
  # (A weighted term's gradient is w (k + k'); it vanishes only on a set of measure zero, e.g.
  # k1 at d = -1.)
  rng, lp, base = kl_inputs(seed, sign, (B, N))
  mu = lp + rng.normal(0.0, 0.3, (B, N))
  out = weighted_kl_terms(*(jnp.asarray(v, jnp.float32) for v in (lp, base, mu)), mask)
  for key, (v, g) in out.items():
    g = np.asarray(g)
    assert np.isfinite(float(v)), key
    assert np.all(g[mask] != 0), key
    assert np.all(g[~mask] == 0), key


@PROPS
@given(mask=masks, seed=st.integers(0, 2**31))
def test_property_masked_nan_never_reaches_weighted_kl(mask, seed):
  x = make(seed, mask=mask)
  rng = np.random.default_rng(seed)
  dirty = {k: np.where(mask, x[k], rng.choice([np.nan, np.inf, -np.inf], size=mask.shape))
           for k in ("lp", "lp_ref", "lp_gen")}
  clean, bad = (weighted_kl_terms(*(jnp.asarray(d[k], jnp.float32)
                                    for k in ("lp", "lp_ref", "lp_gen")), mask)
                for d in (x, dirty))
  for key in clean:
    for a, b in zip(jax.tree.leaves(bad[key]), jax.tree.leaves(clean[key])):
      a = np.asarray(a)
      assert np.all(np.isfinite(a)), key
      np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7, err_msg=key)


# --- config keys: validated, one line each, and wired into the step -------------------------------


def problems(*argv: str) -> list[str]:
  """Every problem `--config.` overrides `argv` give, as the command line reports them."""
  found: list[str] = []
  cfg = parse_overrides(get_config(), list(argv), found)
  with pytest.raises(ConfigError) as info:
    validate(cfg, 1, problems=found)
  return info.value.problems


@pytest.mark.parametrize("argv,key,expected", [
    (["advantage.estimator=batch"], "advantage.estimator", "'grpo_batch_std'"),
    (["advantage.std_ddof=2"], "advantage.std_ddof", "must be one of [0, 1], got 2"),
    (["loss.policy=soft"], "loss.policy", "'sapo'"),
    (["loss.sapo_tau_pos=0"], "loss.sapo_tau_pos", "must be > 0"),
    (["loss.sapo_tau_neg=-1"], "loss.sapo_tau_neg", "must be > 0"),
    (["loss.policy=sapo", "loss.dual_clip=3"], "loss.dual_clip",
     "sapo does not take a dual clip"),
    (["ref_kl.reduction=loss"], "ref_kl.reduction", "'policy'"),
    (["rollout_kl.reduction=seq_sum"], "rollout_kl.reduction", "'policy'"),
    (["ref_kl.importance_weighted=maybe"], "ref_kl.importance_weighted", "expected bool"),
])
def test_bad_variant_settings_name_the_key_and_the_choices(argv, key, expected):
  found = problems(*(f"--config.{a}" for a in argv))
  assert len(found) == 1, found
  assert found[0].startswith(f"config.{key}:") and expected in found[0], found[0]


def test_variant_settings_validate_and_reach_the_step_config():
  cfg = get_config()
  cfg.advantage.estimator = "grpo_batch_std"
  cfg.advantage.std_ddof = 1
  cfg.loss.policy = "sapo"
  cfg.loss.sapo_tau_pos, cfg.loss.sapo_tau_neg = 0.9, 1.3
  cfg.loss.reduction = "seq_mean_token_sum_norm"
  cfg.ref_kl.coef = 0.01
  cfg.ref_kl.importance_weighted = True
  cfg.ref_kl.reduction = "policy"
  cfg.rollout_kl.coef = 0.1
  cfg.rollout_kl.reduction = "policy"
  validate(cfg, 1)
  step = rl_step_config(cfg)
  o = step.objective
  assert (step.advantage, step.adv_ddof) == ("grpo_batch_std", 1)
  assert (o.policy, o.sapo_tau_pos, o.sapo_tau_neg) == ("sapo", 0.9, 1.3)
  assert o.ref_kl_importance_weighted and o.ref_kl_reduction == o.rollout_kl_reduction == "policy"
  assert o.reductions() == ("seq_mean_token_sum_norm",)
  # The defaults keep the previous behaviour.
  d = rl_step_config(get_config())
  assert d.adv_ddof == 0 and not d.objective.ref_kl_importance_weighted
  assert d.objective.ref_kl_reduction == "token_mean"


# --- a few train steps of each variant on a fixed batch -------------------------------------------

TB, LP, TN = 16, 4, 4


def fixed_batch(seed=0, vocab=32) -> TrainBatch:
  """Groups of 4 rows; rewards 0/1 with spread in every group."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(2, vocab, (TB, LP)).astype(np.int32)
  mask = np.ones((TB, TN), bool)
  mask[1::4, 2:] = False  # varying lengths
  tokens = np.where(mask, rng.integers(2, vocab, (TB, TN)), 0).astype(np.int32)
  rewards = np.tile(np.float32([1, 0, 0, 1]), TB // 4) + np.float32(
      np.repeat(np.arange(TB // 4), 4) * 0.5)  # group means differ: batch std != group std
  return TrainBatch(prompts, np.ones((TB, LP), bool), tokens, mask,
                    np.where(mask, -rng.uniform(1.0, 4.0, (TB, TN)), 0).astype(np.float32),
                    rewards, np.arange(TB, dtype=np.int32) // 4, np.ones(TB, np.float32))


def train(step_cfg: StepConfig, steps: int):
  """(advantage-weighted mean log-prob before and after, last metrics)."""
  mesh = parallel.make_mesh(1, 1, 1)
  graphdef, params = init_model(tiny_model_config(), seed=0)
  params = shard_params(params, mesh)
  step, init = build_train_step(graphdef, make_optimizer(1e-2), step_cfg, mesh, params)
  batch = fixed_batch()
  adv = np.asarray(L.compute_advantages(step_cfg.advantage, jnp.asarray(batch.rewards),
                                        jnp.asarray(batch.group_id), eps=step_cfg.adv_eps,
                                        ddof=step_cfg.adv_ddof))
  m = batch.mask

  logprobs = jax.jit(lambda p: completion_logprobs(graphdef, p, jax.tree.map(jnp.asarray, batch),
                                                   step_cfg, with_entropy=False)[0])

  def score(p):
    return float(np.sum(adv * (np.asarray(logprobs(p)) * m).sum(1) / m.sum(1)))

  state = init(params)
  before = score(state.params)
  for _ in range(steps):
    state, metrics = step(state, jax.device_put(batch, parallel.batch_sharding(mesh)))
  return before, score(state.params), metrics


def variant_step_config(name: str) -> StepConfig:
  """Each variant from a run config, through `rl_step_config` (the trainer's own wiring)."""
  cfg = get_config()
  if name == "batch_std":
    cfg.advantage.estimator, cfg.advantage.std_ddof = "grpo_batch_std", 1
  elif name == "sapo":
    cfg.loss.policy = "sapo"
  elif name == "weighted_kl_dr_grpo":
    cfg.advantage.estimator = "dr_grpo"
    cfg.loss.reduction, cfg.loss.norm_len = "seq_mean_token_sum_norm", TN
    cfg.ref_kl.coef, cfg.ref_kl.importance_weighted, cfg.ref_kl.reduction = 0.1, True, "policy"
  return dataclasses.replace(rl_step_config(cfg), num_microbatches=1, shared_prompts=0)


@pytest.mark.slow  # three step compiles on 2 shared cores
@pytest.mark.parametrize("name", ["batch_std", "sapo", "weighted_kl_dr_grpo"])
def test_each_variant_learns_on_a_fixed_batch(name):
  # The policy-gradient objective's direction: sum_i A_i mean_t lp_it (probability moved onto
  # the rows with positive advantage) must rise over a few updates on one batch. When written:
  # batch_std -0.05 -> 13.1, sapo -0.08 -> 20.1, weighted_kl_dr_grpo -0.04 -> 10.1 after 5
  # updates at lr 1e-2; a variant whose gradient had the wrong sign or vanished would not rise.
  before, after, m = train(variant_step_config(name), steps=5)
  assert after > before + 1.0, (before, after)
  assert all(np.isfinite(float(v)) for v in m.values())
  if name == "weighted_kl_dr_grpo":
    assert float(m["ref_kl"]) > 0  # the policy has left the reference: the term is live
