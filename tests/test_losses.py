"""The pure loss library `jaxrl.losses` against independent NumPy references (tests/losses_numpy.py).

Values and gradients, float32 and bfloat16 inputs, golden cases with their arithmetic, and
properties: masked NaN/inf never leak, micro-batches add up to the full batch, metric partials
merge exactly, every KL term has a gradient.
"""

import ast
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxrl.losses as L
from jaxrl.losses import stats
import losses_numpy as ref  # tests/ is on sys.path (rootdir-less test modules)
from loss_checks import close, kl_inputs, rounded, tol

B, N = 6, 5
DTYPES = [jnp.float32, jnp.bfloat16]
PROPS = settings(max_examples=20, deadline=None, database=None)
P = L.CorrectionParams()
# Bands wide enough that random inputs land on both sides of every threshold.
WIDE = L.CorrectionParams(geo_mask_low=0.8, geo_mask_high=1.25, outlier_low=0.5,
                          outlier_high=1.8)


def make(seed, b=B, n=N, mask=None):
  """Random log-probs; `lp - lp_old` keeps >= 0.08 away from the 0.8/1.2 clip bounds."""
  rng = np.random.default_rng(seed)
  lp = -rng.uniform(0.05, 3.0, (b, n))
  near = rng.uniform(-0.1, 0.1, (b, n))
  far = rng.choice([-1.0, 1.0], (b, n)) * rng.uniform(0.35, 1.0, (b, n))
  gap = np.where(rng.random((b, n)) < 0.5, near, far)
  lp_old = lp - gap
  lp_gen = lp_old + rng.normal(0.0, 0.3, (b, n))
  lp_ref = lp + rng.choice([-1.0, 1.0], (b, n)) * rng.uniform(0.05, 1.0, (b, n))
  if mask is None:
    mask = rng.random((b, n)) < 0.7
    mask[-1] = False  # a padding row
    mask[0, 0] = True
  return dict(lp=lp, lp_old=lp_old, lp_gen=lp_gen, lp_ref=lp_ref, adv=rng.normal(size=b),
              entropy=rng.uniform(0.0, 3.0, (b, n)), mask=np.asarray(mask, bool),
              cot=rng.normal(size=(b, n)))


# --- 3. imports --------------------------------------------------------------------------------


def test_losses_imports_only_types_and_itself():
  root = pathlib.Path(L.__file__).parent
  files = sorted(root.glob("*.py"))
  assert len(files) >= 9
  seen = set()
  for path in files:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        assert node.level == 0, f"{path.name}: relative import"
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for name in names:
        seen.add(name)
        top = name.split(".")[0]
        assert top not in ("flax", "optax", "torch"), f"{path.name} imports {name}"
        if top == "jaxrl":
          # jaxrl.core.names: the registries' names, plain tuples (no imports of its own).
          assert name in ("jaxrl.core.types", "jaxrl.core.names") or name.startswith(
              ("jaxrl.core.types.", "jaxrl.core.names.", "jaxrl.losses")), f"{path.name} imports {name}"
  assert "jaxrl.losses.stats" in seen  # the walk really saw the package's own imports


# --- 1. advantages -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 4))
def _adv(estimator, rewards, gid, valid, kw):
  return L.compute_advantages(estimator, rewards, gid, valid, **dict(kw))


def adv(estimator, rewards, group_id=None, valid=None, **kw):
  """Advantages under jit (one compile per call shape beats eager op-by-op compiles)."""
  rewards = jnp.asarray(rewards, jnp.float32)
  gid = jnp.zeros(rewards.shape, jnp.int32) if group_id is None else jnp.asarray(group_id)
  valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid, bool)
  return np.asarray(_adv(estimator, rewards, gid, valid, tuple(sorted(kw.items()))))


S3 = math.sqrt(3.0)


@pytest.mark.parametrize("rewards,grpo,dr,rloo", [
    # mean 1/4, pop. std sqrt(1/4 * 3/4) = sqrt(3)/4; grpo = [3/4, -1/4] / (sqrt(3)/4)
    # = [sqrt(3), -1/sqrt(3)]; rloo: 1 - 0/3 = 1 and 0 - 1/3 = -1/3 (= 4/3 * dr_grpo).
    ([1, 0, 0, 0], [S3, -1 / S3, -1 / S3, -1 / S3], [0.75, -0.25, -0.25, -0.25],
     [1, -1 / 3, -1 / 3, -1 / 3]),
    # mean 3/4, std sqrt(3)/4: grpo = [1/4, -3/4] * 4/sqrt(3) = [1/sqrt(3), -sqrt(3)];
    # rloo: 1 - 2/3 = 1/3 and 0 - 3/3 = -1.
    ([1, 1, 1, 0], [1 / S3, 1 / S3, 1 / S3, -S3], [0.25, 0.25, 0.25, -0.75],
     [1 / 3, 1 / 3, 1 / 3, -1]),
    # mean 1/2, std 1/2: grpo = +-1; rloo: 1 - 1/3 = 2/3 and 0 - 2/3 = -2/3.
    ([1, 1, 0, 0], [1, 1, -1, -1], [0.5, 0.5, -0.5, -0.5], [2 / 3, 2 / 3, -2 / 3, -2 / 3]),
    # all equal: no signal, exactly 0 for every estimator.
    ([1, 1, 1, 1], [0] * 4, [0] * 4, [0] * 4),
    ([0, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4),
])
def test_advantage_golden_groups_of_four(rewards, grpo, dr, rloo):
  np.testing.assert_allclose(adv("grpo", rewards, eps=0.0), grpo, rtol=1e-6, atol=1e-7)
  # Default eps 1e-6 shifts grpo by a relative 1e-6 / std <= 2.4e-6 (std >= sqrt(3)/4).
  np.testing.assert_allclose(adv("grpo", rewards), grpo, rtol=3e-6, atol=1e-7)
  np.testing.assert_allclose(adv("dr_grpo", rewards), dr, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(adv("rloo", rewards), rloo, rtol=1e-6, atol=1e-7)


def test_advantage_golden_groups_of_two_and_ddof():
  # Groups {0: [1, 0]}, {1: [0, 0]}, {2: [3, 1]}: means 1/2, 0, 2.
  r, g = [1, 0, 0, 0, 3, 1], [0, 0, 1, 1, 2, 2]
  # Pop. std 1/2 and 1: grpo (eps 0) = [0.5/0.5, -0.5/0.5, 0, 0, 1/1, -1/1].
  np.testing.assert_allclose(adv("grpo", r, g, eps=0.0), [1, -1, 0, 0, 1, -1], atol=1e-7)
  # ddof=1: std sqrt(0.5/1) = 0.7071 and sqrt(2) -> +-0.5/0.7071 = +-0.7071, +-1/1.4142.
  h = 1 / math.sqrt(2)
  np.testing.assert_allclose(adv("grpo", r, g, eps=0.0, ddof=1), [h, -h, 0, 0, h, -h],
                             rtol=1e-6)
  # default eps 1e-6: 0.5 / (0.5 + 1e-6) = 0.999998.
  np.testing.assert_allclose(adv("grpo", r, g)[:2], [0.5 / 0.500001, -0.5 / 0.500001],
                             rtol=1e-7)
  np.testing.assert_allclose(adv("dr_grpo", r, g), [0.5, -0.5, 0, 0, 1, -1], atol=1e-7)
  # rloo with two members: r_i - r_other = [1, -1, 0, 0, 2, -2] = 2 * dr_grpo.
  np.testing.assert_allclose(adv("rloo", r, g), [1, -1, 0, 0, 2, -2], atol=1e-7)


def test_advantage_non_contiguous_group_ids():
  # Interleaved, negative and huge ids: groups {7: [1, 0, 0]}, {-3: [2, 4]}, {10**9: [5]}.
  r = [1, 2, 0, 5, 4, 0]
  g = [7, -3, 7, 10**9, -3, 7]
  # dr_grpo: 7 -> mean 1/3; -3 -> mean 3; the singleton gets r - r = 0.
  np.testing.assert_allclose(adv("dr_grpo", r, g), [2 / 3, -1, -1 / 3, 0, 1, -1 / 3],
                             rtol=1e-6, atol=1e-7)
  # rloo: 1 - 0/2 = 1, 0 - 1/2 = -1/2; 2 - 4 = -2, 4 - 2 = 2; singleton has no baseline: 0.
  np.testing.assert_allclose(adv("rloo", r, g), [1, -2, -0.5, 0, 2, -0.5], atol=1e-7)
  for est in L.ADVANTAGE_ESTIMATORS:
    # Relabelling the groups densely changes nothing.
    np.testing.assert_array_equal(adv(est, r, g), adv(est, r, [0, 1, 0, 2, 1, 0]))
    np.testing.assert_allclose(adv(est, r, g), ref.advantages(est, r, g), rtol=1e-5,
                               atol=1e-6)


def test_advantage_invalid_samples_get_zero_and_do_not_count():
  # Group 0 = [1, 0, NaN(invalid), inf(invalid)], group 1 = [-inf(invalid), 2, 4].
  r = [1.0, 0.0, np.nan, np.inf, -np.inf, 2.0, 4.0]
  g = [0, 0, 0, 0, 1, 1, 1]
  valid = np.array([1, 1, 0, 0, 0, 1, 1], bool)
  # Only valid members count: group 0 is [1, 0] (mean 1/2, std 1/2), group 1 is [2, 4].
  expect = {"grpo": [1, -1, 0, 0, 0, -1, 1], "dr_grpo": [0.5, -0.5, 0, 0, 0, -1, 1],
            "rloo": [1, -1, 0, 0, 0, -2, 2]}
  for est, e in expect.items():
    a = adv(est, r, g, valid, **({"eps": 0.0} if est == "grpo" else {}))
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, e, atol=1e-7)
    assert np.all(a[~valid] == 0.0)
  # A group whose only valid member is alone: grpo (std 0) and rloo (no baseline) give 0.
  for est in ("grpo", "rloo"):
    np.testing.assert_array_equal(adv(est, [3.0, np.nan], [0, 0], [True, False]), [0, 0])
  # Nothing valid at all: every advantage 0, no NaN.
  for est in L.ADVANTAGE_ESTIMATORS:
    np.testing.assert_array_equal(adv(est, [np.nan] * 3, None, np.zeros(3, bool)), [0] * 3)


def test_advantage_clipping():
  # grpo of [1, 0, 0, 0] = [1.732, -0.577, ...]; clip to [-0.5, 1.5].
  np.testing.assert_allclose(adv("grpo", [1, 0, 0, 0], eps=0.0, clip_low=-0.5, clip_high=1.5),
                             [1.5, -0.5, -0.5, -0.5])
  # One side open: dr_grpo [0.75, -0.25, -0.25, -0.25] clipped above at 0.5 only.
  np.testing.assert_allclose(adv("dr_grpo", [1, 0, 0, 0], clip_high=0.5),
                             [0.5, -0.25, -0.25, -0.25])
  np.testing.assert_allclose(adv("dr_grpo", [1, 0, 0, 0], clip_low=-0.1), [0.75, -0.1, -0.1, -0.1])
  a = jnp.asarray([3.0, -3.0])
  assert L.clip_advantages(a) is a


def test_grpo_zero_variance_is_exact_for_any_reward_value():
  # 0.3 * 7 / 7 != 0.3 in float32, so a centred value of ~1 ulp divided by a std of ~1 ulp
  # would give +-1 (eps 0) or ~0.1 (eps 1e-6) instead of the documented exact 0.
  # 40 groups of 3, 5, 6 or 7 equal rewards (before the fix about 1 in 3 groups failed).
  vals = np.random.default_rng(0).normal(size=40).astype(np.float32)
  sizes = np.tile([3, 5, 6, 7], 10)
  r, g = np.repeat(vals, sizes), np.repeat(np.arange(40) * 3 + 1, sizes)
  for eps in (0.0, 1e-6):
    np.testing.assert_array_equal(adv("grpo", r, g, eps=eps), 0.0)
    np.testing.assert_array_equal(adv("grpo", r, g, eps=eps, ddof=1), 0.0)
  # dr_grpo and rloo have no division: at most float32 rounding noise.
  for est in ("dr_grpo", "rloo"):
    np.testing.assert_allclose(adv(est, r, g), 0.0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator,ddof", [("grpo", 0), ("grpo", 1), ("dr_grpo", 0),
                                            ("rloo", 0)])
def test_advantages_match_numpy_values_and_gradients(estimator, ddof, dtype):
  rng = np.random.default_rng(1)
  b = 24
  r = rng.normal(size=b)
  g = rng.choice([5, -2, 11, 40, 3], size=b)
  valid = rng.random(b) < 0.8
  cot = rng.normal(size=b)
  rj, r64 = rounded(r, dtype)
  kw = dict(ddof=ddof) if estimator == "grpo" else {}
  a = L.compute_advantages(estimator, rj, jnp.asarray(g), jnp.asarray(valid), **kw)
  expect = ref.advantages(estimator, r64, g, valid, **kw)
  close(a, expect, **tol(dtype))
  f = lambda x: jnp.sum(L.compute_advantages(estimator, x, jnp.asarray(g), jnp.asarray(valid),
                                             **kw) * cot)
  grad = jax.grad(f)(rj)
  assert grad.dtype == dtype
  expect_g = ref.fd_grad(lambda x: np.sum(ref.advantages(estimator, x, g, valid, **kw) * cot),
                         r64)
  close(grad, expect_g, **tol(dtype, grad=True))
  assert np.all(np.asarray(grad, np.float32)[~valid] == 0)


def test_advantage_gradient_is_finite_on_zero_variance_groups():
  # Group 0 is all-correct (no spread); group 1 is mixed. grad must not be NaN anywhere.
  r = jnp.asarray([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
  g = jnp.asarray([0, 0, 0, 1, 1, 1])
  for est in L.ADVANTAGE_ESTIMATORS:
    grad = jax.grad(lambda x: jnp.sum(L.compute_advantages(est, x, g) * jnp.arange(6.0)))(r)
    assert np.all(np.isfinite(np.asarray(grad))), (est, grad)


def test_rloo_is_scaled_dr_grpo():
  rng = np.random.default_rng(2)
  for size in (2, 3, 8):
    r = rng.normal(size=size)
    # rloo = r - (S - r)/(G-1) = (G r - S)/(G-1) = G/(G-1) (r - S/G).
    np.testing.assert_allclose(adv("rloo", r), size / (size - 1) * adv("dr_grpo", r),
                               rtol=1e-5, atol=1e-6)


def test_advantages_jit_and_vmap():
  rng = np.random.default_rng(3)
  r = rng.normal(size=(3, 8)).astype(np.float32)
  g = np.stack([[0, 0, 1, 1, 2, 2, 3, 3], [9, 4, 9, 4, 9, 4, 9, 4], [1] * 8])
  valid = rng.random((3, 8)) < 0.8
  for est in L.ADVANTAGE_ESTIMATORS:
    fn = lambda r, g, v: L.compute_advantages(est, r, g, v)
    out = jax.jit(jax.vmap(fn))(r, g, valid)
    for k in range(3):
      close(out[k], ref.advantages(est, r[k], g[k], valid[k]), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="unknown advantage"):
    L.compute_advantages("ppo", jnp.zeros(2), jnp.zeros(2, int))


# --- 1. KL estimators --------------------------------------------------------------------------


def test_kl_golden():
  # d = lp - base = 1: k1 = 1, abs = 1, k2 = 1/2, k3 = e^-1 - 1 + 1 = 0.367879.
  # d = -2:            k1 = -2, abs = 2, k2 = 2,  k3 = e^2 - 1 - 2 = 4.389056.
  lp, base = jnp.asarray([0.0, -3.0]), jnp.asarray([-1.0, -1.0])
  expect = {"k1": [1, -2], "abs": [1, 2], "k2": [0.5, 2], "k3": [math.exp(-1), math.exp(2) - 3]}
  # Gradients: k1 1; abs sign(d); k2 d; k3 1 - e^-d = [1 - 0.3679, 1 - 7.389].
  grads = {"k1": [1, 1], "abs": [1, -1], "k2": [1, -2], "k3": [1 - math.exp(-1), 1 - math.exp(2)]}
  for est in L.KL_ESTIMATORS:
    np.testing.assert_allclose(L.kl_estimate(lp, base, est), expect[est], rtol=1e-6)
    g = jax.grad(lambda x: jnp.sum(L.kl_estimate(x, base, est)))(lp)
    np.testing.assert_allclose(g, grads[est], rtol=1e-6)
    # Only the base is a constant.
    g_base = jax.grad(lambda y: jnp.sum(L.kl_estimate(lp, y, est)))(base)
    np.testing.assert_array_equal(g_base, 0.0)


def test_k3_clamps():
  # d = -30: -d clamps to 20, exp(20) - 1 - 20 > 10 -> value clamps to 10, gradient 0.
  # d = 25: -d clamps to -20, e^-20 - 1 + 20 = 19.0 -> 10, gradient 0.
  # d = -2.5: e^2.5 - 1 - 2.5 = 8.68 < 10, unclamped, gradient 1 - e^2.5 = -11.18.
  # d = -2.6: e^2.6 - 3.6 = 9.86; d = -2.7: e^2.7 - 3.7 = 11.18 -> 10 (output clamp only).
  lp = jnp.asarray([-30.0, 25.0, -2.5, -2.6, -2.7])
  base = jnp.zeros(5)
  v = L.kl_estimate(lp, base, "k3")
  np.testing.assert_allclose(v, [10, 10, math.exp(2.5) - 3.5, math.exp(2.6) - 3.6, 10],
                             rtol=1e-5)
  g = jax.grad(lambda x: jnp.sum(L.kl_estimate(x, base, "k3")))(lp)
  np.testing.assert_allclose(g, [0, 0, 1 - math.exp(2.5), 1 - math.exp(2.6), 0], rtol=1e-5)
  # Custom clamps: input 1 -> d = -2.5 is evaluated at -d = 1: e - 1 - 1 = 0.718, gradient 0.
  np.testing.assert_allclose(L.kl_estimate(lp[2:3], base[2:3], "k3", clamp_input=1.0),
                             [math.e - 2], rtol=1e-6)
  with pytest.raises(ValueError, match="unknown KL"):
    L.kl_estimate(lp, base, "k4")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", L.KL_ESTIMATORS)
def test_kl_matches_numpy(estimator, dtype):
  x = make(4)
  lp, lp64 = rounded(x["lp"], dtype)
  base, base64 = rounded(x["lp_ref"] * 2.0 - x["lp"] * 0.5, dtype)  # a wide spread of d
  m = x["mask"]
  v = L.kl_estimate(lp, base, estimator, m)
  ev, eg = ref.kl(lp64, base64, estimator, m)
  close(v, ev, **tol(dtype))
  g = jax.grad(lambda a: jnp.sum(L.kl_estimate(a, base, estimator, m) * x["cot"]))(lp)
  assert g.dtype == dtype
  close(g, eg * x["cot"], **tol(dtype, grad=True))
  # Analytic reference gradient == central differences of the reference value.
  fd = ref.fd_grad(lambda a: np.sum(ref.kl(a, base64, estimator, m)[0] * x["cot"]), lp64)
  np.testing.assert_allclose(fd, eg * x["cot"], rtol=1e-5, atol=1e-6)


def test_kl_vmap_and_jit():
  x = make(5)
  lp = np.stack([x["lp"], x["lp"] - 0.5, x["lp_ref"]])
  for est in L.KL_ESTIMATORS:
    out = jax.jit(jax.vmap(lambda a, bb, m: L.kl_estimate(a, bb, est, m)))(
        lp, np.broadcast_to(x["lp_ref"], lp.shape), np.broadcast_to(x["mask"], lp.shape))
    for k in range(3):
      close(out[k], ref.kl(lp[k], x["lp_ref"], est, x["mask"])[0], rtol=1e-5, atol=1e-6)


# --- 1. policy losses --------------------------------------------------------------------------


def test_ppo_golden():
  # One token per row, eps 0.2/0.2, lp_old = 0, ratio r = exp(lp).
  r = np.array([1.5, 1.5, 0.5, 0.5, 1.1])
  a = np.array([1.0, -1.0, 1.0, -1.0, 2.0])
  lp = jnp.asarray(np.log(r))[:, None]
  m = jnp.ones((5, 1), bool)
  out = L.ppo(lp, jnp.zeros((5, 1)), a, m)
  # A=1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient)
  # A=-1, r=1.5: max(1.5, 1.2) = 1.5 (not clipped: gradient -A r = 1.5)
  # A=1, r=0.5: max(-0.5, -0.8) = -0.5 (not clipped: gradient -0.5)
  # A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
  # A=2, r=1.1: inside the band: -2.2, gradient -2.2
  np.testing.assert_allclose(out.loss[:, 0], [-1.2, 1.5, -0.5, 0.8, -2.2], rtol=1e-6)
  np.testing.assert_array_equal(out.clipped[:, 0], [1, 0, 0, 1, 0])
  np.testing.assert_allclose(out.ratio[:, 0], r, rtol=1e-6)
  g = jax.grad(lambda x: jnp.sum(L.ppo(x, jnp.zeros((5, 1)), a, m).loss))(lp)
  np.testing.assert_allclose(g[:, 0], [0, 1.5, -0.5, 0, -2.2], rtol=1e-6)
  # Asymmetric bounds (eps_high 0.6): A=1, r=1.5 is now inside: -1.5.
  assert float(L.ppo(lp, jnp.zeros((5, 1)), a, m, eps_high=0.6).loss[0, 0]) == pytest.approx(-1.5)
  # Dual clip c=1.4: A=-1, r=1.5 -> min(1.5, 1.4) = 1.4, flagged clipped, no gradient;
  # A>0 rows are untouched.
  d = L.ppo(lp, jnp.zeros((5, 1)), a, m, dual_clip=1.4)
  np.testing.assert_allclose(d.loss[:, 0], [-1.2, 1.4, -0.5, 0.8, -2.2], rtol=1e-6)
  np.testing.assert_array_equal(d.clipped[:, 0], [1, 1, 0, 1, 0])


def test_gspo_cispo_reinforce_golden():
  # Row 0: lp - lp_old = [0.3, -0.1, (masked 5.0)] -> mean 0.1, s = e^0.1 = 1.10517 (inside).
  # Row 1: [0.6, 0.4] -> mean 0.5, s = e^0.5 = 1.6487 > 1.2: A=1 -> loss -1.2, clipped.
  lp = jnp.asarray([[0.3, -0.1, 5.0], [0.6, 0.4, 0.0]])
  old = jnp.zeros((2, 3))
  m = jnp.asarray([[1, 1, 0], [1, 1, 0]], bool)
  a = jnp.asarray([2.0, 1.0])
  out = L.gspo(lp, old, a, m)
  s0, s1 = math.exp(0.1), math.exp(0.5)
  np.testing.assert_allclose(out.loss, [[-2 * s0, -2 * s0, 0], [-1.2, -1.2, 0]], rtol=1e-6)
  np.testing.assert_allclose(out.ratio, [[s0, s0, 1], [s1, s1, 1]], rtol=1e-6)
  np.testing.assert_array_equal(out.clipped, [[0, 0, 0], [1, 1, 0]])
  # d/dlp_t of sum_t -A s = -A * n * s * m_t / n = -A s m_t: row 0 -> -2 * 1.10517 per token.
  g = jax.grad(lambda x: jnp.sum(L.gspo(x, old, a, m).loss))(lp)
  np.testing.assert_allclose(g, [[-2 * s0, -2 * s0, 0], [0, 0, 0]], rtol=1e-6)
  # CISPO: -A sg(clip(r)) lp. Token ratios e^0.3 = 1.35 -> 1.2; e^-0.1 = 0.905 (inside);
  # row 1: e^0.6 = 1.82 -> 1.2, e^0.4 = 1.49 -> 1.2. Clipped tokens still get gradient -A w.
  c = L.cispo(lp, old, a, m)
  w = [[1.2, math.exp(-0.1), 0], [1.2, 1.2, 0]]
  np.testing.assert_allclose(c.loss, -np.array([[2], [1]]) * np.array(w) * np.asarray(lp) * m,
                             rtol=1e-6)
  np.testing.assert_array_equal(c.clipped, [[1, 0, 0], [1, 1, 0]])
  gc = jax.grad(lambda x: jnp.sum(L.cispo(x, old, a, m).loss))(lp)
  np.testing.assert_allclose(gc, -np.array([[2], [1]]) * np.array(w), rtol=1e-6)
  with pytest.raises(ValueError, match="dual clip"):
    L.cispo(lp, old, a, m, dual_clip=3.0)
  # REINFORCE: -A lp, gradient -A.
  r = L.reinforce(lp, old, a, m)
  np.testing.assert_allclose(r.loss, [[-0.6, 0.2, 0], [-0.6, -0.4, 0]], rtol=1e-6)
  np.testing.assert_array_equal(r.ratio, 1.0)
  with pytest.raises(ValueError, match="unknown policy"):
    L.policy_loss("trpo", lp, old, a, m)


def test_on_policy_gradient_is_minus_advantage():
  # With lp_old = lp every ratio is 1: ppo, gspo, cispo and reinforce all give -A grad lp.
  x = make(6)
  m = x["mask"]
  for name in L.POLICY_LOSSES:
    g = jax.grad(lambda lp: jnp.sum(L.policy_loss(name, lp, lp, x["adv"], m).loss))(
        jnp.asarray(x["lp"], jnp.float32))
    close(g, -x["adv"][:, None] * m, rtol=1e-5, atol=1e-6)


POLICY_CASES = [(name, None) for name in L.POLICY_LOSSES] + [("ppo", 1.5), ("gspo", 1.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,dual", POLICY_CASES)
@pytest.mark.parametrize("adv_shape", ["row", "token"])
def test_policy_losses_match_numpy(name, dual, dtype, adv_shape):
  x = make(7)
  m = x["mask"]
  lp, lp64 = rounded(x["lp"], dtype)
  old, old64 = rounded(x["lp_old"], dtype)
  a = x["adv"] * 2 if adv_shape == "row" else np.random.default_rng(8).normal(size=m.shape) * 2
  kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=dual)
  out = L.policy_loss(name, lp, old, a, m, **kw)
  e_loss, e_ratio, e_clip = ref.policy(name, lp64, old64, a, m, **kw)
  close(out.loss, e_loss, **tol(dtype))
  close(out.ratio, e_ratio, **tol(dtype))
  np.testing.assert_array_equal(np.asarray(out.clipped), e_clip)
  g = jax.grad(lambda z: jnp.sum(L.policy_loss(name, z, old, a, m, **kw).loss * x["cot"]))(lp)
  assert g.dtype == dtype
  fd = ref.fd_grad(lambda z: np.sum(ref.policy(name, z, old64, a, m, lp_sg=lp64, **kw)[0] *
                                    x["cot"]), lp64)
  close(g, fd, **tol(dtype, grad=True))
  # lp_old is a constant.
  g_old = jax.grad(lambda z: jnp.sum(L.policy_loss(name, lp, z, a, m, **kw).loss))(old)
  np.testing.assert_array_equal(np.asarray(g_old, np.float32), 0.0)


@pytest.mark.parametrize("name", ["gspo", "ppo", "cispo"])
def test_tight_clip_is_resolved_with_bf16_log_probs(name):
  # GSPO's clip range is ~3e-4 (a token-level loss may be set as tight), far below bf16's
  # spacing near 1 (2^-7 = 0.0078). Log-probs near 0 (bf16 spacing there ~6e-5) keep their
  # differences through the rounding: row 0 has log-ratio 1e-3 (0.00098 after rounding),
  # ratio 1.001 > 1 + 4e-4: clipped; in bf16 arithmetic exp(0.00098) rounds to exactly 1 and
  # the clip would never fire. Row 1: log-ratio 1e-4, ratio 1.0001 inside the band.
  lp = jnp.full((2, 2), -0.01, jnp.bfloat16)
  old = (lp - jnp.asarray([[0.001, 0.001], [0.0001, 0.0001]])).astype(jnp.bfloat16)
  _, lp64 = rounded(lp, jnp.bfloat16)
  _, old64 = rounded(old, jnp.bfloat16)
  m = jnp.ones((2, 2), bool)
  kw = dict(eps_low=3e-4, eps_high=4e-4)
  out = L.policy_loss(name, lp, old, jnp.ones(2), m, **kw)
  e_loss, e_ratio, e_clip = ref.policy(name, lp64, old64, np.ones(2), m, **kw)
  np.testing.assert_array_equal(e_clip, [[1, 1], [0, 0]])
  np.testing.assert_array_equal(np.asarray(out.clipped), e_clip)
  close(out.ratio, e_ratio, rtol=1e-6)
  close(out.loss, e_loss, rtol=1e-6)


# --- 1. reductions -----------------------------------------------------------------------------


def test_reductions_golden():
  # Row 0: x = [1, 2, (3 masked)], n=2; row 1: [4, (5), (6)], n=1; row 2 padding.
  x = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
  m = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
  expect = {"token_mean": (7.0, 3.0),  # 1 + 2 + 4 over 3 tokens
            "seq_mean_token_mean": (5.5, 2.0),  # 3/2 + 4/1 over 2 rows
            "seq_mean_token_sum": (7.0, 2.0),
            "seq_mean_token_sum_norm": (7.0 / 3, 2.0)}  # / N = 3
  for name, (s, c) in expect.items():
    got = L.reduce(name, x, m)
    np.testing.assert_allclose([got[0], got[1]], [s, c], rtol=1e-6)
    assert float(L.count(name, m)) == c
  # Explicit norm_len: 7 / 10.
  assert float(L.reduce("seq_mean_token_sum_norm", x, m, norm_len=10)[0]) == pytest.approx(0.7)
  # nll = token mean of -lp.
  assert float(L.nll(-x, m)[0]) == 7.0
  for fn in (L.reduce, lambda n, a, b: L.count(n, b)):
    with pytest.raises(ValueError, match="unknown reduction"):
      fn("mean", x, m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", L.REDUCTIONS)
def test_reductions_match_numpy(name, dtype):
  x = make(9)
  xv, x64 = rounded(x["lp"] * 3, dtype)
  m = x["mask"]
  s, c = L.reduce(name, xv, m, norm_len=4 if name.endswith("norm") else None)
  es, ec = ref.reduce(name, x64, m, norm_len=4 if name.endswith("norm") else None)
  assert s.dtype == jnp.float32
  close(s, es, rtol=1e-5, atol=1e-5)
  assert float(c) == ec == ref.count(name, m)
  g = jax.grad(lambda z: L.reduce(name, z, m)[0])(xv)
  assert g.dtype == dtype
  fd = ref.fd_grad(lambda z: ref.reduce(name, z, m)[0], x64)
  close(g, fd, **tol(dtype, grad=True))


def test_reduce_vmap_over_leading_axis():
  x = make(10)
  xs = np.stack([x["lp"], x["lp_old"], x["entropy"]])
  ms = np.stack([x["mask"], ~x["mask"], np.zeros_like(x["mask"])])
  for name in L.REDUCTIONS:
    s, c = jax.jit(jax.vmap(lambda a, b: L.reduce(name, a, b)))(xs, ms)
    assert s.shape == c.shape == (3,)
    for k in range(3):
      es, ec = ref.reduce(name, xs[k], ms[k])
      close(s[k], es, rtol=1e-5, atol=1e-5)
      assert float(c[k]) == ec
    assert float(s[2]) == float(c[2]) == 0.0  # an all-padding entry adds nothing


# --- 1. corrections ----------------------------------------------------------------------------


def test_corrections_golden():
  # One row, two tokens, Delta = lp_old - lp_gen = [ln 3, ln 0.25] -> rho = [3, 0.25].
  lp_old = jnp.asarray([[math.log(3.0), math.log(0.25)]])
  gen = jnp.zeros((1, 2))
  m = jnp.ones((1, 2), bool)
  lp = jnp.asarray([[-0.1, -0.1]])
  a = jnp.asarray([1.0])
  c = lambda name: L.correction(name, lp, lp_old, gen, a, m)
  # token_tis: min(rho, 2) = [2, 0.25]; one of two tokens capped.
  np.testing.assert_allclose(c("token_tis").weight, [[2, 0.25]], rtol=1e-6)
  assert c("token_tis").metrics["correction/token_tis_clip_frac"] == (1.0, 2.0)
  # seq_tis: exp(ln 3 + ln 0.25) = 0.75 < 5: every token 0.75.
  np.testing.assert_allclose(c("seq_tis").weight, [[0.75, 0.75]], rtol=1e-6)
  # icepop [0.5, 2]: both outside -> weights 0 and keep False.
  np.testing.assert_array_equal(c("icepop").keep, [[False, False]])
  np.testing.assert_array_equal(c("icepop").weight, [[0, 0]])
  # geometric mean sqrt(3 * 0.25) = 0.866: outside [0.99, 1.01] -> geo_mask drops the row;
  # inside [0.5, 2] -> seq_mask_tis keeps it with the raw token ratios.
  np.testing.assert_array_equal(c("geo_mask").keep, [[False, False]])
  np.testing.assert_array_equal(c("seq_mask_tis").keep, [[True, True]])
  np.testing.assert_allclose(c("seq_mask_tis").weight, [[3, 0.25]], rtol=1e-6)
  # product 0.75 inside [0.5, 2]; no token below 1e-4 or above 100.
  np.testing.assert_array_equal(c("product_mask").keep, [[True, True]])
  np.testing.assert_array_equal(c("outlier_mask").keep, [[True, True]])
  # dppo_tv, A > 0: p - p_gen = e^-0.1 - 1 = -0.095 < 0.2: kept. With A < 0 and lp_gen
  # = ln 0.5 below p: p_gen - p = 0.5 - 0.905 < 0.2: kept; with p = e^-1 = 0.37 and p_gen = 1:
  # 1 - 0.37 = 0.63 > 0.2: dropped.
  np.testing.assert_array_equal(c("dppo_tv").keep, [[True, True]])
  d = L.correction("dppo_tv", jnp.asarray([[-1.0, -0.1]]), lp_old, gen, -a, m)
  np.testing.assert_array_equal(d.keep, [[False, True]])
  with pytest.raises(ValueError, match="unknown correction"):
    c("tis")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", L.CORRECTIONS)
def test_corrections_match_numpy(name, dtype):
  x = make(11, b=12, n=5)
  m = x["mask"]
  lp, lp64 = rounded(x["lp"], dtype)
  old, old64 = rounded(x["lp_old"], dtype)
  gen, gen64 = rounded(x["lp_gen"], dtype)
  for params in (P, WIDE):
    c = L.correction(name, lp, old, gen, x["adv"], m, params)
    ew, ek, em = ref.correction(name, lp64, old64, gen64, x["adv"], m, params)
    np.testing.assert_array_equal(np.asarray(c.keep), ek)
    # A single correction's weight only matters where it keeps the token (`combine` zeroes it).
    close(jnp.where(c.keep, c.weight, 0.0), ew, rtol=1e-5, atol=1e-6)
    assert c.metrics.keys() == em.keys()
    for k, (s, n) in em.items():
      assert (float(c.metrics[k][0]), float(c.metrics[k][1])) == (s, n), k
  # Everything a correction returns is a constant for the gradient.
  for arg in range(3):
    def f(z):
      args = [lp, old, gen]
      args[arg] = z
      return jnp.sum(L.correction(name, *args, x["adv"], m, WIDE).weight)
    g = jax.grad(f)([lp, old, gen][arg])
    np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)


def test_combine_composes_and_parse_correction():
  x = make(12, b=12, n=5)
  m = x["mask"]
  args = (x["lp"], x["lp_old"], x["lp_gen"], x["adv"], m)
  names = ("outlier_mask", "token_tis", "geo_mask", "dppo_tv")
  c = L.combine(names, *args, params=WIDE)
  parts = [L.correction(n, *args, WIDE) for n in names]
  keep = np.logical_and.reduce([np.asarray(p.keep) for p in parts])
  w = np.prod([np.asarray(p.weight) for p in parts], axis=0)
  np.testing.assert_array_equal(np.asarray(c.keep), keep)
  np.testing.assert_allclose(c.weight, np.where(keep, w, 0.0), rtol=1e-6)
  assert set(c.metrics) == {k for p in parts for k in p.metrics}
  assert 0 < keep.sum() < m.sum()  # the example really masks something and keeps something
  ew, ek, _ = ref.combine(names, *args, WIDE)
  np.testing.assert_array_equal(np.asarray(c.keep), ek)
  close(c.weight, ew, rtol=1e-5, atol=1e-6)
  # Order does not matter for the weight and the mask.
  r = L.combine(names[::-1], *args, params=WIDE)
  np.testing.assert_array_equal(np.asarray(r.keep), keep)
  np.testing.assert_allclose(r.weight, c.weight, rtol=1e-6)
  # The empty combination is a no-op: weight 1 on the mask, 0 elsewhere, no metrics.
  e = L.combine((), *args)
  np.testing.assert_array_equal(np.asarray(e.keep), m)
  np.testing.assert_array_equal(np.asarray(e.weight), m.astype(np.float32))
  assert e.metrics == {}
  # Names joined by '+' in configs.
  assert L.parse_correction("none") == L.parse_correction("") == ()
  assert L.parse_correction("token_tis") == ("token_tis",)
  assert L.parse_correction("outlier_mask + token_tis") == ("outlier_mask", "token_tis")
  assert set(L.WEIGHTING) <= set(L.CORRECTIONS)


# --- 1. mismatch metrics and stats ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [None, 1.3])
def test_mismatch_metrics_match_numpy(threshold, dtype):
  x = make(13, b=12, n=5)
  m = x["mask"]
  old, old64 = rounded(x["lp_old"], dtype)
  gen, gen64 = rounded(x["lp_gen"], dtype)
  s, keep_rows = L.mismatch_metrics(old, gen, m, threshold)
  expect, e_keep = ref.mismatch(old64, gen64, m, threshold)
  got = stats.finalize(s)
  assert got.keys() == expect.keys()
  for k, v in expect.items():
    # Computed in float32 from the rounded inputs: float32 tolerance for both dtypes.
    close(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_array_equal(np.asarray(keep_rows), e_keep)
  if threshold is not None:
    assert 0 < e_keep.sum() < m.any(axis=1).sum()  # both outcomes occur


def test_stats_merge_and_finalize():
  a = stats.Stats({"m": (jnp.float32(3.0), jnp.float32(2.0))}, {"s": jnp.float32(1.0)},
                  {"hi": jnp.float32(-jnp.inf)}, {"lo": jnp.float32(jnp.inf)})
  b = stats.Stats({"m": (jnp.float32(5.0), jnp.float32(2.0))}, {"s": jnp.float32(2.0)},
                  {"hi": jnp.float32(4.0)}, {"lo": jnp.float32(-1.0)})
  # (3 + 5) / (2 + 2) = 2; 1 + 2 = 3; max(-inf, 4) = 4; min(inf, -1) = -1.
  assert stats.finalize(stats.merge(a, b)) == {"m": 2.0, "s": 3.0, "hi": 4.0, "lo": -1.0}
  # Empty partials finalise to 0 (not NaN, not +-inf).
  empty = stats.Stats({"m": (jnp.float32(0.0), jnp.float32(0.0))}, {}, {"hi": -jnp.inf},
                      {"lo": jnp.inf})
  assert stats.finalize(empty) == {"m": 0.0, "hi": 0.0, "lo": 0.0}
  # A real +inf max stays visible.
  assert stats.finalize(stats.Stats({}, {}, {"hi": jnp.inf}, {}))["hi"] == jnp.inf
  u = stats.union(stats.Stats({"x": (1.0, 1.0)}, {}, {}, {}), stats.Stats({}, {"y": 2.0}, {}, {}))
  assert u.means == {"x": (1.0, 1.0)} and u.sums == {"y": 2.0}


# --- objective ------------------------------------------------------------------------------------


def full_config(policy="ppo", reduction="token_mean", **kw):
  base = dict(policy=policy, reduction=reduction, eps_low=0.2, eps_high=0.28,
              dual_clip=None if policy in ("cispo", "sapo", "reinforce") else 2.0,
              correction=("outlier_mask", "token_tis", "dppo_tv"), correction_params=WIDE,
              rollout_kl_coef=0.3, rollout_kl_estimator="k3", rollout_kl_reduction="seq_mean",
              ref_kl_coef=0.2, ref_kl_estimator="k2", ref_kl_reduction="token_mean",
              entropy_coef=0.05, seq_logprob_error_threshold=1.6,
              norm_len=7 if reduction.endswith("norm") else None)
  base.update(kw)
  return L.ObjectiveConfig(**base)


def run(cfg, x, rows=slice(None), counts=None, dtype=jnp.float32, grad=True):
  """(loss, stats partial, grad wrt lp, grad wrt entropy) on rows `rows` of `x`."""
  sub = {k: np.asarray(v)[rows] for k, v in x.items()}
  counts = L.global_counts(cfg, x["mask"]) if counts is None else counts
  cast = lambda k: jnp.asarray(np.asarray(sub[k], np.float32), dtype)

  def f(lp, ent):
    return L.objective(cfg, lp, cast("lp_old"), sub["adv"], sub["mask"], counts,
                       lp_gen=cast("lp_gen"), lp_ref=cast("lp_ref"), entropy=ent)

  if not grad:
    loss, s = f(cast("lp"), cast("entropy"))
    return loss, s, None, None
  (loss, s), (g_lp, g_ent) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      cast("lp"), cast("entropy"))
  return loss, s, g_lp, g_ent


def numpy_objective(cfg, x, dtype=jnp.float32):
  r = {k: rounded(x[k], dtype)[1] for k in ("lp", "lp_old", "lp_gen", "lp_ref", "entropy")}
  cnt = ref.counts(cfg, x["mask"])
  f = lambda lp, ent: ref.objective(cfg, lp, r["lp_old"], x["adv"], x["mask"], cnt,
                                    lp_gen=r["lp_gen"], lp_ref=r["lp_ref"], entropy=ent,
                                    lp_sg=r["lp"])
  loss, metrics = f(r["lp"], r["entropy"])
  g_lp = ref.fd_grad(lambda z: f(z, r["entropy"])[0], r["lp"])
  g_ent = ref.fd_grad(lambda z: f(r["lp"], z)[0], r["entropy"])
  return loss, metrics, g_lp, g_ent


OBJECTIVE_CASES = [(p, "token_mean") for p in L.POLICY_LOSSES] + [
    ("ppo", r) for r in L.REDUCTIONS[1:]] + [("gspo", "seq_mean_token_mean")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy,reduction", OBJECTIVE_CASES)
def test_objective_matches_numpy(policy, reduction, dtype):
  x = make(14)
  cfg = full_config(policy, reduction)
  loss, s, g_lp, g_ent = run(cfg, x, dtype=dtype)
  e_loss, e_metrics, e_glp, e_gent = numpy_objective(cfg, x, dtype)
  t = tol(dtype)
  close(loss, e_loss, **t)
  got = stats.finalize(s)
  assert got.keys() == e_metrics.keys()
  for k, v in e_metrics.items():
    close(got[k], v, err_msg=k, **t)
  close(g_lp, e_glp, **tol(dtype, grad=True))
  close(g_ent, e_gent, **tol(dtype, grad=True))
  # The example exercises the masks: something kept, something dropped by a correction.
  assert 0.0 < float(got["keep_frac"]) < 1.0


def test_objective_requires_its_inputs():
  x = make(15)
  cnt = L.global_counts(full_config(), x["mask"])
  base = (x["lp"], x["lp_old"], x["adv"], x["mask"], cnt)
  needs_gen = [L.ObjectiveConfig(correction=("token_tis",)), L.ObjectiveConfig(rollout_kl_coef=0.1),
               L.ObjectiveConfig(seq_logprob_error_threshold=1.5)]
  for cfg in needs_gen:
    with pytest.raises(ValueError, match="lp_gen"):
      L.objective(cfg, *base)
  with pytest.raises(ValueError, match="lp_ref"):
    L.objective(L.ObjectiveConfig(ref_kl_coef=0.1), *base)
  with pytest.raises(ValueError, match="entropy"):
    L.objective(L.ObjectiveConfig(entropy_coef=0.1), *base)
  # Without any of those terms, none of the extra inputs is needed.
  loss, _ = L.objective(L.ObjectiveConfig(), *base)
  assert np.isfinite(float(loss))


def test_objective_under_jit_and_padding_microbatch():
  x = make(16)
  cfg = full_config("gspo", "seq_mean_token_mean")
  cnt = L.global_counts(cfg, x["mask"])

  @jax.jit
  def step(lp, mask):
    f = lambda z: L.objective(cfg, z, x["lp_old"], x["adv"], mask, cnt, lp_gen=x["lp_gen"],
                              lp_ref=x["lp_ref"], entropy=x["entropy"])
    return jax.value_and_grad(f, has_aux=True)(lp)

  (loss, s), g = step(jnp.asarray(x["lp"], jnp.float32), x["mask"])
  e_loss, e_metrics, e_g, _ = numpy_objective(cfg, x)
  close(loss, e_loss, rtol=1e-5, atol=1e-6)
  close(g, e_g, rtol=1e-4, atol=1e-5)
  # A padding micro-batch (mask all False) adds exactly 0 to the loss and the gradient, and its
  # metric partials are empty (counts 0) rather than NaN.
  (loss0, s0), g0 = step(jnp.asarray(x["lp"], jnp.float32), np.zeros_like(x["mask"]))
  assert float(loss0) == 0.0
  np.testing.assert_array_equal(g0, 0.0)
  assert all(float(c) == 0.0 for _, c in s0.means.values())
  assert all(np.isfinite(float(v)) for v in stats.finalize(s0).values())


# --- 2. properties ------------------------------------------------------------------------------

masks = hnp.arrays(bool, (B, N))
POLICY_REDUCTIONS = [(p, r) for p in L.POLICY_LOSSES for r in L.REDUCTIONS]
configs = st.builds(
    lambda pr, corr, rkl, rred, est, thr, iw: full_config(
        pr[0], pr[1], correction=corr, rollout_kl_reduction=rred, rollout_kl_estimator=est,
        rollout_kl_coef=rkl, seq_logprob_error_threshold=thr, ref_kl_reduction=rred,
        ref_kl_importance_weighted=iw),
    st.sampled_from(POLICY_REDUCTIONS),
    st.sampled_from([(), ("token_tis",), ("icepop", "outlier_mask"), ("seq_tis", "geo_mask"),
                     ("seq_mask_tis", "product_mask", "dppo_tv")]),
    st.sampled_from([0.0, 0.5]), st.sampled_from(list(L.KL_REDUCTIONS)),
    st.sampled_from(L.KL_ESTIMATORS), st.sampled_from([None, 1.4]), st.booleans())


def check_split(cfg, x, bounds):
  """Micro-batches over row ranges `bounds` (with global counts) == the full batch."""
  loss, s, g_lp, g_ent = run(cfg, x)
  cnt = L.global_counts(cfg, x["mask"])
  parts = [run(cfg, x, slice(lo, hi), cnt) for lo, hi in zip(bounds[:-1], bounds[1:])]
  close(sum(float(p[0]) for p in parts), loss, rtol=1e-5, atol=1e-6)
  close(np.concatenate([p[2] for p in parts]), g_lp, rtol=1e-5, atol=1e-6)
  close(np.concatenate([p[3] for p in parts]), g_ent, rtol=1e-5, atol=1e-6)
  merged = parts[0][1]
  for p in parts[1:]:
    merged = stats.merge(merged, p[1])
  want, got = stats.finalize(s), stats.finalize(merged)
  assert want.keys() == got.keys()
  for k in want:
    close(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("policy,reduction", POLICY_REDUCTIONS)
def test_microbatches_sum_to_full_batch_every_policy_and_reduction(policy, reduction):
  x = make(17)
  x["mask"][2] = False  # a padding row inside a micro-batch
  check_split(full_config(policy, reduction), x, [0, 3, 6])


@pytest.mark.slow  # fast-suite time budget: a property test that compiles per example (~20-30 s)
@PROPS
@given(cfg=configs, mask=masks, seed=st.integers(0, 2**31),
       bounds=st.sampled_from([[0, 3, 6], [0, 2, 4, 6]]))  # few shapes: each compiles anew
def test_property_microbatch_split(cfg, mask, seed, bounds):
  check_split(cfg, make(seed, mask=mask), bounds)


def poison(x, seed):
  """NaN / +inf / -inf written at every masked position (and NaN advantages of empty rows)."""
  rng = np.random.default_rng(seed)
  out = dict(x)
  bad = ~x["mask"]
  for k in ("lp", "lp_old", "lp_gen", "lp_ref", "entropy"):
    junk = rng.choice([np.nan, np.inf, -np.inf], size=bad.shape)
    out[k] = np.where(bad, junk, x[k])
  out["adv"] = np.where(x["mask"].any(axis=1), x["adv"], np.nan)
  return out


def assert_same_finite(got, want, **kw):
  """Every leaf of `got` is finite and equals the same leaf of `want`."""
  for path, a in jax.tree_util.tree_leaves_with_path(got):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    assert np.all(np.isfinite(a)), (jax.tree_util.keystr(path), a)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **kw)


@PROPS
@given(cfg=configs, mask=masks, seed=st.integers(0, 2**31))
def test_property_masked_nan_never_reaches_objective(cfg, mask, seed):
  x = make(seed, mask=mask)
  bad = poison(x, seed)
  cnt = L.global_counts(cfg, x["mask"])
  clean, dirty = run(cfg, x, counts=cnt), run(cfg, bad, counts=cnt)
  assert_same_finite(dirty[0], clean[0], rtol=1e-6, atol=1e-7)
  for k in (2, 3):
    assert_same_finite(dirty[k], clean[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(dirty[k])[~mask], 0.0)
  assert_same_finite(stats.finalize(dirty[1]), stats.finalize(clean[1]), rtol=1e-6, atol=1e-7)


@jax.jit
def components(d, mask):
  """Values, gradients and metrics of every component on the arrays `d` (one compile)."""
  out = {}
  grad = lambda f, z: jax.value_and_grad(f)(z)
  for est in L.KL_ESTIMATORS:
    for base in ("lp_ref", "lp_gen"):
      out[f"kl/{est}/{base}"] = grad(lambda z: jnp.sum(L.kl_estimate(z, d[base], est, mask)),
                                     d["lp"])
  for name in L.POLICY_LOSSES:
    for a in ("adv", "tok_adv"):
      out[f"{name}/{a}"] = L.policy_loss(name, d["lp"], d["lp_old"], d[a], mask)
      for red in L.REDUCTIONS:
        out[f"{name}/{a}/{red}"] = grad(
            lambda z: L.reduce(red, L.policy_loss(name, z, d["lp_old"], d[a], mask).loss,
                               mask)[0], d["lp"])
  for red in L.REDUCTIONS:
    out[f"reduce/{red}"] = grad(lambda z: L.reduce(red, z, mask)[0], d["entropy"])
  c = L.combine(L.CORRECTIONS, d["lp"], d["lp_old"], d["lp_gen"], d["adv"], mask, WIDE)
  out["combine"] = (c.weight, c.keep.astype(jnp.float32), c.metrics)
  mm, keep_rows = L.mismatch_metrics(d["lp_old"], d["lp_gen"], mask, 1.4)
  out["mismatch"] = (stats.finalize(mm), keep_rows.astype(jnp.float32))
  valid = jnp.any(mask, axis=1)
  for est in L.ADVANTAGE_ESTIMATORS:
    # Invalid samples may carry NaN/inf rewards.
    out[f"adv/{est}"] = L.compute_advantages(est, d["rewards"], jnp.arange(B) % 2, valid)
  return out


@PROPS
@given(mask=masks, seed=st.integers(0, 2**31))
def test_property_masked_nan_never_reaches_components(mask, seed):
  x = make(seed, mask=mask)
  bad = poison(x, seed)
  tok = np.repeat(x["adv"][:, None], N, 1)
  valid = mask.any(axis=1)
  keys = ("lp", "lp_old", "lp_gen", "lp_ref", "entropy", "adv")
  clean = {k: jnp.asarray(x[k], jnp.float32) for k in keys}
  clean.update(tok_adv=jnp.asarray(np.where(mask, tok, 0.0), jnp.float32),
               rewards=jnp.asarray(np.where(valid, x["adv"], 0.0), jnp.float32))
  dirty = {k: jnp.asarray(bad[k], jnp.float32) for k in keys}
  dirty.update(tok_adv=jnp.asarray(np.where(mask, tok, np.nan), jnp.float32),
               rewards=jnp.asarray(bad["adv"], jnp.float32))
  assert_same_finite(components(dirty, mask), components(clean, mask), rtol=1e-6, atol=1e-7)


@jax.jit
def kl_gradients(lp, base, mask):
  out = {}
  for est in L.KL_ESTIMATORS:
    out[est] = jax.grad(lambda z: jnp.sum(L.kl_estimate(z, base, est, mask)))(lp)
    for red in ("token_mean", "seq_mean"):
      # The rollout and the reference KL terms of the objective, alone (zero advantages).
      for term, kw in (("rollout", dict(rollout_kl_coef=1.0, rollout_kl_estimator=est,
                                        rollout_kl_reduction=red)),
                       ("ref", dict(ref_kl_coef=1.0, ref_kl_estimator=est,
                                    ref_kl_reduction=red))):
        cfg = L.ObjectiveConfig(policy="reinforce", **kw)
        cnt = L.global_counts(cfg, mask)
        f = lambda z: L.objective(cfg, z, lp, jnp.zeros(B), mask, cnt, lp_gen=base,
                                  lp_ref=base)[0]
        out[f"{term}/{est}/{red}"] = jax.grad(f)(lp)
  return out


@PROPS
@given(mask=masks, seed=st.integers(0, 2**31), sign=hnp.arrays(bool, (B, N)))
def test_property_every_kl_term_has_a_gradient(mask, seed, sign):
  _, lp, base = kl_inputs(seed, sign, (B, N))
  grads = kl_gradients(jnp.asarray(lp, jnp.float32), jnp.asarray(base, jnp.float32), mask)
  assert len(grads) == 4 * 5
  for key, g in grads.items():
    g = np.asarray(g)
    assert np.all(g[mask] != 0), key
    assert np.all(g[~mask] == 0), key


def test_outratio_base_rollout_measures_the_ratio_against_outthe_sampler():
  # lp = -1 everywhere, trainer recompute lp_old = -1 (ratio 1), sampler lp_gen = -1.5: with
  # ratio_base="rollout" the ratio is exp(-1 - (-1.5)) = e^0.5 = 1.6487 > 1 + 0.2, so for A > 0
  # the clipped branch is active (loss -A * 1.2, zero gradient); "trainer" gives ratio 1.
  lp = jnp.full((2, 3), -1.0)
  lp_gen = jnp.full((2, 3), -1.5)
  mask = jnp.ones((2, 3), bool)
  adv = jnp.array([1.0, 1.0])
  for base, want_ratio, want_loss in (("trainer", 1.0, -1.0), ("rollout", np.exp(0.5), -1.2)):
    cfg = L.ObjectiveConfig(ratio_base=base)
    counts = L.global_counts(cfg, mask)
    f = lambda x: L.objective(cfg, x, jax.lax.stop_gradient(x), adv, mask, counts,
                                   lp_gen=lp_gen)
    loss, st_out = f(lp)
    fin = L.stats.finalize(st_out)
    np.testing.assert_allclose(float(fin["ratio/mean"]), want_ratio, rtol=1e-6)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    g = jax.grad(lambda x: f(x)[0])(lp)
    assert (np.asarray(g) == 0).all() == (base == "rollout")
  with pytest.raises(ValueError, match=r"lp_gen\) for loss.ratio_base"):
    cfg = L.ObjectiveConfig(ratio_base="rollout")
    L.objective(cfg, lp, lp, adv, mask, L.global_counts(cfg, mask))
