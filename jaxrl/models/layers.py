"""The model's building blocks, as pure functions of arrays: RMSNorm, rotary embeddings,
token embedding, attention (many-query with its own CPU gradient rule, and single-token decode),
weight products (row-flattened, streamed from a stacked weight) and the LoRA-adapted projection.

`Transformer` (`jaxrl.models.transformer`) composes them into the decoder; each keeps the exact
operations and dtypes the model was measured and tested with.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.core import platform
from jaxrl.kernels.attention import attention as kernel_attention
from jaxrl.models.model_config import ROPE_SCALINGS, ModelConfig

# Large finite negative instead of -inf: a fully masked row (a left-pad query) then softmaxes to
# a harmless uniform row instead of NaN.
MASK_VALUE = -1e30


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis in float32, scaled by `w`, back in x's dtype."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_positions: int = 8192) -> jax.Array:
  """float32 [head_dim / 2] inverse frequencies (radians per position) of the rotary pairs.

  Unscaled: `theta^(-2i/d)`. Scaling stretches a checkpoint's context by slowing the rotation:
  "linear" divides every frequency by `factor` (position interpolation). "llama3" divides only
  the frequencies whose wavelength `2*pi/f` exceeds `original_max_positions / low_freq_factor`
  (they never completed a turn in pre-training, so they must be interpolated), keeps those
  shorter than `original_max_positions / high_freq_factor` (they turned many times and carry
  local order), and blends the two linearly in `original_max_positions / wavelength` between.
  Neither type rescales cos/sin afterwards (HF's `attention_factor` is 1 for both).

  All in float32 with HF's order of operations: the frequencies agree with transformers' to one
  float32 ulp (computing in float64 and rounding once is no closer to them).
  """
  # The unscaled expression is kept exactly as it always was: default models stay bit-identical.
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling == "none":
    return inv_freq
  if scaling == "linear":
    return inv_freq / factor
  if scaling != "llama3":
    raise ValueError(f"rope scaling={scaling!r} is not one of {ROPE_SCALINGS}")
  wavelen = 2 * math.pi / inv_freq
  smooth = (original_max_positions / wavelen - low_freq_factor) / (
      high_freq_factor - low_freq_factor)
  blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  low_band = wavelen > original_max_positions / low_freq_factor
  high_band = wavelen < original_max_positions / high_freq_factor
  return jnp.where(low_band, inv_freq / factor, jnp.where(high_band, inv_freq, blended))


def config_inv_freq(cfg: ModelConfig) -> jax.Array:
  """`rope_inv_freq` for a model config."""
  return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor,
                       cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                       cfg.rope_original_max_positions)


# Vocabularies up to this size embed tokens as a one-hot matmul instead of a gather: the
# gather's gradient is a scatter-add, which XLA's CPU backend (with its LLVM IR fusion emitters,
# `xla_cpu_fusion_emitters=False`) runs one token at a time (~1 us each); the matmul costs
# 2 V D FLOPs per token, small next to a layer's at this size.
ONE_HOT_EMBED_MAX_VOCAB = 256


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """`table[tokens]` (`table` `[V, D]`, `tokens` int `[...]`): a one-hot matmul for
  `V <= ONE_HOT_EMBED_MAX_VOCAB`, at full precision (it picks rows exactly: x 1 and + 0), else a
  gather. Tokens are in `[0, V)`."""
  if table.shape[0] > ONE_HOT_EMBED_MAX_VOCAB:
    return table[tokens]
  return _one_hot_embed(table, tokens)


_HIGHEST = jax.lax.Precision.HIGHEST


@jax.custom_vjp
def _one_hot_embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
  one_hot = (tokens[..., None] == jnp.arange(table.shape[0], dtype=tokens.dtype))
  return jnp.einsum("...v,vd->...d", one_hot.astype(table.dtype), table, precision=_HIGHEST)


def _one_hot_embed_fwd(table, tokens):
  return _one_hot_embed(table, tokens), (table, tokens)


def _one_hot_embed_bwd(res, g):
  """The table's gradient, the token rows of `g` summed per token, as `one_hot^T @ g` with the
  transposed one-hot built directly ([V, N]): both operands row-major with the contraction
  minor. The autodiff form contracts the one-hot's leading axis, for which XLA's CPU backend
  copied `g` transposed first (~1 ms of issue 22's train step, on its critical path)."""
  table, tokens = res
  flat = tokens.reshape(-1)
  one_hot_t = (jnp.arange(table.shape[0], dtype=flat.dtype)[:, None] == flat[None, :])
  d_table = jnp.matmul(one_hot_t.astype(g.dtype), g.reshape(-1, g.shape[-1]),
                       precision=_HIGHEST).astype(table.dtype)
  return d_table, np.zeros(tokens.shape, jax.dtypes.float0)


_one_hot_embed.defvjp(_one_hot_embed_fwd, _one_hot_embed_bwd)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(cos, sin), each float32 [B, T, 1, Dh], of the rotary angles at `positions` [B, T], laid
  out for `apply_rope`: cos of each angle for both halves, sin negated in the first half."""
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  return (jnp.concatenate([cos, cos], axis=-1)[:, :, None, :],
          jnp.concatenate([-sin, sin], axis=-1)[:, :, None, :])


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, H, Dh] rotated by the tables of `rope_tables`. Non-interleaved halves, as in HF
  Llama/Qwen: (x1 cos - x2 sin, x2 cos + x1 sin), computed as x cos + swap(x) sin with the halves
  of x swapped by a reversal (the same values bit for bit; no concatenation, whose per-element
  choice of operand XLA's CPU loops ran several times slower than the arithmetic, forward and
  backward)."""
  xf = x.astype(jnp.float32)
  swapped = xf.reshape(*xf.shape[:-1], 2, xf.shape[-1] // 2)[..., ::-1, :].reshape(xf.shape)
  return (xf * cos + swapped * sin).astype(x.dtype)


def attention(q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array, scale: float
              ) -> jax.Array:
  """Masked softmax attention over many queries per row: q [B, K, G, T, Dh] (G query heads per
  kv head), keys slot-minor k_t [B, K, Dh, S], values v [B, K, S, Dh], mask broadcastable to
  [B, K, G, T, S] (True: attend). Scores and softmax in float32; returns [B, K, G, T, Dh] in
  q's dtype. A fully masked query row gets a uniform average (see `MASK_VALUE`) and no gradient.

  On CPU it has its own gradient rule (`_cpu_attention`): every product in it contracts the
  minor axis of its left operand (the key and value gradients through explicitly transposed
  copies of q and of the probabilities), the form YNNPACK runs; autodiff's form for those two
  ran as Eigen batched products ~2x slower, and its softmax backward reduced over the keys.
  Measured on issue 22's train step (2 layers, 64 rows x 16 tokens): the attention's forward
  and backward ~25% faster in isolation. Elsewhere autodiff's (the extra transposed copy of the
  probabilities would be a second [T, S] tensor per head on long sequences). The same values
  either way up to float rounding (`tests/test_model.py`)."""
  if platform.current() == "cpu":
    return _cpu_attention(q, k_t, v, mask, scale)
  return _attention_fwd(q, k_t, v, mask, scale)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cpu_attention(q, k_t, v, mask, scale):
  return _attention_fwd(q, k_t, v, mask, scale)[0]


def _attention_fwd(q, k_t, v, mask, scale):
  s = jnp.einsum("bkgtd,bkds->bkgts", q, k_t).astype(jnp.float32) * scale
  p = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1).astype(q.dtype)
  o = jnp.einsum("bkgts,bksd->bkgtd", p, v)
  return o, (q, k_t, v, p, o, mask)


def _attention_bwd(scale, res, do):
  q, k_t, v, p, o, mask = res
  b, k, g, t, d = q.shape
  n = k_t.shape[-1]
  f32 = jnp.float32
  dp = jnp.einsum("bkgtd,bksd->bkgts", do, v).astype(f32)
  # sum_s p_s dp_s = sum_d o_d do_d: the softmax backward's row sum over Dh instead of the keys.
  delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1, keepdims=True)
  ds = (jnp.where(mask, p.astype(f32) * (dp - delta), 0.0) * scale).astype(q.dtype)
  dq = jnp.einsum("bkgts,bkds->bkgtd", ds, k_t)
  # Materialised transposes (the barrier keeps XLA from folding them back into the products).
  q_t = jax.lax.optimization_barrier(q.reshape(b, k, g * t, d).swapaxes(-1, -2))
  p_t = jax.lax.optimization_barrier(p.reshape(b, k, g * t, n).swapaxes(-1, -2))
  dk_t = jnp.einsum("bkdx,bkxs->bkds", q_t, ds.reshape(b, k, g * t, n))
  dv = jnp.einsum("bksx,bkxd->bksd", p_t, do.reshape(b, k, g * t, d))
  return dq, dk_t, dv, None


_cpu_attention.defvjp(_attention_fwd, _attention_bwd)


def matmul_rows(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [B, T, Din] times a weight whose leading axis is Din: [B, T, Dout], as one 2-D
  product over the B T rows. (A 3-D operand makes the weight gradient contract over two
  axes, which XLA's CPU backend lays out with a transposed copy of the output gradient;
  2-D, issue 22's whole train step ran ~15% faster.)"""
  w = w.reshape(x.shape[-1], -1)
  return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def decode_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     dtype) -> jax.Array:
  """Attention of one query per row over a whole cache: q [B, K, G, Dh], keys slot-minor k_t
  [B, K, Dh, S], values v [B, K, S, Dh], mask broadcastable to [B, K, G, 1, S]. Scores and
  softmax in float32; returns [B, K, G, Dh] in `dtype` (values of another dtype, e.g. an 8-bit
  cache, are upcast to it for the product).

  Single-token decode reads the whole cache once per layer and is bound by that traffic;
  with slot-minor keys both products stream contiguous rows (measured 1.3x the whole
  default decode over [B, K, S, Dh] keys with a multiply-and-reduce)."""
  qd = q.astype(jnp.float32)  # [B, K, G, Dh]
  s = jnp.einsum("bkgd,bkds->bkgs", qd, k_t.astype(jnp.float32))[:, :, :, None] * scale
  s = jnp.where(mask, s, MASK_VALUE)
  w = jax.nn.softmax(s, axis=-1).astype(dtype)
  return jnp.einsum("bkgs,bksd->bkgd", w[:, :, :, 0], v.astype(dtype)).astype(dtype)


# `model.attention` names whose `jaxrl.kernels.attention` implementation is named otherwise.
KERNEL_OF = {"dense": "reference"}


def kernel_attend(seg: jax.Array, pos: jax.Array, shared: jax.Array | None,
                  implementation: str = "xla") -> Callable:
  """`attend(q, k, v)` over a `jaxrl.kernels.attention` implementation (default "xla":
  blockwise, memory linear in the sequence), with each token's segment and position [B, T]
  (keys are the queries' own tokens) and the shared flags of a group's prompt (or None)."""
  return lambda q, k, v: kernel_attention(q, k, v, seg, pos, seg, pos, shared,
                                          implementation=implementation)


# The projections behind each weight name of a layer (fused ones: their parts in order), and
# the LoRA target adapting each.
_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
_LORA_TARGET = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w_gate": "gate", "w_up": "up",
                "w_down": "down"}


_DROPOUT_SALT = {n: i for i, n in enumerate((*_PROJECTIONS, *_LORA_TARGET))}


def lora_dims(cfg: ModelConfig, target: str) -> tuple[int, int]:
  """(din, dout) of the projection LoRA target `target` adapts (heads flattened, as in HF)."""
  D, F = cfg.d_model, cfg.mlp_dim
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"q": (D, q), "k": (D, kv), "v": (D, kv), "o": (q, D), "gate": (D, F), "up": (D, F),
          "down": (F, D)}[target]


def stacked_lora(layers: int, din: int, rank: int, dout: int, rngs: nnx.Rngs) -> nnx.LoRA:
  """`layers` `nnx.LoRA(din, rank, dout)` adapters stacked on a leading axis (`nnx.vmap`): each
  layer's A is initialised on its own key, B at zero, so the adapted model starts equal to the
  base."""
  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(r):
    return nnx.LoRA(din, rank, dout, rngs=r)
  return make(rngs)


def lora_dense(dense, lora: dict, cfg: ModelConfig, dropout: float, key):
  """`dense` plus the layer's adapters: for a weight adapted on target t, `x` times `nnx.LoRA`'s
  `A @ B` (this layer's slices) times `lora_alpha / lora_rank` is added to its output (for a fused
  weight, each adapted part's columns); `dropout` drops the adapter's input (with `key`)."""
  scale = cfg.lora_alpha / cfg.lora_rank

  def adapted(x, name):
    y = dense(x, name)
    parts = _PROJECTIONS.get(name, (name,))
    targets = [_LORA_TARGET.get(n) for n in parts]
    if not any(t in lora for t in targets):
      return y
    xin = x
    if dropout:
      keep = jax.random.bernoulli(jax.random.fold_in(key, _DROPOUT_SALT[name]), 1 - dropout,
                                  x.shape)
      xin = jnp.where(keep, x / (1 - dropout), 0).astype(x.dtype)
    deltas = []
    for t in targets:
      if t in lora:
        a, b = lora[t]
        deltas.append((xin @ a) @ b * scale)
      else:
        deltas.append(jnp.zeros((*x.shape[:-1], lora_dims(cfg, t)[1]), y.dtype))
    return y + jnp.concatenate(deltas, axis=-1).astype(y.dtype)

  return adapted


_STREAM_CHUNK_BYTES = 2 << 20


def streams_weights(length: int) -> bool:
  """Whether a scanned forward of `length` new tokens per row with a KV cache multiplies by its
  stacked weights through `streamed_matmul`: one-token decode steps on CPU.

  Decode is bound by reading the weights. A matmul on a layer's slice of a stacked weight makes
  XLA's CPU backend copy the whole slice to fresh memory first; streaming each weight in column
  chunks small enough that the copy stays in cache for the matmul measured 2x the weight-read
  rate of slice-then-matmul for batch-4 0.5B shapes on CPU. Not on accelerators: there each
  chunk is a kernel launch of its own, and the slice copy runs at HBM bandwidth."""
  return length == 1 and platform.current() == "cpu"


def streamed_matmul(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
  """x [B, T, Din] @ w[layer] for stacked w [L, Din, Dout], reading w[layer] in column chunks
  of about `_STREAM_CHUNK_BYTES` (each chunk's dot is the same as in one big matmul)."""
  _, din, dout = w.shape
  n = max(1, -(-din * dout * w.dtype.itemsize // _STREAM_CHUNK_BYTES))
  c = -(-dout // n)
  n = -(-dout // c)
  if n == 1:
    return jnp.tensordot(x, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), 1)

  def chunk(j, y):
    # The last chunk starts early instead of running past the end; the overlap is rewritten
    # with the same values.
    at = jnp.minimum(j * c, dout - c)
    blk = jax.lax.dynamic_slice(w, (layer, 0, at), (1, din, c))[0]
    return jax.lax.dynamic_update_slice(y, jnp.tensordot(x, blk, 1).astype(y.dtype), (0, 0, at))

  y = jnp.zeros((*x.shape[:-1], dout), jnp.result_type(x, w))
  return jax.lax.fori_loop(0, n, chunk, y)


def attention_mask(valid: jax.Array, cache, cache_index: jax.Array | int
                    ) -> tuple[jax.Array, jax.Array]:
  """(key_valid [B, S], mask [B, 1, 1, T, S]) of tokens `valid` [B, T] written from slot
  `cache_index` of `cache` (no cache: S = T, the tokens alone). A token attends to the valid
  slots up to its own."""
  T = valid.shape[1]
  if cache is None:
    key_valid = valid  # [B, S=T]
    q_slot = jnp.arange(T)
    S = T
  else:
    key_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, cache_index))
    q_slot = cache_index + jnp.arange(T)
    S = cache.valid.shape[1]
  causal = jnp.arange(S)[None, :] <= q_slot[:, None]  # [T, S]
  mask = causal[None, None, None] & key_valid[:, None, None, None, :]  # [B, 1, 1, T, S]
  return key_valid, mask


def write_cache(buf: jax.Array, new: jax.Array, at: tuple) -> jax.Array:
  """`buf` with `new` (cast to buf's dtype) written at offsets `at`. Into an 8-bit float cache
  (`ModelConfig.kv_cache_dtype`) values are clipped to its finite range first: float8_e4m3fn has
  no infinity, and an out-of-range cast would store NaN."""
  if jnp.issubdtype(buf.dtype, jnp.floating) and jnp.dtype(buf.dtype).itemsize == 1:
    top = float(jnp.finfo(buf.dtype).max)
    new = jnp.clip(new, -top, top)
  return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), at)


def project_qkv(run, h, p, dense):
  """A layer's queries [B, T, H, Dh] and keys and values [B, T, K, Dh] of the residual stream
  `h`: projected, biased, normed and rotated as the config says."""
  cfg = run.cfg
  heads = lambda x: x.reshape(run.rows, run.length, -1, cfg.head_dim)
  a = rms_norm(h, p["attn_norm"], cfg.rms_eps)
  if "wqkv" in p:
    qkv = heads(dense(a, "wqkv"))
    q, k, v = jnp.split(qkv, [cfg.num_heads, cfg.num_heads + cfg.num_kv_heads], axis=2)
  else:
    q, k, v = (heads(dense(a, n)) for n in ("wq", "wk", "wv"))
  if cfg.qkv_bias:
    q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_eps)
  q = apply_rope(q, run.cos, run.sin)
  k = apply_rope(k, run.cos, run.sin)
  return q, k, v
