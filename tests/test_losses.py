"""GRPO advantages and the PPO-clip loss, with the arithmetic behind each golden value."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses import group_advantages, nll_loss, ppo_clip_loss


def test_group_advantages_golden():
  # Group 0 rewards [1,0,0,0]: mean .25, population std sqrt(.25*.75) = .4330127,
  #   A = (.75/.4330127, -.25/.4330127) = (1.7320508, -0.5773503).
  # Group 1 rewards [1,1,0,0]: mean .5, std .5 -> A = (+1, +1, -1, -1).
  # Group 2 all equal -> A = 0 exactly (no signal, no NaN).
  # A ddof=1 std would give 1.5 / -0.5 for group 0 instead.
  r = jnp.array([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], jnp.float32)
  gid = jnp.repeat(jnp.arange(3), 4)
  a = np.asarray(group_advantages(r, gid, eps=0.0))
  np.testing.assert_allclose(a[:4], [1.7320508, -0.5773503, -0.5773503, -0.5773503], rtol=1e-6)
  np.testing.assert_allclose(a[4:8], [1, 1, -1, -1], rtol=1e-6)
  np.testing.assert_array_equal(a[8:], 0.0)


def test_group_advantages_use_explicit_ids_not_row_order():
  # Interleaved groups: rows 0,2 are group 7 and rows 1,3 are group 3.
  r = jnp.array([1.0, 0.0, 0.0, 0.0])
  a = np.asarray(group_advantages(r, jnp.array([7, 3, 7, 3]), eps=0.0))
  np.testing.assert_allclose(a, [1, 0, -1, 0], atol=1e-6)


def test_ppo_clip_on_policy_gradient_is_minus_advantage():
  # With old_logp = stop_gradient(logp) the ratio is 1: d loss_sum / d logp_t = -A_i on masked
  # tokens and 0 elsewhere.
  logp = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]])
  mask = jnp.array([[True, True, False], [True, False, False]])
  adv = jnp.array([2.0, -1.0])
  f = lambda lp: ppo_clip_loss(lp, jax.lax.stop_gradient(lp), adv, mask, 0.2)
  s, c, _ = f(logp)
  # loss_sum = -(2 + 2) - (-1) = -3 over 3 tokens.
  assert float(s) == -3.0 and float(c) == 3.0
  g = jax.grad(lambda lp: f(lp)[0])(logp)
  np.testing.assert_allclose(np.asarray(g), [[-2, -2, 0], [1, 0, 0]])


def test_ppo_clip_cuts_gradient_outside_the_trust_region():
  # A > 0 and ratio e^0.5 = 1.65 > 1.2: the clipped branch is active -> zero gradient, loss
  # -A * 1.2. A < 0 and the same ratio: the unclipped branch -A*r is larger -> gradient flows.
  old = jnp.zeros((2, 1))
  logp = jnp.full((2, 1), 0.5)
  mask = jnp.ones((2, 1), bool)
  adv = jnp.array([1.0, -1.0])
  per_row = lambda lp: ppo_clip_loss(lp, old, adv, mask, 0.2)[0]
  g = np.asarray(jax.grad(per_row)(logp))
  assert g[0, 0] == 0.0
  np.testing.assert_allclose(g[1, 0], np.exp(0.5), rtol=1e-6)  # d(+r)/dlogp = r
  s, _, m = ppo_clip_loss(logp, old, adv, mask, 0.2)
  np.testing.assert_allclose(float(s), -1.2 + np.exp(0.5), rtol=1e-6)
  assert float(m["clip_frac"]) == 1.0


def test_masked_nan_never_reaches_loss_or_gradient():
  logp = jnp.array([[-1.0, jnp.nan]])
  mask = jnp.array([[True, False]])
  for fn in (ppo_clip_loss, nll_loss):
    s, c, _ = fn(logp, jnp.array([[-1.0, jnp.inf]]), jnp.array([1.0]), mask, 0.2)
    g = jax.grad(lambda lp: fn(lp, jax.lax.stop_gradient(lp), jnp.array([1.0]), mask, 0.2)[0])(logp)
    assert np.isfinite(float(s)) and float(c) == 1.0
    assert np.isfinite(np.asarray(g)).all()
