"""The fused log-prob's Pallas kernels in the `tpu` layout (Mosaic TPU; the CPU interpreter's
default); `interpret=True` runs them on CPU for tests.

Same math as `xla.py` (see its docstring), tiled over a grid:

- forward, grid `(N / bn, V / bv)`: each program computes the logits tile
  `z = (h[i] @ W[:, j]) / t` and folds it into the online-logsumexp accumulators `m, s, a`
  (`[bn, 1]` output blocks whose index ignores `j`, so they stay resident while `j` runs);
  `lse = m + log s`, `H = lse - a / s` are finished outside.
- `dh`, grid `(N / bn, V / bv)`: recomputes the tile, `dl = -(p (g + e (z - lse + H))) / t`,
  accumulates `dh[i] += dl @ W[:, j]^T` over `j`.
- `dW`, grid `(V / bv, N / bn)`: the same tile, accumulates `dW[:, j] += h[i]^T @ dl` over `i`.

The accumulating (last) grid axis must run in order on one core: it is "arbitrary" on TPU and
"sequential" on Mosaic GPU; the first axis is "parallel". The target-logit term is a gather /
scatter-add outside the kernels (`common`), as in `xla`.

Ragged shapes: `N` is padded to a multiple of `bn` with zero rows (zero cotangents, so they add
nothing); the last vocabulary block may run past `V`, so each kernel zeroes the out-of-range `W`
columns it read (their contents are unspecified) and masks them out of every sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.core import platform
from jaxrl.kernels.fused_logprob import common
from jaxrl.kernels.fused_logprob.pallas_common import (DEFAULT_BLOCK_N, DEFAULT_BLOCK_V, col,
                                                       default_interpret, pad_rows,
                                                       with_gradient)


def _compiler_params(interpret):
  """Dimension semantics for the `tpu` layout's (parallel, accumulating) grids."""
  if interpret:
    return None
  backend = platform.current()
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
  raise NotImplementedError(f"the pallas fused_logprob `tpu` layout compiles on TPU only (GPU "
                            f"uses the `gpu` layout; CPU needs interpret=True); backend is "
                            f"{backend!r}")


def _tile_logits(h_ref, w_ref, t_ref, j, v: int, bv: int):
  """`(z [bn, bv], w tile, valid [1, bv])` for vocabulary block `j`; out-of-range W zeroed."""
  col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
  valid = col < v
  w = w_ref[...]
  w = jnp.where(valid, w, jnp.zeros_like(w))
  z = jnp.dot(h_ref[...], w, preferred_element_type=jnp.float32) / t_ref[...]
  return z, w, valid


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, a_ref, *, v, bv, with_entropy):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
    a_ref[...] = jnp.zeros(a_ref.shape, jnp.float32)

  z, _, valid = _tile_logits(h_ref, w_ref, t_ref, j, v, bv)
  z = jnp.where(valid, z, -jnp.inf)
  m = m_ref[...]
  # Every block holds at least one valid column, so m_new is finite and exp(m - m_new) is 0 (not
  # NaN) on the first block.
  m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
  scale = jnp.exp(m - m_new)
  e = jnp.exp(z - m_new)
  s_ref[...] = s_ref[...] * scale + jnp.sum(e, axis=1, keepdims=True)
  if with_entropy:
    ez = jnp.where(valid, e * z, 0.0)  # e = 0 but z = -inf on masked columns: 0 * inf is NaN
    a_ref[...] = a_ref[...] * scale + jnp.sum(ez, axis=1, keepdims=True)
  m_ref[...] = m_new


def _tile_dl(h_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, j, v, bv, with_entropy, dt):
  """`(dl [bn, bv] in dt, w tile)`: `dl = -(p (g + e (z - shift))) / t`, 0 off the vocabulary."""
  z, w, valid = _tile_logits(h_ref, w_ref, t_ref, j, v, bv)
  p = jnp.where(valid, jnp.exp(z - lse_ref[...]), 0.0)
  coef = g_ref[...]
  if with_entropy:
    coef = coef + e_ref[...] * (z - shift_ref[...])
  return (-(p * coef) / t_ref[...]).astype(dt), w


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, dh_ref, *, v, bv,
               with_entropy, dt):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

  dl, w = _tile_dl(h_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, j, v, bv,
                   with_entropy, dt)
  dh_ref[...] += lax.dot_general(dl, w, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)


def _dw_kernel(h_ref, ht_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, dw_ref, *, v, bv,
               with_entropy, dt):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

  dl, _ = _tile_dl(h_ref, w_ref, t_ref, lse_ref, shift_ref, g_ref, e_ref, j, v, bv,
                   with_entropy, dt)
  # h^T arrives pre-transposed ([D, bn] tiles) so this is a plain matmul on every backend.
  dw_ref[...] += jnp.dot(ht_ref[...], dl, preferred_element_type=jnp.float32)



def _blocks(n: int, v: int, block_n: int, block_v: int):
  bn = min(block_n, -(-n // 8) * 8)  # tiles of 8 rows at least (TPU sublanes)
  bv = min(block_v, v)
  return bn, bv, -(-n // bn) * bn


# Mosaic's default scoped VMEM limit is 16 MiB (v5e; measured: Mosaic rejected the 7B defaults
# against it). Every program's double-buffered blocks and temporaries must fit: `vmem_estimate`
# must stay within this budget, which leaves 1 MiB for what it does not count.
VMEM_BUDGET = 15 * 2**20
# Tried in order for a block size left to default: the defaults first, then smaller vocabulary
# and token blocks, down to one (128, 128) tile.
_FALLBACK_BLOCKS = ((DEFAULT_BLOCK_N, DEFAULT_BLOCK_V), (256, 256), (128, 512), (128, 256),
                    (256, 128), (128, 128))


def vmem_estimate(bn: int, bv: int, d: int, itemsize: int) -> int:
  """Bytes of VMEM the largest of the three kernels holds per program: an upper bound, 1-25%
  above Mosaic's own count where it reported one (D = 3584, bf16: `dh` at (bn, bv) = (256, 512)
  24.3 MiB here, 20.6 Mosaic; `dW` at (256, 256) 21.5 / 19.3, at (128, 512) 29.6 / 23.4).

  Per kernel: its blocks double-buffered (h `[bn, D]`, h^T `[D, bn]` (dW only), W `[D, bv]`, the
  f32 outputs `dh [bn, D]` / `dW [D, bv]`, and the per-row `[bn, 1]` f32 columns, which VMEM
  pads to 128 lanes: 512 bytes a row), plus temporaries: the zero-masked W tile and a few
  `[bn, bv]` f32 tiles (z, p, dl).
  """
  rows = bn * 128 * 4
  h, w, tile = bn * d * itemsize, d * bv * itemsize, bn * bv * 4
  fwd = 2 * (h + w + 4 * rows) + w + 3 * tile
  dh = 2 * (h + w + bn * d * 4 + 5 * rows) + w + 4 * tile
  dw = 2 * (2 * h + w + d * bv * 4 + 5 * rows) + w + 4 * tile
  return max(fwd, dh, dw)


def fit_blocks(d: int, itemsize: int, block_n: int | None, block_v: int | None) -> tuple[int, int]:
  """`(bn, bv)`: the given sizes, and for those left None the first of `_FALLBACK_BLOCKS` whose
  `vmem_estimate` fits `VMEM_BUDGET` (the last one if none does). Only D and the dtype decide.
  Qwen2.5-0.5B (D = 896, bf16): the defaults (256, 512) fit (11.1 MiB). Qwen2.5-7B (D = 3584):
  they do not (34.8 MiB; Mosaic rejected them, `dh` 20.6 MiB of a 16 MiB limit); the `dW`
  kernel's f32 `[D, bv]` output block and its h, h^T tiles rule out every pair down to
  (256, 128) (14.9 MiB), which keeps `dh`'s and the forward's token block at 256 (W is re-read
  once per token block).
  """
  if block_n is not None and block_v is not None:
    return block_n, block_v
  options = [(block_n or n, block_v or v) for n, v in _FALLBACK_BLOCKS]
  for bn, bv in options:
    if vmem_estimate(bn, bv, d, itemsize) <= VMEM_BUDGET:
      return bn, bv
  return options[-1]


def _row_spec(bn, axis):
  return pl.BlockSpec((bn, 1), lambda *ij: (ij[axis], 0))


def _forward(h, w, targets, t, bn, bv, with_entropy, interpret):
  n, d = h.shape
  v = w.shape[1]
  _, _, n_pad = _blocks(n, v, bn, bv)
  dt = common.compute_dtype(h, w)
  hp, wc = pad_rows(h.astype(dt), n_pad), w.astype(dt)
  tp = pad_rows(t[:, None], n_pad) + (jnp.arange(n_pad) >= n)[:, None]  # pad rows: t = 1
  acc = common.out_struct((n_pad, 1), jnp.float32, common.varying_axes(hp, wc, tp))
  m, s, a = pl.pallas_call(
      functools.partial(_fwd_kernel, v=v, bv=bv, with_entropy=with_entropy),
      out_shape=(acc, acc, acc),
      grid=(n_pad // bn, pl.cdiv(v, bv)),
      in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
                pl.BlockSpec((d, bv), lambda i, j: (0, j)),
                _row_spec(bn, 0)],
      out_specs=(_row_spec(bn, 0), _row_spec(bn, 0), _row_spec(bn, 0)),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="fused_logprob_fwd",
  )(hp, wc, tp)
  lse = (m + jnp.log(s))[:n, 0]
  entropy = lse - (a / s)[:n, 0] if with_entropy else None
  logp = common.target_logit(h.astype(dt), wc, targets, t) - lse
  return logp, entropy, lse


def _backward(h, w, targets, t, lse, entropy, g_lp, g_ent, bn, bv, interpret):
  n, d = h.shape
  v = w.shape[1]
  _, _, n_pad = _blocks(n, v, bn, bv)
  with_entropy = entropy is not None
  dt = common.compute_dtype(h, w)
  hc, wc = h.astype(dt), w.astype(dt)
  hp = pad_rows(hc, n_pad)
  shift = lse - entropy if with_entropy else jnp.zeros_like(lse)
  tp = pad_rows(t[:, None], n_pad) + (jnp.arange(n_pad) >= n)[:, None]
  # Zero cotangents on pad rows make their dl exactly 0.
  rows = (tp, col(lse, n_pad), col(shift, n_pad), col(g_lp, n_pad), col(g_ent, n_pad))
  kw = dict(v=v, bv=bv, with_entropy=with_entropy, dt=dt)
  nb, vb = n_pad // bn, pl.cdiv(v, bv)
  axes = common.varying_axes(hp, wc, *rows)

  dh = pl.pallas_call(
      functools.partial(_dh_kernel, **kw),
      out_shape=common.out_struct((n_pad, d), jnp.float32, axes),
      grid=(nb, vb),
      in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
                pl.BlockSpec((d, bv), lambda i, j: (0, j))] + [_row_spec(bn, 0)] * 5,
      out_specs=pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="fused_logprob_dh",
  )(hp, wc, *rows)[:n]

  dw = pl.pallas_call(
      functools.partial(_dw_kernel, **kw),
      out_shape=common.out_struct((d, v), jnp.float32, axes),
      grid=(vb, nb),
      in_specs=[pl.BlockSpec((bn, d), lambda j, i: (i, 0)),
                pl.BlockSpec((d, bn), lambda j, i: (0, i)),
                pl.BlockSpec((d, bv), lambda j, i: (0, j))] + [_row_spec(bn, 1)] * 5,
      out_specs=pl.BlockSpec((d, bv), lambda j, i: (0, j)),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="fused_logprob_dw",
  )(hp, hp.T, wc, *rows)

  dh, dw = common.add_target_grads(hc, wc, targets, t, g_lp, dh, dw)
  return dh.astype(h.dtype), dw.astype(w.dtype)


_core = with_gradient(_forward, _backward)


def fused_logprob(h, w, targets, t, *, with_entropy: bool = False, chunk_size=None,
                  interpret=None, block_n: int | None = None):
  """`(logp [N], entropy [N] or None)`, float32, in the `tpu` layout; `t` is the effective
  temperature `[N]`. `chunk_size` is the vocabulary block `bv`, `block_n` the token block `bn`
  (None: `DEFAULT_BLOCK_V`, `DEFAULT_BLOCK_N`, or smaller where those do not fit VMEM at this
  D, `fit_blocks`); both shrink to fit small inputs.
  `interpret`: as in `api.pallas_fused_logprob`."""
  if interpret is None:
    interpret = default_interpret(h, w, targets, t)
  bn, bv = fit_blocks(h.shape[1], jnp.dtype(common.compute_dtype(h, w)).itemsize, block_n,
                      None if chunk_size is None else int(chunk_size))
  bn, bv, _ = _blocks(h.shape[0], w.shape[1], bn, bv)
  h, w, targets, t = common.vary_all(h, w, targets.astype(jnp.int32), t)
  return _core(h, w, targets, t, bn, bv, bool(with_entropy), interpret)
