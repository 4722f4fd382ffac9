"""The fused log-prob's Pallas kernels in the `gpu` layout (Pallas' Triton backend);
`interpret=True` runs them on CPU for tests.

Same math as `xla.py` (see its docstring) and the `tpu` layout (`pallas_tpu`). Every logits tile
`z = (h[rows] @ W[:, cols]) / t` is `[bn, bv]` in float32 registers, accumulated over the hidden
dimension in steps of `bd` (a K loop over `[bn, bd]` and `[bd, bv]` operand tiles, which Triton
pipelines `num_stages` deep through shared memory), so no tile holds a whole `D`-long row and
the tiles' sizes do not depend on `D`.

- forward, grid `(N / bn, splits)`: Triton runs a grid's programs concurrently, so no grid axis
  may accumulate; program `(i, s)` walks the vocabulary blocks of slice `s` of the vocabulary
  with an online logsumexp and writes that slice's `m, s, a` (`[N, splits]`); XLA merges the
  slices (a few bytes per row and slice). The logits never leave registers.
- backward, over vocabulary slices of `slice_v` columns (an XLA loop): the kernel, grid
  `(N / bn, slice_v / bv)`, one program per tile, recomputes the tile and writes
  `dl = -(p (g + e (z - lse + H))) / t` in the matmul dtype (`[N, slice_v]`, at most
  `GPU_DL_SLICE_BYTES`); then `dh += dl @ W_slice^T` and `dW_slice = h^T @ dl` are two plain
  GEMMs (XLA's, cuBLAS on a GPU).

Why the backward GEMMs are not in the kernel: `dh[rows]` sums over the whole vocabulary and
`dW[:, cols]` over all tokens, with `D` (896 to 8192) the other side of each. A `[bn, D]` or
`[D, bv]` f32 accumulator does not fit in one program's registers, and the ways around that cost
more than the GEMMs: accumulating in the output in global memory reads and writes
`N V D 8 / bv` bytes for `dh` and `N V D 8 / bn` for `dW` (140 GB at Qwen2.5-0.5B size with 128 x
128 tiles, mostly past the L2 cache), atomics move as much and are not deterministic, and
tiling `D` in the accumulator recomputes the logits `D / bd` times. Written once in bf16, `dl`
costs `2 N V` bytes (2.5 GB at that size) and leaves both products as large GEMMs.

Triton needs every tile's size to be a power of two, at least 16: `D` is zero-padded to a
multiple of `bd`, `V` to a multiple of `bv` (padded columns masked out of every sum), `N` to a
multiple of `bn`; nothing is copied when the shape is already a multiple (Qwen2.5-0.5B's
D = 896 = 14 x 64 and V = 151936 = 1187 x 128 are). When `slice_v` does not divide the padded
vocabulary, the last slice starts early and masks the columns the one before it covered (as the
`xla` chunks do). The target-logit term is a gather / scatter-add outside the kernels (`common`),
as in `xla`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.kernels.fused_logprob import common
from jaxrl.kernels.fused_logprob.pallas_common import (col, default_interpret, pad_rows,
                                                       with_gradient)

# Tiles for an H100 (the same hold on an H200): a [128, 128] f32 logits tile is 64 registers
# per thread at 8 warps, and one pipeline stage of [128, bd] + [bd, 128] operands is 32 KiB
# (bd = 64 in bf16, 32 in f32), so 3 stages take 96 KiB of shared memory and two programs can
# share an SM (228 KiB of shared memory, 64K registers).
GPU_BLOCK_N = 128
GPU_BLOCK_V = 128
GPU_MAX_BLOCK_V = 256  # a larger `chunk_size` (e.g. one meant for `xla`) is capped here
GPU_BLOCK_D_BYTES = 128  # bd x itemsize: 64 bf16 or 32 f32 columns per K step
GPU_NUM_WARPS = None  # None: 8 for tiles of more than 64 x 64, else 4
GPU_NUM_STAGES = 3
# Enough forward programs to fill an H100 (132 SMs, two programs each) about four times over, so
# the last wave's idle tail is a small part of the run.
GPU_MIN_PROGRAMS = 1024
# The backward's `dl` buffer (one vocabulary slice for all tokens): 256 MiB is 16384 columns at
# N = 8192 in bf16 (10 slices at V = 151936), each of its GEMMs some 240 GFLOP.
GPU_DL_SLICE_BYTES = 256 << 20


class Tiles(NamedTuple):
  """A call's static tile plan (hashable: it is a static argument of the `custom_vjp`)."""
  bn: int  # token rows per tile
  bv: int  # vocabulary columns per tile
  bd: int  # hidden units per K step
  splits: int | None  # forward: vocabulary slices run in parallel; None: `GPU_MIN_PROGRAMS`
  slice_v: int  # backward: vocabulary columns per `dl` slice, a multiple of `bv`


def _pow2_ceil(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _pow2_floor(x: int) -> int:
  return 1 << (max(1, int(x)).bit_length() - 1)


def _fit(want: int, size: int, cap: int | None = None) -> int:
  """A power-of-two tile `<= want` (and `<= cap`), >= 16 (Triton's smallest dot), no larger
  than `size` rounded up to a power of two (no tile mostly made of padding)."""
  b = min(_pow2_floor(want), _pow2_ceil(size))
  if cap is not None:
    b = min(b, cap)
  return max(16, b)


def plan_tiles(n: int, d: int, v: int, itemsize: int, block_n: int | None = None,
               block_v: int | None = None, block_d: int | None = None,
               splits: int | None = None, slice_v: int | None = None) -> Tiles:
  """The tiles for an `[n, d] x [d, v]` call in `itemsize`-byte operands (see the constants);
  `slice_v` (default: by `GPU_DL_SLICE_BYTES`) is rounded up to whole vocabulary blocks."""
  bn = _fit(block_n or GPU_BLOCK_N, n)
  bv = _fit(block_v or GPU_BLOCK_V, v, GPU_MAX_BLOCK_V)
  nv = -(-v // bv)
  if slice_v is None:
    blocks = GPU_DL_SLICE_BYTES // (-(-n // bn) * bn * itemsize * bv)
  else:
    blocks = -(-int(slice_v) // bv)
  return Tiles(bn=bn, bv=bv, bd=_fit(block_d or GPU_BLOCK_D_BYTES // itemsize, d),
               splits=None if splits is None else max(1, int(splits)),
               slice_v=max(1, min(blocks, nv)) * bv)


def _slices(blocks: int, programs: int, splits: int | None):
  """`(count, per)`: the loop over `blocks` cut into `count` slices of `per` blocks (the last
  may be shorter, none is empty), so that `programs` x `count` programs fill the GPU."""
  want = splits if splits is not None else -(-GPU_MIN_PROGRAMS // programs)
  per = -(-blocks // max(1, min(want, blocks)))
  return -(-blocks // per), per


class Grids(NamedTuple):
  """The kernels' grids."""
  fwd: tuple[int, int]  # (token blocks, vocabulary slices)
  fwd_per: int  # vocabulary blocks one forward program walks (fewer in the last slice)
  dl: tuple[int, int]  # (token blocks, vocabulary blocks of one slice), one program per tile
  slices: int  # backward vocabulary slices (XLA loop iterations)


def plan_grids(n: int, d: int, v: int, tiles: Tiles) -> Grids:
  """The kernels' grids for an `[n, d] x [d, v]` call with `tiles`."""
  del d  # the K loop runs inside every program
  nb, nv = -(-n // tiles.bn), -(-v // tiles.bv)
  fwd, fwd_per = _slices(nv, nb, tiles.splits)
  return Grids((nb, fwd), fwd_per, (nb, tiles.slice_v // tiles.bv),
               -(-nv * tiles.bv // tiles.slice_v))


def _loop_range(per: int, blocks: int):
  """`[lo, hi)`: the loop blocks of this program's slice (grid axis 1); the last is shorter."""
  lo = pl.program_id(1) * per
  return lo, jnp.minimum(lo + per, blocks)


def _gpu_params(interpret, tiles: Tiles):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton
  warps = GPU_NUM_WARPS or (4 if tiles.bn * tiles.bv <= 64 * 64 else 8)
  return pltriton.CompilerParams(num_warps=warps, num_stages=GPU_NUM_STAGES)


def _precision(x):
  """Triton runs f32 dots in TF32 unless asked otherwise, as XLA GPU does by default; with
  `jax_default_matmul_precision` set to `highest` / `float32` the kernels ask for IEEE f32."""
  if x.dtype == jnp.float32 and jax.config.jax_default_matmul_precision in ("highest",
                                                                            "float32"):
    return lax.Precision.HIGHEST
  return None


def _k(k, bd: int):
  return pl.ds(pl.multiple_of(k * bd, bd), bd)


def _logits(h_ref, w_ref, rows, cols, t, shape, nk: int, bd: int):
  """`z = (h[rows] @ W[:, cols]) / t`, float32 `shape = [bn, bv]`, over `nk` K steps of `bd`."""

  def step(k, acc):
    h = h_ref[rows, _k(k, bd)]
    return acc + jnp.dot(h, w_ref[_k(k, bd), cols], preferred_element_type=jnp.float32,
                         precision=_precision(h))

  return lax.fori_loop(0, nk, step, jnp.zeros(shape, jnp.float32)) / t


def _valid(start, v: int, bv: int):
  """`[1, bv]`: which of the block's columns lie inside the real vocabulary."""
  return (start + lax.broadcasted_iota(jnp.int32, (1, bv), 1)) < v


def _dl(z, valid, t, lse, shift, g, ent, with_entropy, dt):
  """`dl = -(p (g + e (z - shift))) / t` in `dt` (the matmuls' dtype); 0 off the vocabulary."""
  p = jnp.where(valid, jnp.exp(z - lse), 0.0)  # padded columns: z = 0, p masked to 0
  coef = g + ent * (z - shift) if with_entropy else g
  return (-(p * coef) / t).astype(dt)


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, a_ref, *, v, bv, bd, nk, nv, per,
                with_entropy):
  t = t_ref[...]
  lo, hi = _loop_range(per, nv)

  def body(j, carry):
    m, s, a = carry
    start = pl.multiple_of(j * bv, bv)
    valid = _valid(start, v, bv)
    z = _logits(h_ref, w_ref, slice(None), pl.ds(start, bv), t, (t.shape[0], bv), nk, bd)
    z = jnp.where(valid, z, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))  # finite: each block has a column
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new)
    s = s * scale + jnp.sum(e, axis=1, keepdims=True)
    if with_entropy:  # e = 0 but z = -inf on masked columns: 0 * inf is NaN
      a = a * scale + jnp.sum(jnp.where(valid, e * z, 0.0), axis=1, keepdims=True)
    return m_new, s, a

  shape = m_ref.shape
  m, s, a = lax.fori_loop(lo, hi, body, (jnp.full(shape, -jnp.inf, jnp.float32),
                                         jnp.zeros(shape, jnp.float32),
                                         jnp.zeros(shape, jnp.float32)))
  m_ref[...] = m
  s_ref[...] = s
  a_ref[...] = a


def _dl_kernel(h_ref, w_ref, keep_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, dl_ref, *, nk,
               bd, with_entropy):
  t = t_ref[...]
  z = _logits(h_ref, w_ref, slice(None), slice(None), t, dl_ref.shape, nk, bd)
  dl_ref[...] = _dl(z, keep_ref[...] != 0, t, lse_ref[...], shift_ref[...], g_ref[...],
                    e_ref[...], with_entropy, dl_ref.dtype)


class _Padded(NamedTuple):
  h: jax.Array  # [n_pad, d_pad] in the compute dtype
  w: jax.Array  # [d_pad, v_pad]
  t: jax.Array  # [n_pad, 1] float32; 1 on pad rows
  nb: int  # token blocks
  nv: int  # vocabulary blocks
  nk: int  # K steps


def _pad(h, w, t, tiles: Tiles, dt) -> _Padded:
  """Zero padding up to whole tiles; a dimension that is already a multiple is not copied."""
  (n, d), v = h.shape, w.shape[1]
  nb, nv, nk = -(-n // tiles.bn), -(-v // tiles.bv), -(-d // tiles.bd)
  n_pad, v_pad, d_pad = nb * tiles.bn, nv * tiles.bv, nk * tiles.bd
  hp, wp = h.astype(dt), w.astype(dt)
  if (n_pad, d_pad) != (n, d):
    hp = jnp.pad(hp, ((0, n_pad - n), (0, d_pad - d)))
  if (d_pad, v_pad) != (d, v):
    wp = jnp.pad(wp, ((0, d_pad - d), (0, v_pad - v)))
  tp = pad_rows(t[:, None], n_pad) + (jnp.arange(n_pad) >= n)[:, None]  # pad rows: t = 1
  return _Padded(hp, wp, tp, nb, nv, nk)


def _forward(h, w, targets, t, tiles: Tiles, unused, with_entropy, interpret):
  del unused
  n, v = h.shape[0], w.shape[1]
  dt = common.compute_dtype(h, w)
  p = _pad(h, w, t, tiles, dt)
  bn, bv = tiles.bn, tiles.bv
  grid = plan_grids(n, h.shape[1], v, tiles)
  count, per = grid.fwd[1], grid.fwd_per
  part = common.out_struct((p.h.shape[0], count), jnp.float32, common.varying_axes(p.h, p.w))
  part_spec = pl.BlockSpec((bn, 1), lambda i, s: (i, s))
  m, s, a = pl.pallas_call(
      functools.partial(_fwd_kernel, v=v, bv=bv, bd=tiles.bd, nk=p.nk, nv=p.nv, per=per,
                        with_entropy=with_entropy),
      out_shape=(part, part, part),
      grid=(p.nb, count),
      in_specs=[pl.BlockSpec((bn, p.h.shape[1]), lambda i, s: (i, 0)),
                pl.BlockSpec(p.w.shape, lambda i, s: (0, 0)),
                pl.BlockSpec((bn, 1), lambda i, s: (i, 0))],
      out_specs=(part_spec, part_spec, part_spec),
      compiler_params=_gpu_params(interpret, tiles),
      interpret=interpret,
      name="fused_logprob_fwd_gpu",
  )(p.h, p.w, p.t)
  # Merge the vocabulary slices' online-logsumexp states (each slice holds a column, so every
  # m is finite and exp(m - top) is in (0, 1]).
  top = jnp.max(m, axis=1, keepdims=True)
  scale = jnp.exp(m - top)
  total = jnp.sum(s * scale, axis=1)[:n]
  lse = top[:n, 0] + jnp.log(total)
  entropy = lse - jnp.sum(a * scale, axis=1)[:n] / total if with_entropy else None
  logp = common.target_logit(h.astype(dt), w.astype(dt), targets, t) - lse
  return logp, entropy, lse


def _backward(h, w, targets, t, lse, entropy, g_lp, g_ent, tiles: Tiles, unused, interpret):
  del unused
  (n, d), v = h.shape, w.shape[1]
  with_entropy = entropy is not None
  dt = common.compute_dtype(h, w)
  p = _pad(h, w, t, tiles, dt)
  (n_pad, d_pad), v_pad = p.h.shape, p.w.shape[1]
  bn, bv, sv = tiles.bn, tiles.bv, tiles.slice_v
  shift = lse - entropy if with_entropy else jnp.zeros_like(lse)
  # Zero cotangents on pad rows make their dl exactly 0.
  rows = (p.t, col(lse, n_pad), col(shift, n_pad), col(g_lp, n_pad), col(g_ent, n_pad))
  axes = common.varying_axes(p.h, p.w, *rows)
  row = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  dl_slice = pl.pallas_call(
      functools.partial(_dl_kernel, nk=p.nk, bd=tiles.bd, with_entropy=with_entropy),
      out_shape=common.out_struct((n_pad, sv), dt, axes),
      grid=plan_grids(n, d, v, tiles).dl,
      in_specs=[pl.BlockSpec((bn, d_pad), lambda i, j: (i, 0)),
                pl.BlockSpec((d_pad, bv), lambda i, j: (0, j)),
                pl.BlockSpec((1, bv), lambda i, j: (0, j))] + [row] * 5,
      out_specs=pl.BlockSpec((bn, bv), lambda i, j: (i, j)),
      compiler_params=_gpu_params(interpret, tiles),
      interpret=interpret,
      name="fused_logprob_dl_gpu",
  )

  def body(s, carry):
    dh, dw = carry
    start = jnp.minimum(s * sv, v_pad - sv)
    ws = lax.dynamic_slice_in_dim(p.w, start, sv, axis=1)
    cols = start + jnp.arange(sv)
    # Columns an earlier slice covered (the last slice starts early) or past V: dl = 0.
    keep = common.vary(((cols >= s * sv) & (cols < v)).astype(jnp.int32)[None], axes)
    dl = dl_slice(p.h, ws, keep, *rows)
    dh = dh + lax.dot_general(dl, ws, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dws = lax.dot_general(p.h, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    # Adding (not overwriting) keeps what the slice before wrote into the overlap.
    dw = lax.dynamic_update_slice_in_dim(
        dw, lax.dynamic_slice_in_dim(dw, start, sv, axis=1) + dws, start, axis=1)
    return dh, dw

  init = (common.vary(jnp.zeros((n_pad, d_pad), jnp.float32), axes),
          common.vary(jnp.zeros((d_pad, v_pad), jnp.float32), axes))
  dh, dw = lax.fori_loop(0, plan_grids(n, d, v, tiles).slices, body, init)
  hc, wc = h.astype(dt), w.astype(dt)
  dh, dw = common.add_target_grads(hc, wc, targets, t, g_lp, dh[:n, :d], dw[:d, :v])
  return dh.astype(h.dtype), dw.astype(w.dtype)


_core = with_gradient(_forward, _backward)


def fused_logprob(h, w, targets, t, *, with_entropy: bool = False, chunk_size=None,
                  interpret=None, block_n: int | None = None, block_d: int | None = None,
                  splits: int | None = None, slice_v: int | None = None):
  """`(logp [N], entropy [N] or None)`, float32, in the `gpu` layout; `t` is the effective
  temperature `[N]`.

  Tiles (each rounded down to a power of two, at least 16, and no larger than its dimension
  rounded up to one): `chunk_size` is the vocabulary block `bv` (default `GPU_BLOCK_V`, at most
  `GPU_MAX_BLOCK_V`), `block_n` the token block `bn` (default `GPU_BLOCK_N`), `block_d` the K
  step `bd` (default `GPU_BLOCK_D_BYTES` / itemsize). `splits`: how many slices of the
  vocabulary the forward walks in parallel (None: enough for `GPU_MIN_PROGRAMS` programs).
  `slice_v`: the backward's vocabulary slice (None: `GPU_DL_SLICE_BYTES` of `dl`).
  `interpret`: as in `api.pallas_fused_logprob`."""
  if interpret is None:
    interpret = default_interpret(h, w, targets, t)
  itemsize = jnp.dtype(common.compute_dtype(h, w)).itemsize
  tiles = plan_tiles(h.shape[0], h.shape[1], w.shape[1], itemsize, block_n,
                     None if chunk_size is None else int(chunk_size), block_d, splits, slice_v)
  h, w, targets, t = common.vary_all(h, w, targets.astype(jnp.int32), t)
  return _core(h, w, targets, t, tiles, None, bool(with_entropy), interpret)
