"""Masked attention over packed rows: `xla` (blockwise), `pallas_tpu` (flash kernels, in Pallas'
interpreter here) and `cudnn` (through `jax.nn.dot_product_attention`'s XLA path off a GPU)
against the dense `reference`, the reference against NumPy and against
`jaxrl.models.layers.attention`, the group layout against `Transformer.grouped_forward`'s mask,
fully masked rows, the blockwise memory bound, and the Pallas kernels lowered for a TPU.

Errors are normwise, `max|a - b| / max|b|`: elementwise relative error is meaningless where a
gradient entry is ~0. Sequence lengths are not multiples of the key block on purpose.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.kernels.attention import IMPLEMENTATIONS, attention, cudnn, default_impl, pallas_tpu
from jaxrl.kernels.attention import reference
from jaxrl.models import layers
from jaxrl.models.logprobs import continuation_positions, left_positions

BLOCK = 8


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _packed(lengths, total):
  """Segment ids and positions `[total]` of sequences of `lengths` packed left to right, then
  right padding (-1)."""
  seg, pos = [], []
  for i, n in enumerate(lengths):
    seg += [i] * n
    pos += list(range(n))
  pad = total - len(seg)
  return np.array(seg + [-1] * pad, np.int32), np.array(pos + [0] * pad, np.int32)


def group_layout(prompt_valid, valid):
  """Segments, positions and shared flags `[N, Lp + G T]` of `grouped_forward`'s packed rows:
  a left-padded prompt (segment 0, shared) then G continuations (segments 1..G), padding -1.
  `prompt_valid [N, Lp]`, `valid [N G, T]` bool."""
  n = prompt_valid.shape[0]
  b, t = valid.shape
  group = b // n
  cont_seg = np.where(valid, np.tile(np.arange(1, group + 1), n)[:, None], -1)
  seg = np.concatenate([np.where(prompt_valid, 0, -1), cont_seg.reshape(n, group * t)], axis=1)
  pos = np.concatenate([np.asarray(left_positions(prompt_valid)),
                        np.asarray(continuation_positions(prompt_valid, valid, group))
                        .reshape(n, group * t)], axis=1)
  shared = np.concatenate([prompt_valid, np.zeros((n, group * t), bool)], axis=1)
  return seg.astype(np.int32), pos.astype(np.int32), shared


def _case(name):
  """`(t, s, h, kh, q_seg, q_pos, kv_seg, kv_pos, kv_shared)` of a named layout."""
  if name == "packed":  # three sequences of different lengths, right padding; H = 2 Hkv
    rows = [_packed([13, 5, 16], 37), _packed([30], 37)]
    seg, pos = (np.stack(x) for x in zip(*rows))
    return 37, 37, 4, 2, seg, pos, seg, pos, None
  if name == "left_padding":  # left-padded rows (as the sampler's prompts are); H = Hkv
    valid = np.arange(21)[None, :] >= np.array([[6], [0], [20]])
    seg = np.where(valid, 0, -1).astype(np.int32)
    pos = np.asarray(left_positions(jnp.asarray(valid))).astype(np.int32)
    return 21, 21, 2, 2, seg, pos, seg, pos, None
  if name == "group":  # a 7-token prompt (2 padding) and 3 right-padded continuations of 6
    prompt_valid = np.array([[False, False] + [True] * 5, [True] * 7])
    valid = np.arange(6)[None, :] < np.array([[6], [3], [0], [4], [6], [1]])
    seg, pos, shared = group_layout(prompt_valid, valid)
    return 25, 25, 4, 2, seg, pos, seg, pos, shared
  if name == "cross":  # queries are the last 13 keys' tokens (T < S), H = 4 Hkv
    seg, pos = (np.stack(x) for x in zip(_packed([9, 20], 29), _packed([29], 29)))
    return 13, 29, 4, 1, seg[:, -13:], pos[:, -13:], seg, pos, None
  raise KeyError(name)


CASES = ("packed", "left_padding", "group", "cross")


def make_inputs(name, dtype=jnp.float32, d=16, seed=0):
  t, s, h, kh, *mask = _case(name)
  b = mask[0].shape[0]
  k = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k[0], (b, t, h, d)).astype(dtype)
  kk = jax.random.normal(k[1], (b, s, kh, d)).astype(dtype)
  v = jax.random.normal(k[2], (b, s, kh, d)).astype(dtype)
  w = jax.random.normal(k[3], (b, t, h, d))  # a random output cotangent
  mask = [None if x is None else jnp.asarray(x) for x in mask]
  return (q, kk, v), mask, w


def _attend(implementation):
  """`api.attention` with this implementation; `cudnn` off a GPU runs its own mask and
  fully-masked-row handling through `jax.nn.dot_product_attention`'s XLA path."""
  if implementation == "cudnn" and jax.default_backend() != "gpu":
    return lambda q, k, v, *mask, block_k: cudnn.attention(
        q, k, v, *mask, scale=q.shape[-1] ** -0.5, sdpa_implementation="xla")
  return functools.partial(attention, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("implementation", "block_k"))
def value_and_grads(q, k, v, mask, w, implementation, block_k=BLOCK):
  def loss(q, k, v):
    o = _attend(implementation)(q, k, v, *mask, block_k=block_k)
    return jnp.sum(o.astype(jnp.float32) * w), o
  (_, o), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  return o, grads


@pytest.mark.parametrize("name", CASES)
def test_xla_matches_reference_float32(name):
  qkv, mask, w = make_inputs(name)
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  o, g = value_and_grads(*qkv, mask, w, "xla")
  assert o.dtype == jnp.float32 and o.shape == qkv[0].shape
  assert rel_err(o, o_ref) < 1e-5
  for which, a, b in zip("qkv", g, g_ref):
    assert a.shape == b.shape and rel_err(a, b) < 1e-5, which


@pytest.mark.parametrize("name", ("packed", "group"))
def test_xla_matches_reference_bfloat16(name):
  qkv, mask, w = make_inputs(name, jnp.bfloat16)
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  o, g = value_and_grads(*qkv, mask, w, "xla")
  assert o.dtype == jnp.bfloat16 and all(a.dtype == jnp.bfloat16 for a in g)
  # bf16 has 8 mantissa bits (~4e-3 per rounding); the reference rounds its scores and
  # probabilities to bf16, the blockwise form accumulates them in float32.
  # Measured: at most 1e-2 over the four layouts.
  assert rel_err(o, o_ref) < 2e-2
  for which, a, b in zip("qkv", g, g_ref):
    assert rel_err(a, b) < 2e-2, which


def test_one_block_and_the_default_block_agree():
  qkv, mask, w = make_inputs("packed")
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  for block in (37, None):  # one block exactly; the default (capped at S)
    o, g = value_and_grads(*qkv, mask, w, "xla", block_k=block)
    assert rel_err(o, o_ref) < 1e-5 and max(rel_err(a, b) for a, b in zip(g, g_ref)) < 1e-5


def test_reference_golden_arithmetic():
  # Dh = 1, scale 1, q = 1, keys ln 1, ln 2, ln 3: causal weights 1 : 2 : 3. Values 6, 3, 12:
  # token 0 -> 6; token 1 -> (6 + 2*3) / 3 = 4; token 2 -> (6 + 2*3 + 3*12) / 6 = 8.
  q = jnp.ones((1, 3, 1, 1))
  k = jnp.log(jnp.array([1.0, 2.0, 3.0])).reshape(1, 3, 1, 1)
  v = jnp.array([6.0, 3.0, 12.0]).reshape(1, 3, 1, 1)
  seg, pos = jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None]
  o = attention(q, k, v, seg, pos, seg, pos, scale=1.0, implementation="reference")
  np.testing.assert_allclose(np.asarray(o).ravel(), [6.0, 4.0, 8.0], rtol=1e-6)


def numpy_attention(q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_shared, scale):
  """The rule written out as loops: per row, head and query, a softmax over the keys it may
  attend (a fully masked query averages all S values)."""
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  out = np.zeros((b, t, h, d))
  for r in range(b):
    for hd in range(h):
      kvh = hd // (h // kh)
      for i in range(t):
        ok = [q_seg[r, i] >= 0 and kv_seg[r, j] >= 0 and kv_pos[r, j] <= q_pos[r, i] and
              (kv_seg[r, j] == q_seg[r, i] or kv_shared[r, j]) for j in range(s)]
        if not any(ok):
          out[r, i, hd] = v[r, :, kvh].mean(axis=0)
          continue
        z = np.array([scale * q[r, i, hd] @ k[r, j, kvh] if ok[j] else -np.inf
                      for j in range(s)])
        p = np.exp(z - z.max())
        out[r, i, hd] = (p / p.sum()) @ v[r, :, kvh]
  return out


def test_reference_matches_numpy_loops():
  (q, k, v), (qs, qp, ks, kp, sh), _ = make_inputs("group", d=4)
  o = jax.jit(functools.partial(attention, scale=0.5, implementation="reference"))(
      q, k, v, qs, qp, ks, kp, sh)
  want = numpy_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), *map(np.asarray,
                         (qs, qp, ks, kp, sh)), 0.5)
  assert rel_err(o, want) < 1e-6


def test_reference_matches_the_model_attention():
  assert reference.MASK_VALUE == layers.MASK_VALUE
  (q, k, v), mask, _ = make_inputs("packed")
  dense = reference.token_mask(*mask)[:, None, None]  # [B, 1, 1, T, S]
  b, t, h, d = q.shape
  kh = k.shape[2]
  o_model = layers.attention(q.reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4),
                             k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), dense, d ** -0.5)
  o = attention(q, k, v, *mask, implementation="reference")
  assert rel_err(o, o_model.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)) < 1e-6


def test_group_layout_is_grouped_forwards_mask():
  # `Transformer.grouped_forward`'s masks (its formulas), at every real query.
  prompt_valid = np.array([[False, False, True, True, True]])
  valid = np.array([[True] * 4, [True, True, False, False], [True] * 3 + [False]])
  seg, pos, shared = group_layout(prompt_valid, valid)
  mask = np.asarray(reference.token_mask(*map(jnp.asarray, (seg, pos, seg, pos, shared))))[0]
  lp, t = 5, 4
  want = np.zeros((lp + 3 * t,) * 2, bool)
  want[:lp, :lp] = np.tril(np.ones((lp, lp), bool)) & prompt_valid[0][None, :]
  for g in range(3):
    rows = slice(lp + g * t, lp + (g + 1) * t)
    want[rows, :lp] = prompt_valid[0][None, :]
    want[rows, rows] = np.tril(np.ones((t, t), bool)) & valid[g][None, :]
  real = seg[0] >= 0
  np.testing.assert_array_equal(mask[real], want[real])
  assert not mask[~real].any()  # padding queries attend nothing


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_fully_masked_row_averages_all_values(implementation):
  # Row 0's query 3 is left padding; query 5 (segment 0, position 0) sees only keys of later
  # positions. Both get the mean of all S values, no q gradient, and with a zero cotangent
  # on them (as a masked loss gives) nothing reaches k or v from them.
  s = 9
  kv_seg = jnp.array([[-1, -1, 0, 0, 0, 0, 0, 0, 0]])
  kv_pos = jnp.array([[0, 0, 1, 2, 3, 4, 5, 6, 7]])
  q_seg, q_pos = jnp.array([[0, 0, 0, -1, 0, 0]]), jnp.array([[1, 2, 7, 0, 3, 0]])
  k = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(k[0], (1, 6, 2, 4))
  kk, v = (jax.random.normal(x, (1, s, 1, 4)) for x in k[1:])
  mask = (q_seg, q_pos, kv_seg, kv_pos, None)
  w = jnp.ones((1, 6, 2, 4)).at[:, (3, 5)].set(0.0)
  o, (dq, dk, dv) = value_and_grads(q, kk, v, mask, w, implementation, block_k=4)
  mean = jnp.broadcast_to(jnp.mean(v[0, :, 0], axis=0), (2, 4))
  for i in (3, 5):
    np.testing.assert_allclose(o[0, i], mean, rtol=1e-6, atol=1e-6)
    assert not np.any(dq[0, i])
  w_row = jnp.zeros_like(w).at[:, (3, 5)].set(1.0)  # the cotangent on the masked rows only
  _, (dq, dk, dv) = value_and_grads(q, kk, v, mask, w_row, implementation, block_k=4)
  assert not np.any(dq) and not np.any(dk)
  np.testing.assert_allclose(dv[0, :, 0], np.full((s, 4), 2 * 2 / s), rtol=1e-6)  # 2 rows x 2 heads


def test_under_shard_map_over_rows(devices):
  qkv, mask, w = make_inputs("group")
  mesh = Mesh(np.array(devices[:2]), ("data",))
  spec = P("data")

  @jax.jit
  def sharded(q, k, v, mask, w):
    f = lambda q, k, v, mask, w: value_and_grads(q, k, v, mask, w, "xla")
    return jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(q, k, v, mask, w)

  o, g = sharded(*qkv, mask, w)
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  assert rel_err(o, o_ref) < 1e-5 and max(rel_err(a, b) for a, b in zip(g, g_ref)) < 1e-5


def _temp_bytes(implementation, s, block_k=128):
  """Compiled temp memory of value+grad on one single-segment row of S tokens (T = S)."""
  q = jax.ShapeDtypeStruct((1, s, 4, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, s, 2, 32), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, s), jnp.int32)

  def loss(q, k, v, seg, pos):
    o = attention(q, k, v, seg, pos, seg, pos, implementation=implementation, block_k=block_k)
    return jnp.sum(o * o)

  compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, ids, ids).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_the_sequence():
  # Measured (CPU, jax 0.10.2; B=1, H=4, Hkv=2, Dh=32, block 128), temp bytes at S = 512 / 1024
  # / 2048: xla 4.78 / 9.53 / 19.0 MB (x1.99 per doubling); reference 17.0 / 67.7 / 270 MB (x3.97).
  small, large = _temp_bytes("xla", 512), _temp_bytes("xla", 1024)
  assert large / small <= 2.3, (small, large)


def test_api():
  assert default_impl() == "xla"
  assert IMPLEMENTATIONS == ("reference", "xla", "pallas_tpu", "cudnn")
  (q, k, v), mask, _ = make_inputs("packed")
  with pytest.raises(ValueError, match="unknown attention implementation"):
    attention(q, k, v, *mask, implementation="pallas")
  with pytest.raises(ValueError, match="q_segment"):
    attention(q, k, v, mask[0][:, :3], *mask[1:])
  with pytest.raises(ValueError, match="multiple"):
    attention(q[:, :, :3], k, v, *mask)


@pytest.mark.parametrize("implementation", ("pallas_tpu", "cudnn"))
@pytest.mark.parametrize("name", CASES)
def test_kernels_match_reference_float32(implementation, name):
  # pallas_tpu with 8-wide blocks: T and S (21 to 37) span several query and key blocks, the
  # last of each padded.
  qkv, mask, w = make_inputs(name)
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  o, g = value_and_grads(*qkv, mask, w, implementation)
  assert o.dtype == jnp.float32 and o.shape == qkv[0].shape
  assert rel_err(o, o_ref) < 1e-5
  for which, a, b in zip("qkv", g, g_ref):
    assert a.shape == b.shape and rel_err(a, b) < 1e-5, which


def test_pallas_tpu_bfloat16():
  qkv, mask, w = make_inputs("group", jnp.bfloat16)
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  o, g = value_and_grads(*qkv, mask, w, "pallas_tpu")
  assert o.dtype == jnp.bfloat16 and all(a.dtype == jnp.bfloat16 for a in g)
  # As for `xla` (test_xla_matches_reference_bfloat16): the reference rounds scores and
  # probabilities to bf16, the kernels accumulate in float32.
  assert rel_err(o, o_ref) < 2e-2
  for which, a, b in zip("qkv", g, g_ref):
    assert rel_err(a, b) < 2e-2, which


@pytest.mark.parametrize("block_q, block_k", ((None, None), (16, 8), (8, 40)))
def test_pallas_tpu_block_shapes(block_q, block_k):
  # One block each way (the defaults cap at the sequence), more query than key blocks, and one
  # key block wider than S = 37 (padded to 40) against 5 query blocks.
  qkv, mask, w = make_inputs("packed")
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")

  @jax.jit
  def run(q, k, v):
    def loss(q, k, v):
      o = pallas_tpu.attention(q, k, v, *mask, scale=q.shape[-1] ** -0.5, block_q=block_q,
                               block_k=block_k)
      return jnp.sum(o * w), o
    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

  (_, o), g = run(*qkv)
  assert rel_err(o, o_ref) < 1e-5 and max(rel_err(a, b) for a, b in zip(g, g_ref)) < 1e-5


def test_pallas_tpu_lowers_for_tpu():
  # Lowering (not compiling) for a TPU runs on any machine: Pallas turns each kernel into Mosaic
  # and wraps it in a `tpu_custom_call`; a primitive without a Mosaic rule, or a block shape
  # Mosaic refuses, fails here. Qwen2.5-0.5B-like heads (H = 14, Hkv = 2, Dh = 64) in bf16 over
  # a 1,000-token row (4 blocks of 256, the last padded), value and gradient.
  b, t, h, kh, d = 2, 1000, 14, 2, 64
  struct = jax.ShapeDtypeStruct
  args = [struct((b, t, h, d), jnp.bfloat16), struct((b, t, kh, d), jnp.bfloat16),
          struct((b, t, kh, d), jnp.bfloat16)] + [struct((b, t), jnp.int32)] * 4 + \
         [struct((b, t), bool)]

  def out(q, k, v, *mask):
    return pallas_tpu.attention(q, k, v, *mask, scale=d ** -0.5, interpret=False)

  def loss(q, k, v, *mask):
    return jnp.sum(out(q, k, v, *mask).astype(jnp.float32))

  lowered = lambda f: jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
  forward, grad = lowered(out), lowered(jax.value_and_grad(loss, (0, 1, 2)))
  assert forward.count("stablehlo.custom_call @tpu_custom_call") == 1
  assert grad.count("stablehlo.custom_call @tpu_custom_call") == 3  # forward, dq, dk + dv
  for name in ("attention_fwd", "attention_dq", "attention_dkv"):
    assert name in grad, name


def test_pallas_tpu_compiled_blocks_are_multiples_of_128():
  # Lowering a short row (T = S = 32: one block, padded to 128) in float32 works; an 8-wide
  # block, fine for the interpreter, is refused before Mosaic sees it.
  qkv, mask, _ = make_inputs("packed")
  qkv = [x[:, :32] for x in qkv]
  mask = [x[:, :32] for x in mask[:4]] + [None]
  f = lambda block: jax.export.export(jax.jit(functools.partial(
      pallas_tpu.attention, scale=0.25, block_k=block, interpret=False)), platforms=["tpu"])
  assert "@tpu_custom_call" in f(None)(*qkv, *mask).mlir_module()
  with pytest.raises(ValueError, match="multiples of 128 when compiled"):
    f(8)(*qkv, *mask)


@pytest.mark.slow
def test_pallas_tpu_under_shard_map_over_rows(devices):
  qkv, mask, w = make_inputs("group")
  mesh = Mesh(np.array(devices[:2]), ("data",))
  spec = P("data")

  @jax.jit
  def sharded(q, k, v, mask, w):
    f = lambda q, k, v, mask, w: value_and_grads(q, k, v, mask, w, "pallas_tpu")
    return jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(q, k, v, mask, w)

  o, g = sharded(*qkv, mask, w)
  o_ref, g_ref = value_and_grads(*qkv, mask, w, "reference")
  assert rel_err(o, o_ref) < 1e-5 and max(rel_err(a, b) for a, b in zip(g, g_ref)) < 1e-5


def test_cudnn_off_a_gpu_raises():
  if jax.default_backend() == "gpu":
    pytest.skip("the backend has a GPU")
  (q, k, v), mask, _ = make_inputs("packed", jnp.bfloat16)
  with pytest.raises(ValueError, match="'cudnn' needs a CUDA GPU; the backend is"):
    attention(q, k, v, *mask, implementation="cudnn")


def _two_groups_in_a_row():
  """`(seg, pos, shared)` `[2, 21]`: row 0 packs group A (a 3-token prompt, continuations of 3
  and 2) and group B (a 4-token prompt, continuations of 2 and 4) as units 0 and 1
  (`u << UNIT_SHIFT | member`), then right padding; row 1 holds group B alone."""
  def group(unit, prompt, conts):
    base = unit << reference.UNIT_SHIFT
    seg = [base] * prompt + sum(([base | (g + 1)] * n for g, n in enumerate(conts)), [])
    pos = list(range(prompt)) + sum((list(range(prompt, prompt + n)) for n in conts), [])
    return seg, pos, [True] * prompt + [False] * sum(conts)

  rows = []
  for groups in ((group(0, 3, (3, 2)), group(1, 4, (2, 4))), (group(1, 4, (2, 4)),)):
    seg, pos, shared = (sum(parts, []) for parts in zip(*groups))
    pad = 21 - len(seg)
    rows.append((seg + [-1] * pad, pos + [0] * pad, shared + [False] * pad))
  seg, pos, shared = (np.array(x) for x in zip(*rows))
  return seg.astype(np.int32), pos.astype(np.int32), shared


@pytest.mark.parametrize("implementation", ("xla", "pallas_tpu", "cudnn"))
def test_several_groups_in_one_row(implementation):
  seg, pos, shared = _two_groups_in_a_row()
  mask = reference.token_mask(*map(jnp.asarray, (seg, pos, seg, pos, shared)))
  # Group B's continuations (row 0, tokens 12..17) see B's prompt (8..11), not A's (0..2).
  assert mask[0, 12:18, 8:12].all() and not mask[0, 12:18, :3].any()
  assert mask[0, 3:8, :3].all()  # A's continuations see A's prompt
  k = jax.random.split(jax.random.key(2), 4)
  qkv = (jax.random.normal(k[0], (2, 21, 4, 16)), jax.random.normal(k[1], (2, 21, 2, 16)),
         jax.random.normal(k[2], (2, 21, 2, 16)))
  w = jax.random.normal(k[3], (2, 21, 4, 16))
  ids = [jnp.asarray(x) for x in (seg, pos, seg, pos, shared)]
  o_ref, g_ref = value_and_grads(*qkv, ids, w, "reference")
  o, g = value_and_grads(*qkv, ids, w, implementation)
  assert rel_err(o, o_ref) < 1e-5 and max(rel_err(a, b) for a, b in zip(g, g_ref)) < 1e-5
