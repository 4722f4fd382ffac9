"""Flash attention over packed rows as Pallas TPU (Mosaic) kernels; `interpret` runs the same
kernels on CPU for tests.

The math is `xla.py`'s (see its docstring), tiled over queries as well as keys. Three kernels:

- forward, grid `(B, H, T / bq, S / bk)`: one query block of one head against key block `j`,
  folded into the online softmax (`m`, `l`, `acc` in VMEM scratch while `j` runs); the last
  key block writes `out = acc / l` and the statistics `m`, `l` for the backward pass.
- `dq`, grid `(B, H, T / bq, S / bk)`: recomputes `p = e^{s - m} / l` per block and
  accumulates `dq += ds K_j` over `j`.
- `dk, dv`, grid `(B, Hkv, S / bk, G, T / bq)`: the same blocks seen from the keys; every query
  head of the group and every query block accumulates into one key block's `dk`, `dv`.

The accumulating axes run in order on one core ("arbitrary"); the others are "parallel".

The mask is built per `[bq, bk]` block inside the kernels from per-token integers (segment,
position, shared flag; a shared key is seen within its segment's unit, `reference.UNIT_SHIFT`),
never as a `[T, S]` array in HBM. The per-query integers travel as
`[B, T, 1]` columns and the per-key ones as `[B, 1, S]` rows, so they broadcast against each
other into the block's mask.

Blocks no query of the block attends (a later key block of a causal row, another segment's
keys) skip both matmuls: each kernel reduces the block's mask to one flag and branches on it.
Such a block still feeds the rows that attend nothing (padding queries, a query with no earlier
key), which `reference` gives the mean of all S values: the forward adds the block's value sum
to them, the `dk, dv` kernel their `do / l` to every value of the block. Their inputs are still
copied into VMEM (the grid's pipeline does not look at the flag).

Padding: T is padded to a multiple of `bq` with padding queries (segment -1, zero cotangent,
sliced off) and S to a multiple of `bk` with zero keys whose column index is past S: they
score `-inf` (weight 0, even in a fully masked row), so a fully masked row still averages the
S real values exactly as in `reference`. Masked keys score `MASK_VALUE`, as everywhere.

Memory: the inputs, the output and `[B, H, T]` float32 statistics (`m`, `l`: the residuals the
backward pass reads besides q, k, v and out) in HBM; per program a few `[bq, bk]` and
`[bq, Dh]` tiles in VMEM. Nothing quadratic in the sequence. Transient, per call: the kernels
read per-query values as `[.., T, 1]` columns, which a TPU pads to 128 lanes in HBM (the token
integers, 2 x 512 bytes per query token; in the backward pass `m`, `l` and `delta`, 3 x 512 bytes
per query token and head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.core import platform
from jaxrl.kernels.attention.reference import MASK_VALUE, UNIT_SHIFT
from jaxrl.kernels.fused_logprob import common
from jaxrl.kernels.fused_logprob.pallas_common import default_interpret

# TPU tiles: blocks are multiples of 128 when compiled (the key block is the lane axis of the
# scores and of the per-key rows; 128 rows also fill a bf16 (16, 128) tile). At
# Dh = 128 in bf16 a forward program holds q (64 KiB), k and v (128 KiB each) and a float32
# score tile (512 KiB): well inside VMEM with double buffering.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
# `s` and `dp` contract Dh of both operands (q K^T, do V^T).
_TRANS_B = (((1,), (1,)), ((), ()))


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


# Interpreted (tests), blocks may have any width and a single block needs only whole sublanes, so
# small cases stay small.
_COMPILED_ALIGN, _INTERPRETED_ALIGN = 128, 8


def plan(length: int, block: int, compiled: bool = True) -> tuple[int, int]:
  """`(block, padded length)` for one sequence axis: one block of the length rounded up to
  128 (8 interpreted) when that fits in `block`, else `block` wide. Static: they define the
  grid."""
  if compiled and block % _COMPILED_ALIGN:
    raise ValueError(f"pallas_tpu attention blocks must be multiples of {_COMPILED_ALIGN} when "
                     f"compiled for TPU; got {block} (interpret=True takes any width)")
  one = _round_up(max(length, 1), _COMPILED_ALIGN if compiled else _INTERPRETED_ALIGN)
  if one <= block:
    return one, one
  return block, _round_up(length, block)


def _compiler_params(interpret, semantics):
  if interpret:
    return None
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _block_mask(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref):
  """`[bq, bk]` bool, True where the query attends the key (`reference.token_mask`)."""
  qs, qp = qseg_ref[...], qpos_ref[...]  # [bq, 1]
  ks, kp = kseg_ref[...], kpos_ref[...]  # [1, bk]
  # A shared key (a group's prompt) is seen by every query of its unit.
  unit = lambda x: lax.shift_right_arithmetic(x, jnp.int32(UNIT_SHIFT))
  same = (ks == qs) | ((kshr_ref[...] != 0) & (unit(ks) == unit(qs)))
  return (qs >= 0) & (ks >= 0) & (kp <= qp) & same


def _real_keys(j, bk: int, s_len: int, axis: int):
  """Which keys of block `j` lie before S: `[1, bk]` (axis 1) or `[bk, 1]` (axis 0)."""
  shape = (1, bk) if axis == 1 else (bk, 1)
  return j * bk + lax.broadcasted_iota(jnp.int32, shape, axis) < s_len


def _block_scores(q_ref, k_ref, mask, j, *, scale, s_len):
  """Float32 scores `[bq, bk]` of key block `j`: masked keys `MASK_VALUE`, keys past S `-inf`."""
  s = lax.dot_general(q_ref[...], k_ref[...], _TRANS_B,
                      preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask, s, MASK_VALUE)
  return jnp.where(_real_keys(j, s.shape[1], s_len, 1), s, -jnp.inf)


def _fwd_kernel(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref, q_ref, k_ref, v_ref,
                o_ref, m_ref, l_ref, m_sc, l_sc, acc_sc, *, scale, s_len):
  j = pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  mask = _block_mask(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref)
  live = jnp.any(mask)

  @pl.when(live)
  def _attend():
    s = _block_scores(q_ref, k_ref, mask, j, scale=scale, s_len=s_len)
    m_prev = m_sc[...]
    # Key block 0 always holds key 0 (a real key), so m_new is finite from the first block on
    # and e^{m_prev - m_new} is 0, not NaN, there.
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_sc[...] = acc_sc[...] * alpha + jnp.dot(p.astype(v.dtype), v,
                                                preferred_element_type=jnp.float32)
    m_sc[...] = m_new

  # A block nobody in it attends (causally later, another segment: half the blocks of a causal
  # row) skips both matmuls. Its real keys all score MASK_VALUE, which weighs e^0 = 1 in rows
  # that have attended nothing yet (they must end as the mean of all S values) and 0 in every
  # other row: the same update as `_attend`, from the block's value sum.
  @pl.when(jnp.logical_not(live))
  def _masked():
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, MASK_VALUE)
    alpha = jnp.exp(m_prev - m_new)
    w = jnp.exp(MASK_VALUE - m_new)  # [bq, 1]: 1 or 0
    n_real = jnp.sum(_real_keys(j, k_ref.shape[0], s_len, 1).astype(jnp.float32), axis=1,
                     keepdims=True)
    v_sum = jnp.sum(v_ref[...].astype(jnp.float32), axis=0, keepdims=True)  # padding keys are 0
    l_sc[...] = l_sc[...] * alpha + w * n_real
    acc_sc[...] = acc_sc[...] * alpha + w * v_sum
    m_sc[...] = m_new

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
    m_ref[...] = m_sc[...]
    l_ref[...] = l_sc[...]


def _block_ds(q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, delta_ref, mask, j, *, scale, s_len):
  """`(p, ds)` `[bq, bk]` float32 of key block `j`: the probabilities recomputed from the saved
  statistics and the scores' cotangent (0 where masked)."""
  s = _block_scores(q_ref, k_ref, mask, j, scale=scale, s_len=s_len)
  p = jnp.exp(s - m_ref[...]) / l_ref[...]
  dp = lax.dot_general(do_ref[...], v_ref[...], _TRANS_B, preferred_element_type=jnp.float32)
  ds = jnp.where(mask, p * (dp - delta_ref[...]), 0.0) * scale
  return p, ds


def _dq_kernel(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref, q_ref, k_ref, v_ref, do_ref,
               m_ref, l_ref, delta_ref, dq_ref, dq_sc, *, scale, s_len):
  j = pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  mask = _block_mask(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref)

  # ds is 0 wherever the mask is, so a block nobody attends adds nothing to dq.
  @pl.when(jnp.any(mask))
  def _attend():
    _, ds = _block_ds(q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, delta_ref, mask, j,
                      scale=scale, s_len=s_len)
    k = k_ref[...]
    dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref, q_ref, k_ref, v_ref, do_ref,
                m_ref, l_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, scale, s_len):
  j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  first = (g == 0) & (i == 0)
  last = (g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1)

  @pl.when(first)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  mask = _block_mask(qseg_ref, qpos_ref, kseg_ref, kpos_ref, kshr_ref)
  live = jnp.any(mask)

  @pl.when(live)
  def _attend():
    p, ds = _block_ds(q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, delta_ref, mask, j,
                      scale=scale, s_len=s_len)
    do, q = do_ref[...], q_ref[...]
    dv_sc[...] += jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dk_sc[...] += jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

  # A block nobody attends: no dk; each real key's p is `e^{MASK_VALUE - m} / l` (1 / l in a
  # row that attends nothing, else 0), the same for every key, so dv gets that row sum of do.
  @pl.when(jnp.logical_not(live))
  def _masked():
    w = jnp.exp(MASK_VALUE - m_ref[...]) / l_ref[...]  # [bq, 1]
    w_do = jnp.sum(w * do_ref[...].astype(jnp.float32), axis=0, keepdims=True)  # [1, Dh]
    real = _real_keys(j, k_ref.shape[0], s_len, 0)  # [bk, 1]
    dv_sc[...] += jnp.where(real, w_do, 0.0)

  @pl.when(last)
  def _finish():
    dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _pad_axis(x, axis: int, size: int, fill):
  pad = size - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=fill)


def _token_ids(q_segment, q_position, kv_segment, kv_position, kv_shared, tp, sp):
  """The mask's integers, padded: `[B, Tp, 1]` query columns and `[B, 1, Sp]` key rows.
  Padding queries and keys get segment -1 (masked); keys past S are also cut by index."""
  column = lambda x, fill: _pad_axis(x, 1, tp, fill)[:, :, None]
  row = lambda x, fill: _pad_axis(x, 1, sp, fill)[:, None, :]
  return (column(q_segment, -1), column(q_position, 0), row(kv_segment, -1),
          row(kv_position, 0), row(kv_shared.astype(jnp.int32), 0))


def _specs(bq, bk, d, g, for_keys: bool):
  """BlockSpecs of (ids x5, q, k, v, do, m, l, delta) for the query-major grid
  `(b, h, i, j)` or, `for_keys`, the key-major grid `(b, kh, j, g, i)`."""
  if for_keys:
    qi = lambda b, kh, j, gg, i: (b, kh * g + gg, i, 0)
    ki = lambda b, kh, j, gg, i: (b, kh, j, 0)
    qcol = lambda b, kh, j, gg, i: (b, i, 0)
    krow = lambda b, kh, j, gg, i: (b, 0, j)
  else:
    qi = lambda b, h, i, j: (b, h, i, 0)
    # lax.div, not //: jnp's floor division lowers through `sign`, whose Mosaic rule asks the
    # local device for its TPU generation (so lowering for a TPU from a CPU would fail).
    ki = lambda b, h, i, j: (b, lax.div(h, g), j, 0)
    qcol = lambda b, h, i, j: (b, i, 0)
    krow = lambda b, h, i, j: (b, 0, j)
  col, row = pl.BlockSpec((None, bq, 1), qcol), pl.BlockSpec((None, 1, bk), krow)
  qs, ks = pl.BlockSpec((None, None, bq, d), qi), pl.BlockSpec((None, None, bk, d), ki)
  stat = pl.BlockSpec((None, None, bq, 1), qi)
  return dict(ids=[col, col, row, row, row], q=qs, k=ks, stat=stat)


def _layout(q, k, v, bq, bk, interpret):
  """q `[B, H, Tp, Dh]`, k and v `[B, Hkv, Sp, Dh]` in one compute dtype, zero padded."""
  dt = jnp.result_type(q, k, v)
  compiled = not interpret
  (t, s), (bq_, tp), (bk_, sp) = (q.shape[1], k.shape[1]), plan(q.shape[1], bq, compiled), \
      plan(k.shape[1], bk, compiled)
  heads = lambda x, size: _pad_axis(x.astype(dt).transpose(0, 2, 1, 3), 2, size, 0)
  return heads(q, tp), heads(k, sp), heads(v, sp), (t, s, bq_, bk_, tp, sp)


def _forward(q, k, v, ids, scale, bq, bk, interpret):
  """`(out [B, T, H, Dh] in q's dtype, m, l [B, H, Tp] float32)`."""
  qh, kh, vh, (t, s, bq, bk, tp, sp) = _layout(q, k, v, bq, bk, interpret)
  b, h, _, d = qh.shape
  g = h // kh.shape[1]
  ids = _token_ids(*ids, tp, sp)
  sp_ = _specs(bq, bk, d, g, for_keys=False)
  axes = common.varying_axes(qh, kh, vh, *ids)
  stat = common.out_struct((b, h, tp, 1), jnp.float32, axes)
  o, m, l = pl.pallas_call(
      functools.partial(_fwd_kernel, scale=scale, s_len=s),
      out_shape=(common.out_struct(qh.shape, q.dtype, axes), stat, stat),
      grid=(b, h, tp // bq, sp // bk),
      in_specs=sp_["ids"] + [sp_["q"], sp_["k"], sp_["k"]],
      out_specs=(sp_["q"], sp_["stat"], sp_["stat"]),
      scratch_shapes=_scratch(((bq, 1), (bq, 1), (bq, d))),
      compiler_params=_compiler_params(interpret, ("parallel",) * 3 + ("arbitrary",)),
      interpret=interpret,
      name="attention_fwd",
  )(*ids, qh, kh, vh)
  # The statistics leave as [B, H, Tp]: a TPU pads the minor dim of a [.., Tp, 1] array to 128
  # lanes, which as a saved residual would cost 128x its size in HBM until the backward pass.
  return o[:, :, :t].transpose(0, 2, 1, 3), m[..., 0], l[..., 0]


def _default_interpret(args):
  backend = platform.current()
  if backend == "tpu":
    return False
  if backend == "cpu":
    return default_interpret(*args)
  raise ValueError(f"attention implementation 'pallas_tpu' compiles for TPU only (backend is "
                   f"{backend!r}): use 'cudnn' or 'xla' there, or pass interpret=True to run the "
                   "kernels in Pallas' interpreter")


def _scratch(shapes):
  from jax.experimental.pallas import tpu as pltpu
  return [pltpu.VMEM(shape, jnp.float32) for shape in shapes]


def _backward(q, k, v, ids, out, m, l, do, scale, bq, bk, interpret):
  """Cotangents of q, k, v in their dtypes."""
  qh, kh, vh, (t, s, bq, bk, tp, sp) = _layout(q, k, v, bq, bk, interpret)
  b, h, _, d = qh.shape
  hkv = kh.shape[1]
  g = h // hkv
  # Padding queries get a zero cotangent, so they add nothing to dk, dv.
  doh = _pad_axis(do.astype(qh.dtype).transpose(0, 2, 1, 3), 2, tp, 0)
  # sum_s p_s dp_s = sum_d out_d do_d, the softmax backward's row sum, once per query.
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = _pad_axis(delta.transpose(0, 2, 1), 2, tp, 0)[..., None]
  ids = _token_ids(*ids, tp, sp)
  axes = common.varying_axes(qh, kh, vh, doh, m, *ids)
  kernel_args = (*ids, qh, kh, vh, doh, m[..., None], l[..., None], delta)

  sp_ = _specs(bq, bk, d, g, for_keys=False)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, s_len=s),
      out_shape=common.out_struct(qh.shape, q.dtype, axes),
      grid=(b, h, tp // bq, sp // bk),
      in_specs=sp_["ids"] + [sp_["q"], sp_["k"], sp_["k"], sp_["q"]] + [sp_["stat"]] * 3,
      out_specs=sp_["q"],
      scratch_shapes=_scratch(((bq, d),)),
      compiler_params=_compiler_params(interpret, ("parallel",) * 3 + ("arbitrary",)),
      interpret=interpret,
      name="attention_dq",
  )(*kernel_args)

  sp_ = _specs(bq, bk, d, g, for_keys=True)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, s_len=s),
      out_shape=(common.out_struct(kh.shape, k.dtype, axes),
                 common.out_struct(vh.shape, v.dtype, axes)),
      grid=(b, hkv, sp // bk, g, tp // bq),
      in_specs=sp_["ids"] + [sp_["q"], sp_["k"], sp_["k"], sp_["q"]] + [sp_["stat"]] * 3,
      out_specs=(sp_["k"], sp_["k"]),
      scratch_shapes=_scratch(((bk, d), (bk, d))),
      compiler_params=_compiler_params(interpret, ("parallel",) * 3 + ("arbitrary",) * 2),
      interpret=interpret,
      name="attention_dkv",
  )(*kernel_args)
  back = lambda x, n: x[:, :, :n].transpose(0, 2, 1, 3)
  return back(dq, t), back(dk, s), back(dv, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _core(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, scale, bq, bk,
          interpret):
  ids = (q_segment, q_position, kv_segment, kv_position, kv_shared)
  return _forward(q, k, v, ids, scale, bq, bk, interpret)[0]


def _core_fwd(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared, scale, bq, bk,
              interpret):
  ids = (q_segment, q_position, kv_segment, kv_position, kv_shared)
  out, m, l = _forward(q, k, v, ids, scale, bq, bk, interpret)
  return out, (q, k, v, ids, out, m, l)


def _core_bwd(scale, bq, bk, interpret, res, do):
  q, k, v, ids, out, m, l = res
  dq, dk, dv = _backward(q, k, v, ids, out, m, l, do, scale, bq, bk, interpret)
  return dq, dk, dv, None, None, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


def attention(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared=None, *,
              scale: float, block_k: int | None = None, block_q: int | None = None,
              interpret=None):
  """Flash attention, `out [B, T, H, Dh]` in q's dtype; the same function as
  `reference.attention` (same arguments) up to float rounding.

  `block_q`, `block_k`: query and key block widths (None: `DEFAULT_BLOCK_Q`,
  `DEFAULT_BLOCK_K`; given `block_k` alone sets both, as `api.attention` passes one width);
  multiples of 128 when compiled (`ValueError` otherwise; any width interpreted). A sequence
  shorter than its block is one block, padded to the next multiple of 128 (8 interpreted).
  `interpret`: True (or a `pltpu.InterpretParams`) runs the kernels in Pallas' interpreter;
  None compiles on TPU, interprets on CPU (`pallas_common.default_interpret`) and raises
  `ValueError` on GPU; False compiles for TPU (also what lowering for a TPU from another
  machine needs).
  Differentiable w.r.t. q, k, v (Pallas backward kernels).
  """
  if block_q is None:
    block_q = DEFAULT_BLOCK_Q if block_k is None else block_k
  block_k = DEFAULT_BLOCK_K if block_k is None else block_k
  if kv_shared is None:
    kv_shared = jnp.zeros(kv_segment.shape, bool)
  args = common.vary_all(q, k, v, q_segment.astype(jnp.int32), q_position.astype(jnp.int32),
                         kv_segment.astype(jnp.int32), kv_position.astype(jnp.int32),
                         kv_shared.astype(jnp.int32))
  if interpret is None:
    interpret = _default_interpret(args)
  return _core(*args, float(scale), int(block_q), int(block_k), interpret)
