"""What both Pallas layouts of the fused log-prob share (`pallas_tpu`, `pallas_gpu`): the
default block sizes, the zero padding of per-row operands, when to interpret, and the gradient
rule's wiring (`with_gradient`).

`api.pallas_fused_logprob` picks the layout; see each layout's module docstring for its kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.core import platform
from jaxrl.kernels.fused_logprob import common

# TPU-friendly defaults: multiples of 128 lanes; a `[D, bv]` bf16 tile of W at D = 4096 is 4 MiB.
DEFAULT_BLOCK_N = 256
DEFAULT_BLOCK_V = 512


def pad_rows(x, n_pad: int):
  """`x` with zero rows appended up to `n_pad` rows."""
  return jnp.pad(x, [(0, n_pad - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def col(x, n_pad: int):
  """`[N]` -> zero-padded `[n_pad, 1]` float32 (a per-row operand that broadcasts over a tile)."""
  return pad_rows(x.astype(jnp.float32)[:, None], n_pad)


def default_interpret(*xs):
  """False on TPU / GPU. On CPU, Pallas' generic interpreter; inside `shard_map` (whose
  varying-axes type check that interpreter does not propagate in jax 0.10) the TPU interpreter,
  which also simulates the in-order "arbitrary" grid axis the accumulators rely on."""
  if platform.current() != "cpu":
    return False
  if common.varying_axes(*xs):
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return True


def with_gradient(forward, backward):
  """`core(h, w, targets, t, a, b, with_entropy, interpret) -> (logp, entropy)`: a layout's
  `forward(h, w, targets, t, a, b, with_entropy, interpret) -> (logp, entropy, lse)` with its
  `backward(h, w, targets, t, lse, entropy, g_lp, g_ent, a, b, interpret) -> (dh, dw)` as the
  gradient rule (`a`, `b`: the layout's block sizes, static). No gradient flows to the targets;
  the temperature's is zero."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
  def core(h, w, targets, t, a, b, with_entropy, interpret):
    logp, entropy, _ = forward(h, w, targets, t, a, b, with_entropy, interpret)
    return logp, entropy

  def core_fwd(h, w, targets, t, a, b, with_entropy, interpret):
    logp, entropy, lse = forward(h, w, targets, t, a, b, with_entropy, interpret)
    return (logp, entropy), (h, w, targets, t, lse, entropy)

  def core_bwd(a, b, with_entropy, interpret, res, cts):
    h, w, targets, t, lse, entropy = res
    g_lp, g_ent = cts
    if g_ent is None:
      g_ent = jnp.zeros_like(g_lp)
    dh, dw = backward(h, w, targets, t, lse, entropy, g_lp, g_ent, a, b, interpret)
    return dh, dw, None, jnp.zeros_like(t)

  core.defvjp(core_fwd, core_bwd)
  return core
