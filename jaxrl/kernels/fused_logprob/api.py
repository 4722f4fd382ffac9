"""One entry point for the fused log-prob + rollout-KL kernel; implementations share a signature.

    z = (hidden @ unembedding) / t        float32; t = T where T > 0, else 1 (greedy)
    logp = z[target] - logsumexp(z)       == jaxrl.models.logprobs.token_logprobs
    entropy = logsumexp(z) - sum_v softmax(z)_v z_v
    rollout_kl = kl_estimate(logp, rollout_logprobs, estimator, mask)   # jaxrl.losses.kl

The KL is elementwise in `logp`, so it sits outside the implementations' `custom_vjp` and its
gradient reaches `hidden` / `unembedding` through the cotangent of `logp`.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core import platform
from jaxrl.kernels.fused_logprob import common, pallas_gpu, pallas_tpu, reference, xla
from jaxrl.kernels.fused_logprob.pallas_common import default_interpret
from jaxrl.losses.kl import kl_estimate

# The Pallas kernels' layouts (`pallas_tpu`, `pallas_gpu` module docstrings).
PALLAS_LAYOUTS = {"tpu": pallas_tpu.fused_logprob, "gpu": pallas_gpu.fused_logprob}


def pallas_fused_logprob(h, w, targets, t, *, with_entropy: bool = False, chunk_size=None,
                         interpret=None, block_n: int | None = None, layout: str | None = None):
  """`(logp [N], entropy [N] or None)`, float32, from the Pallas kernels in one of their
  layouts; `t` is the effective temperature `[N]`.

  `chunk_size` is the vocabulary block `bv` (default `pallas_common.DEFAULT_BLOCK_V` in the
  `tpu` layout; the `gpu` layout's default is `pallas_gpu.GPU_BLOCK_V`, and it rounds a given one
  down to a power of two, at most `pallas_gpu.GPU_MAX_BLOCK_V`), `block_n` the token block `bn`
  (None: 256 in the `tpu` layout, `pallas_gpu.GPU_BLOCK_N` in the `gpu` one). The `tpu` layout
  shrinks a default it cannot fit in VMEM at this D (`pallas_tpu.fit_blocks`: 7B's D = 3584
  runs (256, 128)).
  `interpret` (True, or a `pltpu.InterpretParams`) runs the kernels on CPU, where Pallas has no
  compiled backend; None picks per backend (`pallas_common.default_interpret`). `layout` (`tpu`
  | `gpu`): None = `gpu` when compiling on a GPU, else `tpu`; either runs in interpret mode, so
  the CPU tests cover both.
  """
  if interpret is None:
    interpret = default_interpret(h, w, targets, t)
  if layout is None:
    layout = "gpu" if not interpret and platform.current() == "gpu" else "tpu"
  if layout not in PALLAS_LAYOUTS:
    raise ValueError(f"unknown pallas fused_logprob layout {layout!r}; expected one of "
                     f"{tuple(PALLAS_LAYOUTS)}")
  return PALLAS_LAYOUTS[layout](h, w, targets, t, with_entropy=with_entropy,
                                chunk_size=chunk_size, interpret=interpret, block_n=block_n)


IMPLEMENTATIONS = {
    "reference": reference.fused_logprob,
    "xla": xla.fused_logprob,
    "pallas": pallas_fused_logprob,
}


class FusedLogprob(NamedTuple):
  logp: jax.Array  # [N] float32
  entropy: jax.Array | None  # [N] float32 when `with_entropy`
  rollout_kl: jax.Array | None  # [N] float32 when `rollout_logprobs` is given; 0 where masked


def default_impl() -> str:
  """`xla` on every backend: the implementation that has run on each of them. `pallas` is opt-in
  (`impl="pallas"`, `loss.logprob_impl=pallas`); where its kernels do not lower it falls back to
  `xla` with a warning (`pallas_unavailable`)."""
  return "xla"


@functools.cache
def pallas_unavailable(backend: str | None = None) -> str | None:
  """Why the compiled (not interpreted) Pallas kernels cannot run on `backend` (default: JAX's
  default backend), or None when they lower and compile there.

  Answered once per backend by compiling value+grad of a tiny call (a few seconds at most), so
  a failure shows up before a real step is traced, not as a lowering error inside it. Measured:
  Mosaic TPU and Triton (GPU) are the kernels' targets; on an H100 with jax 0.11.2 the GPU
  kernels compiled and matched `reference` (benchmarks/README.md), and CPU has no compiled
  Pallas backend at all.
  """
  backend = backend or jax.default_backend()
  n, d, v = 16, 16, 256
  on = jax.sharding.SingleDeviceSharding(jax.local_devices(backend=backend)[0])
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on) for shape, dtype in
          (((n, d), jnp.float32), ((d, v), jnp.float32), ((n,), jnp.int32), ((n,), jnp.float32))]

  def loss(h, w, targets, t):
    logp, entropy = pallas_fused_logprob(h, w, targets, t, with_entropy=True, chunk_size=128,
                                         interpret=False)
    return jnp.sum(logp) + jnp.sum(entropy)

  try:
    jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile()
  except Exception as e:  # noqa: BLE001  (any failure to lower or compile means "unavailable")
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first}"[:300]
  return None


_warned: set[str] = set()


def _resolve(impl: str | None, interpret) -> str:
  impl = default_impl() if impl is None else impl
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"unknown fused_logprob impl {impl!r}; expected one of "
                     f"{tuple(IMPLEMENTATIONS)}")
  backend = platform.current()
  compiled = interpret is False or (interpret is None and backend != "cpu")
  # Built for a target (`jaxrl.aot`) there is no device of it to probe: the program's own compile
  # is the probe, and the plan reports its error.
  if impl == "pallas" and compiled and not platform.is_target_set():
    reason = pallas_unavailable(backend)
    if reason is not None:
      if backend not in _warned:
        _warned.add(backend)
        warnings.warn(f"jaxrl: the pallas fused_logprob kernels do not lower on {backend} "
                      f"({reason}); using the xla implementation instead", RuntimeWarning,
                      stacklevel=3)
      return "xla"
  return impl


def fused_logprob(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *,
                  temperature=1.0, rollout_logprobs: jax.Array | None = None,
                  mask: jax.Array | None = None, estimator: str = "k2",
                  with_entropy: bool = False, impl: str | None = None,
                  chunk_size: int | None = None, interpret=None) -> FusedLogprob:
  """Per-token log-prob of `targets` (and entropy, rollout KL) from hidden states, fused.

  Args:
    hidden: `[N, D]` final hidden states (any float dtype; the matmul runs in it).
    unembedding: `[D, V]`.
    targets: `[N]` int token ids; ids outside `[0, V)` (padding) pick logit 0 (finite logp).
    temperature: scalar or `[N]`; `<= 0` means greedy and scales by 1. No gradient.
    rollout_logprobs: `[N]` float32 sampler log-probs, or None (then `rollout_kl` is None).
    mask: `[N]` bool; False tokens keep their `logp` / `entropy` but get `rollout_kl = 0`, and
      NaN/inf in their `rollout_logprobs` reach neither the KL nor its gradient.
    estimator: KL estimator name (`k1`, `k2`, `k3`, `abs`; see `jaxrl.losses.kl`).
    with_entropy: also return the entropy of `softmax(z)`.
    impl: `reference` (dense), `xla` (vocabulary-chunked), `pallas`; None = `default_impl()`.
      `pallas` compiled on a backend where it does not lower (`pallas_unavailable`) runs `xla`
      instead, with a one-time warning.
    chunk_size: vocabulary chunk (`xla`) / block (`pallas`) width; None = the impl's default.
    interpret: Pallas interpret mode (True or `pltpu.InterpretParams()`); None = interpret on
      CPU only, the only way Pallas runs there.

  Returns:
    `FusedLogprob(logp, entropy, rollout_kl)`, each `[N]` float32 or None.

  Differentiable w.r.t. `hidden` and `unembedding`; gradients at masked positions are exactly 0
  when the caller masks with `where(mask, x, 0)`.
  """
  impl = _resolve(impl, interpret)
  if hidden.ndim != 2 or unembedding.ndim != 2 or hidden.shape[1] != unembedding.shape[0]:
    raise ValueError(f"expected hidden [N, D] and unembedding [D, V]; got {hidden.shape} and "
                     f"{unembedding.shape} (vmap over leading axes)")
  n = hidden.shape[0]
  if targets.shape != (n,):
    raise ValueError(f"targets must be [N] = [{n}]; got {targets.shape}")
  t = common.effective_temperature(temperature, n)
  logp, entropy = IMPLEMENTATIONS[impl](
      hidden, unembedding, jnp.asarray(targets).astype(jnp.int32), t,
      with_entropy=with_entropy, chunk_size=chunk_size, interpret=interpret)
  rollout_kl = None
  if rollout_logprobs is not None:
    rollout_kl = kl_estimate(logp, rollout_logprobs, estimator, mask)
  return FusedLogprob(logp, entropy, rollout_kl)
