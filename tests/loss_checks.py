"""Comparison helpers shared by the loss tests (tests/test_losses.py, tests/test_loss_variants.py):
inputs rounded to the dtype under test, its tolerances, and an allclose in float64."""

import jax.numpy as jnp
import numpy as np


def rounded(x, dtype):
  """`x` as the dtype under test, and the same rounded values in float64 for the reference."""
  a = jnp.asarray(np.asarray(x, np.float32), dtype)
  return a, np.asarray(a.astype(jnp.float32), np.float64)


def tol(dtype, grad=False):
  if dtype == jnp.bfloat16:
    return dict(rtol=2e-2, atol=2e-2)
  return dict(rtol=1e-4, atol=1e-5) if grad else dict(rtol=1e-5, atol=1e-6)


def close(actual, expected, **kw):
  np.testing.assert_allclose(np.asarray(jnp.asarray(actual, jnp.float32), np.float64),
                             np.asarray(expected, np.float64), **kw)


def kl_inputs(seed, sign, shape):
  """Log-probs `lp` and a base at |lp - base| in [0.01, 2] on the side `sign` picks: away from 0
  (where k3's 1 - e^-d and a weighted term's gradient vanish) and from the clamps."""
  rng = np.random.default_rng(seed)
  lp = -rng.uniform(0.1, 3.0, shape)
  base = lp + np.where(sign, 1.0, -1.0) * rng.uniform(0.01, 2.0, shape)
  return rng, lp, base
