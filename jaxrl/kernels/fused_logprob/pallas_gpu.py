"""The fused log-prob's Pallas kernels in the `gpu` layout (Pallas' Triton backend);
`interpret=True` runs them on CPU for tests.

Same math as `xla.py` (see its docstring) and the `tpu` layout (`pallas_tpu`). Triton runs a
grid's programs concurrently, so no grid axis can accumulate; the accumulating axis becomes a
`fori_loop` inside the program:

- forward and `dh`, grid `(N / bn,)`: each program loops over the vocabulary blocks, keeping
  `m, s, a` (forward) or the `[bn, D]` `dh` rows (backward) in registers;
- `dW`, grid `(V / bv,)`: each program loops over the token blocks, keeping its `[D, bv]` block.

Triton needs every tile's size to be a power of two, so `D` is zero-padded to the next power of
two (zero columns of `h` and rows of `W` add nothing) and `V` to a multiple of `bv` (padded
columns masked out of every sum); this costs one padded copy of `W` per call. Tiles are sized in
bytes: `bn x D` <= 64 KiB and `D x bv` <= 128 KiB, and a shape whose smallest tiles (16 x D and
D x 16) would need more than `GPU_SMEM_BUDGET` of shared memory (measured on an H100: about
`(bn + bv) x D x itemsize`, of 227 KiB) runs the `xla` implementation instead, with a one-time
warning: `D` up to 1024 in f32, 2048 in bf16.

Measured on an H100 (benchmarks/README.md, "On a GPU"): correct (the kernel tests pass there
with `jax_default_matmul_precision=highest`), but at Qwen2.5-0.5B size slower than `xla` (3.7x
in bf16, 16x in f32: a whole `[bn, D]` row block per program means small dots), so `xla`
stays the default on GPU.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.kernels.fused_logprob import common, xla
from jaxrl.kernels.fused_logprob.pallas_common import (DEFAULT_BLOCK_V, col, default_interpret,
                                                       pad_rows, with_gradient)

# Shared memory a kernel's smallest tiles may need (an H100 has 227 KiB per kernel).
GPU_SMEM_BUDGET = 200 * 1024
GPU_NUM_WARPS = None  # None: 4 for tiles of <= 8K elements, else 8


def _pow2_ceil(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _pow2_floor(x: int) -> int:
  return 1 << (max(1, int(x)).bit_length() - 1)


def _gpu_blocks(n: int, d: int, v: int, block_v: int, block_n: int | None = None,
                itemsize: int = 4):
  """`(dp, bn, bv, n_pad, v_pad)`: padded `D`, power-of-two tiles (>= 16, Triton's smallest dot)
  of `bn x dp` <= 64 KiB (unless `block_n` is given) and `dp x bv` <= 128 KiB in `itemsize`
  bytes, and the padded `N`, `V`."""
  dp = max(16, _pow2_ceil(d))
  if block_n is None:
    bn = max(16, min(64, _pow2_floor((64 << 10) // (dp * itemsize))))
  else:
    bn = max(16, _pow2_floor(block_n))
  bv = max(16, min(_pow2_floor(block_v), _pow2_floor((128 << 10) // (dp * itemsize)),
                   _pow2_ceil(v)))
  return dp, bn, bv, -(-n // bn) * bn, -(-v // bv) * bv


def _gpu_params(interpret, dp: int, bv: int):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton
  warps = GPU_NUM_WARPS or (4 if dp * bv <= 8192 else 8)
  return pltriton.CompilerParams(num_warps=warps, num_stages=2)


def _precision(x):
  """Triton runs f32 dots in TF32 unless asked otherwise, as XLA GPU does by default; with
  `jax_default_matmul_precision` set to `highest` / `float32` the kernels ask for IEEE f32."""
  if x.dtype == jnp.float32 and jax.config.jax_default_matmul_precision in ("highest",
                                                                            "float32"):
    return lax.Precision.HIGHEST
  return None


def _gpu_z(h, w, t, start, v: int, bv: int):
  """`(z [bn, bv] float32, valid [1, bv])` for the vocabulary block at column `start`."""
  z = jnp.dot(h, w, preferred_element_type=jnp.float32, precision=_precision(h)) / t
  valid = (start + lax.broadcasted_iota(jnp.int32, (1, bv), 1)) < v
  return z, valid


def _gpu_dl(z, valid, t, lse, shift, g, ent, with_entropy, dt):
  p = jnp.where(valid, jnp.exp(z - lse), 0.0)  # padded columns: z = 0, p masked to 0
  coef = g + ent * (z - shift) if with_entropy else g
  return (-(p * coef) / t).astype(dt)


def _gpu_fwd_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, a_ref, *, v, bv, nv, with_entropy):
  h, t = h_ref[...], t_ref[...]

  def body(j, carry):
    m, s, a = carry
    start = pl.multiple_of(j * bv, bv)
    z, valid = _gpu_z(h, w_ref[:, pl.ds(start, bv)], t, start, v, bv)
    z = jnp.where(valid, z, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))  # finite: each block has a column
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new)
    s = s * scale + jnp.sum(e, axis=1, keepdims=True)
    if with_entropy:
      a = a * scale + jnp.sum(jnp.where(valid, e * z, 0.0), axis=1, keepdims=True)
    return m_new, s, a

  shape = m_ref.shape
  m, s, a = lax.fori_loop(0, nv, body, (jnp.full(shape, -jnp.inf, jnp.float32),
                                        jnp.zeros(shape, jnp.float32),
                                        jnp.zeros(shape, jnp.float32)))
  m_ref[...] = m
  s_ref[...] = s
  a_ref[...] = a


def _gpu_dh_kernel(h_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, dh_ref, *, v, bv, nv,
                   with_entropy, dt):
  h, t = h_ref[...], t_ref[...]
  lse, shift, g, ent = lse_ref[...], shift_ref[...], g_ref[...], e_ref[...]

  def body(j, acc):
    start = pl.multiple_of(j * bv, bv)
    w = w_ref[:, pl.ds(start, bv)]
    z, valid = _gpu_z(h, w, t, start, v, bv)
    dl = _gpu_dl(z, valid, t, lse, shift, g, ent, with_entropy, dt)
    return acc + lax.dot_general(dl, w, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=_precision(dl))

  dh_ref[...] = lax.fori_loop(0, nv, body, jnp.zeros(dh_ref.shape, jnp.float32))


def _gpu_dw_kernel(h_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, dw_ref, *, v, bv, bn,
                   nb, with_entropy, dt):
  start_v = pl.program_id(0) * bv
  w = w_ref[...]

  def body(i, acc):
    rows = pl.ds(pl.multiple_of(i * bn, bn), bn)
    h, t = h_ref[rows, :], t_ref[rows, :]
    z, valid = _gpu_z(h, w, t, start_v, v, bv)
    dl = _gpu_dl(z, valid, t, lse_ref[rows, :], shift_ref[rows, :], g_ref[rows, :],
                 e_ref[rows, :], with_entropy, dt)
    return acc + lax.dot_general(h, dl, (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=_precision(dl))

  dw_ref[...] = lax.fori_loop(0, nb, body, jnp.zeros(dw_ref.shape, jnp.float32))


def _gpu_pad(h, w, t, n_pad, dp, v_pad, dt):
  n, d = h.shape
  hp = jnp.pad(h.astype(dt), ((0, n_pad - n), (0, dp - d)))
  wp = jnp.pad(w.astype(dt), ((0, dp - d), (0, v_pad - w.shape[1])))
  tp = pad_rows(t[:, None], n_pad) + (jnp.arange(n_pad) >= n)[:, None]  # pad rows: t = 1
  return hp, wp, tp


def _forward(h, w, targets, t, block_v, block_n, with_entropy, interpret):
  n, d = h.shape
  v = w.shape[1]
  dt = common.compute_dtype(h, w)
  dp, bn, bv, n_pad, v_pad = _gpu_blocks(n, d, v, block_v, block_n, jnp.dtype(dt).itemsize)
  hp, wp, tp = _gpu_pad(h, w, t, n_pad, dp, v_pad, dt)
  acc = common.out_struct((n_pad, 1), jnp.float32, common.varying_axes(hp, wp, tp))
  row = pl.BlockSpec((bn, 1), lambda i: (i, 0))
  m, s, a = pl.pallas_call(
      functools.partial(_gpu_fwd_kernel, v=v, bv=bv, nv=v_pad // bv, with_entropy=with_entropy),
      out_shape=(acc, acc, acc),
      grid=(n_pad // bn,),
      in_specs=[pl.BlockSpec((bn, dp), lambda i: (i, 0)),
                pl.BlockSpec((dp, v_pad), lambda i: (0, 0)),
                row],
      out_specs=(row, row, row),
      compiler_params=_gpu_params(interpret, dp, bv),
      interpret=interpret,
      name="fused_logprob_fwd_gpu",
  )(hp, wp, tp)
  lse = (m + jnp.log(s))[:n, 0]
  entropy = lse - (a / s)[:n, 0] if with_entropy else None
  logp = common.target_logit(h.astype(dt), w.astype(dt), targets, t) - lse
  return logp, entropy, lse


def _backward(h, w, targets, t, lse, entropy, g_lp, g_ent, block_v, block_n, interpret):
  n, d = h.shape
  v = w.shape[1]
  with_entropy = entropy is not None
  dt = common.compute_dtype(h, w)
  dp, bn, bv, n_pad, v_pad = _gpu_blocks(n, d, v, block_v, block_n, jnp.dtype(dt).itemsize)
  hp, wp, tp = _gpu_pad(h, w, t, n_pad, dp, v_pad, dt)
  shift = lse - entropy if with_entropy else jnp.zeros_like(lse)
  rows = (tp, col(lse, n_pad), col(shift, n_pad), col(g_lp, n_pad), col(g_ent, n_pad))
  axes = common.varying_axes(hp, wp, *rows)
  kw = dict(v=v, bv=bv, with_entropy=with_entropy, dt=dt)
  params = _gpu_params(interpret, dp, bv)

  row = pl.BlockSpec((bn, 1), lambda i: (i, 0))
  dh = pl.pallas_call(
      functools.partial(_gpu_dh_kernel, nv=v_pad // bv, **kw),
      out_shape=common.out_struct((n_pad, dp), jnp.float32, axes),
      grid=(n_pad // bn,),
      in_specs=[pl.BlockSpec((bn, dp), lambda i: (i, 0)),
                pl.BlockSpec((dp, v_pad), lambda i: (0, 0))] + [row] * 5,
      out_specs=pl.BlockSpec((bn, dp), lambda i: (i, 0)),
      compiler_params=params,
      interpret=interpret,
      name="fused_logprob_dh_gpu",
  )(hp, wp, *rows)[:n, :d]

  whole_rows = pl.BlockSpec((n_pad, 1), lambda j: (0, 0))
  dw = pl.pallas_call(
      functools.partial(_gpu_dw_kernel, bn=bn, nb=n_pad // bn, **kw),
      out_shape=common.out_struct((dp, v_pad), jnp.float32, axes),
      grid=(v_pad // bv,),
      in_specs=[pl.BlockSpec((n_pad, dp), lambda j: (0, 0)),
                pl.BlockSpec((dp, bv), lambda j: (0, j))] + [whole_rows] * 5,
      out_specs=pl.BlockSpec((dp, bv), lambda j: (0, j)),
      compiler_params=params,
      interpret=interpret,
      name="fused_logprob_dw_gpu",
  )(hp, wp, *rows)[:d, :v]

  hc, wc = h.astype(dt), w.astype(dt)
  dh, dw = common.add_target_grads(hc, wc, targets, t, g_lp, dh, dw)
  return dh.astype(h.dtype), dw.astype(w.dtype)


_core = with_gradient(_forward, _backward)


_warned_wide = []


def fused_logprob(h, w, targets, t, *, with_entropy: bool = False, chunk_size=None,
                  interpret=None, block_n: int | None = None):
  """`(logp [N], entropy [N] or None)`, float32, in the `gpu` layout; `t` is the effective
  temperature `[N]`. `chunk_size` is the vocabulary block `bv` (default `DEFAULT_BLOCK_V`,
  rounded down to a power of two and capped by `D`), `block_n` the token block `bn` (None: sized
  by `D`). Compiled for a `D` whose smallest tiles overflow `GPU_SMEM_BUDGET`, it runs `xla`
  instead, with a one-time warning. `interpret`: as in `api.pallas_fused_logprob`."""
  if interpret is None:
    interpret = default_interpret(h, w, targets, t)
  block_v = DEFAULT_BLOCK_V if chunk_size is None else int(chunk_size)
  dt = jnp.dtype(common.compute_dtype(h, w))
  smem = 32 * max(16, _pow2_ceil(h.shape[1])) * dt.itemsize  # smallest tiles: 16 + 16 columns
  if smem > GPU_SMEM_BUDGET and not interpret:
    if not _warned_wide:
      _warned_wide.append(True)
      # stacklevel: past this function and `api`'s two, at the caller of `api.fused_logprob`.
      warnings.warn(f"jaxrl: the pallas fused_logprob gpu kernels' smallest tiles for D = "
                    f"{h.shape[1]} in {dt.name} need "
                    f"{smem} bytes of shared memory (budget {GPU_SMEM_BUDGET}); running the "
                    f"xla implementation", RuntimeWarning, stacklevel=4)
    return xla.fused_logprob(h, w, targets, t, with_entropy=with_entropy, chunk_size=chunk_size)
  h, w, targets, t = common.vary_all(h, w, targets.astype(jnp.int32), t)
  return _core(h, w, targets, t, block_v, block_n, bool(with_entropy), interpret)
