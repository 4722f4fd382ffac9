"""Decoder-only language model of the Llama / Qwen2 / Qwen3 family, in Flax NNX.

RMSNorm, rotary position embeddings (HF "rotate half" layout, optionally with "linear" or
Llama-3 frequency scaling), grouped-query attention, SwiGLU MLP, optional q/k/v bias (Qwen2),
optional per-head q/k RMSNorm (Qwen3), optional tied embeddings, separate parameter and compute
dtypes.

Layer weights are stacked on a leading `[num_layers]` axis and the forward pass is a `lax.scan`
over layers, so compile time does not grow with depth and the KV cache is one array per K and V.

Positions are explicit per token, so left-padded prompts get positions 0.. from their first real
token; attention masks come from a per-slot validity mask plus causality by slot. The same code
serves three callers: the trainer (no cache, whole sequence; or `grouped_forward`, a group's
prompt once with its G completions packed into one row), prefill (writes slots `[0, T)` of a
fresh cache) and decode (writes one slot per step). Attention over many queries (`attention`)
has its own gradient rule; single-token decode has its own form.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.core import names
from jaxrl.parallel.sharding import constrain_kv_cache, constrain_rows

# Large finite negative instead of -inf: a fully masked row (a left-pad query) then softmaxes to
# a harmless uniform row instead of NaN.
MASK_VALUE = -1e30

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

ROPE_SCALINGS = ("none", "linear", "llama3")

# Rematerialisation of each layer in the backward pass (`ModelConfig.remat`): what a layer saves
# for its gradient. None = save everything (checkpointing off).
REMAT_POLICIES = {
    "none": None,
    # Only the layer's inputs; the whole layer is recomputed in the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Also the outputs of the weight matmuls (q/k/v, out, gate/up, down projections): only the
    # attention core (scores, softmax: the [rows, heads, T, T] tensors) and elementwise ops are
    # recomputed.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
names.check_registry("REMAT_POLICIES", names.REMAT_POLICIES, REMAT_POLICIES)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture; fields are enough to describe real Llama/Qwen checkpoints."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  # Rotary frequency scaling for long context, as the checkpoint was trained with it (see
  # `rope_inv_freq`): "none", "linear" (every frequency divided by `rope_factor`) or "llama3"
  # (Llama 3.1+: low frequencies divided by `rope_factor`, high ones kept, a smooth ramp between,
  # with band edges at `rope_original_max_positions / rope_{low,high}_freq_factor` positions).
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  rms_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  init_std: float = 0.02
  # lax.scan over layers keeps compile time flat in depth; unrolling is faster for shallow
  # models on CPU, where XLA splits the scan's backward into one loop per weight.
  scan_layers: bool = True
  # Rematerialisation in training (`REMAT_POLICIES`): "none", "full" or "dots". Without it the
  # backward pass keeps every layer's f32 attention scores and probabilities [rows, heads, T, T];
  # with it each layer keeps its input (and for "dots" its matmul outputs) and recomputes the
  # rest. Same values either way; only forward passes without a KV cache (training, scoring) use
  # it.
  remat: str = "none"
  # LoRA (`jaxrl.models.lora`): rank 0 = none. With a rank, every layer gets an `nnx.LoRA`
  # adapter (A [din, rank], B [rank, dout], `nnx.LoRAParam`) on each of `lora_targets`
  # (`names.LORA_TARGETS`), whose product scaled by `lora_alpha / lora_rank` is added to that
  # projection's output; `lora_dropout` drops the adapter's input when a dropout key is given.
  lora_rank: int = 0
  lora_alpha: float = 32.0
  lora_targets: tuple[str, ...] = ()
  lora_dropout: float = 0.0

  def __post_init__(self):
    # Checked here, not at trace time: a typo in `rope_scaling` would otherwise quietly mean
    # "none" somewhere, or fail deep inside jit.
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not one of {tuple(REMAT_POLICIES)}")
    unknown = set(self.lora_targets) - set(names.LORA_TARGETS)
    if unknown or (self.lora_rank and not self.lora_targets):
      raise ValueError(f"lora_targets={self.lora_targets!r}: a non-empty subset of "
                       f"{names.LORA_TARGETS}")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"rope_scaling={self.rope_scaling!r} is not one of {ROPE_SCALINGS}")
    if self.rope_scaling != "none" and not self.rope_factor > 0:
      raise ValueError(f"rope_factor={self.rope_factor!r} must be > 0 with "
                       f"rope_scaling={self.rope_scaling!r}")
    if self.rope_scaling == "llama3" and not (
        0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        and self.rope_original_max_positions > 0):
      raise ValueError(
          "rope_scaling='llama3' needs 0 < rope_low_freq_factor < rope_high_freq_factor and "
          f"rope_original_max_positions > 0; got {self.rope_low_freq_factor}, "
          f"{self.rope_high_freq_factor}, {self.rope_original_max_positions}")

  @classmethod
  def qwen2_5_0_5b(cls, **overrides) -> "ModelConfig":
    """Qwen2.5-0.5B shapes (494M parameters)."""
    kw = dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2,
              head_dim=64, mlp_dim=4864, rope_theta=1000000.0, rms_eps=1e-6, qkv_bias=True,
              tie_embeddings=True)
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_config(cls, model_cfg, vocab_size: int) -> "ModelConfig":
    """From the `model` section of a run config (`vocab_size=0` there means the task's)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in model_cfg.items() if k in fields}
    if not kw.get("vocab_size"):
      kw["vocab_size"] = vocab_size
    return cls(**kw)


class KVCache(NamedTuple):
  """Per-layer keys/values by slot plus which slots hold real tokens."""

  # kv-head-major, keys slot-minor [B, K, Dh, S], values slot-major [B, K, S, Dh]: a
  # single-token query then multiplies [G, Dh] x [Dh, S] and [G, S] x [S, Dh], both over
  # contiguous rows with no transposed operand. Stacked [L, ...] when layers are scanned, a tuple
  # of L arrays when unrolled. On a mesh, rows go over the batch axes and kv heads over 'tensor'
  # (`parallel.sharding.constrain_kv_cache`): the sampler and the engine pin it so for the mesh
  # of their params, the model for the mesh it is traced under (the train step's).
  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  valid: jax.Array  # [B, S] bool

  @staticmethod
  def zeros(cfg: ModelConfig, batch: int, slots: int) -> "KVCache":
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, slots)
    v_shape = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
    dt = DTYPES[cfg.dtype]
    # Separate buffers throughout: the decode loop donates the cache, and XLA refuses to donate
    # one buffer twice.
    if cfg.scan_layers:
      zeros = lambda shape: jnp.zeros((cfg.num_layers, *shape), dt)
    else:
      zeros = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(zeros(k_shape), zeros(v_shape), jnp.zeros((batch, slots), bool))



def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
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
  if jax.default_backend() == "cpu":
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


class Transformer(nnx.Module):
  """The language model. Call it inside jit via `nnx.merge(graphdef, params)`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = DTYPES[cfg.param_dtype]
    L, D, H, K, Dh, F, V = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads,
                            cfg.head_dim, cfg.mlp_dim, cfg.vocab_size)

    def normal(*shape):
      return nnx.Param((jax.random.normal(rngs.params(), shape) * cfg.init_std).astype(pd))

    def const(value, *shape):
      return nnx.Param(jnp.full(shape, value, pd))

    self.embed = normal(V, D)
    self.attn_norm = const(1.0, L, D)
    self.wq = normal(L, D, H, Dh)
    self.wk = normal(L, D, K, Dh)
    self.wv = normal(L, D, K, Dh)
    self.wo = normal(L, H, Dh, D)
    if cfg.qkv_bias:
      self.bq = const(0.0, L, H, Dh)
      self.bk = const(0.0, L, K, Dh)
      self.bv = const(0.0, L, K, Dh)
    if cfg.qk_norm:
      self.q_norm = const(1.0, L, Dh)
      self.k_norm = const(1.0, L, Dh)
    self.mlp_norm = const(1.0, L, D)
    self.w_gate = normal(L, D, F)
    self.w_up = normal(L, D, F)
    self.w_down = normal(L, F, D)
    self.final_norm = const(1.0, D)
    if not cfg.tie_embeddings:
      self.lm_head = normal(D, V)
    if cfg.lora_rank:
      # Their own key, drawn after every base weight's: the base initialises exactly as it does
      # without LoRA.
      lora_rngs = nnx.Rngs(params=rngs.params())
      for t in cfg.lora_targets:
        din, dout = lora_dims(cfg, t)
        setattr(self, f"lora_{t}", _stacked_lora(L, din, cfg.lora_rank, dout, lora_rngs))

  def _layer_params(self) -> dict:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if self.cfg.qkv_bias:
      names += ["bq", "bk", "bv"]
    if self.cfg.qk_norm:
      names += ["q_norm", "k_norm"]
    dt = DTYPES[self.cfg.dtype]
    return {n: getattr(self, n)[...].astype(dt) for n in names}

  def layer_weights(self, fuse: bool = True) -> tuple[dict, ...]:
    """One dict of weights per layer, in the compute dtype; with `fuse`, q/k/v and gate/up each
    fused into one matrix (fewer, larger matmuls).

    For unrolled models a decode loop computes this once before the loop: a matmul on a slice of
    a stacked [L, ...] weight makes XLA copy the slice first, which inside the loop would
    re-copy the weights at every step.
    """
    stacked = self._layer_params()
    out = []
    for i in range(self.cfg.num_layers):
      p = {n: w[i] for n, w in stacked.items()}
      if fuse:
        p["wqkv"] = jnp.concatenate([p.pop("wq"), p.pop("wk"), p.pop("wv")], axis=1)
        p["w_gate_up"] = jnp.concatenate([p.pop("w_gate"), p.pop("w_up")], axis=1)
      out.append(p)
    return tuple(out)

  def lora_weights(self) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Target -> (A [L, din, rank], B [L, rank, dout]) in the compute dtype; {} without LoRA."""
    dt = DTYPES[self.cfg.dtype]
    out = {}
    for t in self.cfg.lora_targets if self.cfg.lora_rank else ():
      m = getattr(self, f"lora_{t}")
      out[t] = (m.lora_a[...].astype(dt), m.lora_b[...].astype(dt))
    return out

  def __call__(
      self,
      tokens: jax.Array,  # [B, T] int
      positions: jax.Array,  # [B, T] int
      valid: jax.Array,  # [B, T] bool: real tokens (False for padding)
      cache: KVCache | None = None,
      cache_index: jax.Array | int = 0,  # slot of tokens[:, 0] in the cache
      layers: tuple[dict, ...] | None = None,  # `layer_weights()`, prepared by the caller
      lora_dropout_key: jax.Array | None = None,
      attend: Callable | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Returns final hidden states [B, T, D] (after the final norm) and the updated cache.

    `layers` (unrolled models only) lets a decode loop prepare `layer_weights()` once, outside
    the loop. `lora_dropout_key` (training only) turns on `lora_dropout`. `attend(q, k, v)`
    (no cache; `grouped_forward` uses it) replaces the causal attention over `tokens`: q
    [B, T, H, Dh] and k, v [B, T, K, Dh] after bias, norm and rotary in, [B, T, H, Dh] out.
    """
    cfg = self.cfg
    dt = DTYPES[cfg.dtype]
    B, T = tokens.shape
    x = constrain_rows(embed_lookup(self.embed[...].astype(dt), tokens))

    if cache is not None:
      # Under a training mesh the cache is split like the rows that fill it (a no-op otherwise;
      # the samplers pin theirs for their own mesh).
      cache = constrain_kv_cache(cache)
    if cache is None:
      key_valid = valid  # [B, S=T]
      q_slot = jnp.arange(T)
      S = T
    else:
      key_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, cache_index))
      q_slot = cache_index + jnp.arange(T)
      S = cache.valid.shape[1]
    if cache is not None and attend is not None:
      raise ValueError("attend replaces the attention over the tokens; it takes no cache")
    causal = jnp.arange(S)[None, :] <= q_slot[:, None]  # [T, S]
    mask = causal[None, None, None] & key_valid[:, None, None, None, :]  # [B, 1, 1, T, S]

    K, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    # One cos/sin table for q and k of every layer, computed once: behind the barrier XLA keeps
    # it as a buffer instead of recomputing both per element inside every fusion that reads it
    # (the rotary backward's fusions re-evaluated them for each head; issue 22's train step).
    cos, sin = jax.lax.optimization_barrier(rope_tables(positions, config_inv_freq(cfg)))

    def matmul(x, w):
      """x [B, T, Din] times a weight whose leading axis is Din: [B, T, Dout], as one 2-D
      product over the B T rows. (A 3-D operand makes the weight gradient contract over two
      axes, which XLA's CPU backend lays out with a transposed copy of the output gradient;
      2-D, issue 22's whole train step ran ~15% faster.)"""
      w = w.reshape(x.shape[-1], -1)
      return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])

    adapters = self.lora_weights()
    dropout = cfg.lora_dropout if lora_dropout_key is not None else 0.0

    def block(h, p, kv, dense=None, lora=None, key=None):
      """One decoder layer; `kv(k, v)` stores the new keys/values and returns all of them;
      `dense(x, name)` multiplies by weight `name` (default: `p[name]`); `lora`: this layer's
      adapters (target -> (A, B)), added to the projections they adapt (`key`: dropout)."""
      dense = dense or (lambda x, name: matmul(x, p[name]))
      if lora:
        dense = _lora_dense(dense, lora, cfg, dropout, key)
      # Under a training mesh, rows stay split over the batch axes through the layer (see
      # `constrain_rows`): the residual stream with d_model whole, intermediates row-split with
      # their other dims left to XLA.
      h = constrain_rows(h)
      heads = lambda x: x.reshape(B, T, -1, cfg.head_dim)
      a = rms_norm(h, p["attn_norm"], cfg.rms_eps)
      if "wqkv" in p:
        qkv = heads(dense(a, "wqkv"))
        q, k, v = jnp.split(qkv, [cfg.num_heads, cfg.num_heads + K], axis=2)
      else:
        q, k, v = (heads(dense(a, n)) for n in ("wq", "wk", "wv"))
      if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
      if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
      q = apply_rope(q, cos, sin)
      k = apply_rope(k, cos, sin)
      if attend is not None:
        o = attend(q, k, v)
        return mlp(h, p, o, dense)
      k_all, v_all = kv(k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))  # [B,K,Dh,S], [B,K,S,Dh]
      qg = q.reshape(B, T, K, G, cfg.head_dim)
      if T == 1:
        # Single-token decode reads the whole cache once per layer and is bound by that traffic;
        # with slot-minor keys both products stream contiguous rows (measured 1.3x the whole
        # default decode over [B, K, S, Dh] keys with a multiply-and-reduce).
        qd = qg[:, 0].astype(jnp.float32)  # [B, K, G, Dh]
        s = jnp.einsum("bkgd,bkds->bkgs", qd, k_all.astype(jnp.float32))[:, :, :, None] * scale
        s = jnp.where(mask, s, MASK_VALUE)
        w = jax.nn.softmax(s, axis=-1).astype(dt)
        o = jnp.einsum("bkgs,bksd->bkgd", w[:, :, :, 0], v_all).astype(dt)
        o = o.reshape(B, 1, cfg.num_heads, cfg.head_dim)
      else:
        o = attention(qg.transpose(0, 2, 3, 1, 4), k_all.astype(dt), v_all.astype(dt), mask, scale)
        o = o.transpose(0, 3, 1, 2, 4).reshape(B, T, cfg.num_heads, cfg.head_dim)
      return mlp(h, p, o, dense)

    def mlp(h, p, o, dense):
      """The rest of a layer after attention: output projection, residual, MLP."""
      rows = lambda x: constrain_rows(x, jax.sharding.PartitionSpec.UNCONSTRAINED)
      h = constrain_rows(h + rows(dense(rows(o.reshape(B, T, -1)), "wo")))
      m = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
      if "w_gate_up" in p:
        gate, up = jnp.split(dense(m, "w_gate_up"), 2, axis=-1)
      else:
        gate, up = dense(m, "w_gate"), dense(m, "w_up")
      return constrain_rows(h + rows(dense(rows(jax.nn.silu(gate) * up), "w_down")))

    def write(buf, new, at):
      return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), at)

    # Rematerialise each layer when differentiated (no cache: training or scoring). Decode and
    # prefill never take gradients, and their programs stay exactly as they are.
    policy = REMAT_POLICIES[cfg.remat] if cache is None else None

    new_cache = None
    if not cfg.scan_layers:
      # q/k/v and gate/up fused for single-token decode, where each matmul is a pass over its
      # weights; over many tokens (training, scoring, prefill) separate products measured faster
      # on CPU (issue 22's train step, ~1.5 ms of ~60): no weight concatenation per call and no
      # split of the fused product's gradient.
      layers = self.layer_weights(fuse=T == 1) if layers is None else layers
      # Unrolled: one cache array per layer, updated in place inside the decode loop.
      ks, vs = [], []
      for i in range(cfg.num_layers):
        def kv(k, v, i=i):
          if cache is None:
            return k, v
          ks.append(write(cache.k[i], k, (0, 0, 0, cache_index)))
          vs.append(write(cache.v[i], v, (0, 0, cache_index, 0)))
          return ks[-1], vs[-1]
        lora = {t: (a[i], b[i]) for t, (a, b) in adapters.items()}
        key = None if not dropout else jax.random.fold_in(lora_dropout_key, i)
        if policy is None:
          x = block(x, layers[i], kv, lora=lora, key=key)
        else:
          x = jax.checkpoint(lambda h, p, lo, kv=kv, key=key: block(h, p, kv, lora=lo, key=key),
                             policy=policy)(x, layers[i], lora)
      if cache is not None:
        new_cache = KVCache(tuple(ks), tuple(vs), key_valid)
    else:
      # Scanned: stacked [L, ...] caches in the carry. Each layer writes its new slots before
      # reading its slice, so XLA updates the carried buffer in place instead of copying it.
      stacked = self._layer_params()
      dense = None
      if cache is not None and T == 1 and jax.default_backend() == "cpu":
        # Decode is bound by reading the weights. A matmul on a layer's slice of a stacked
        # weight makes XLA's CPU backend copy the whole slice to fresh memory first; instead
        # stream each weight in column chunks small enough that the copy stays in cache for the
        # matmul (measured 2x the weight-read rate of slice-then-matmul for batch-4 0.5B shapes
        # on CPU). Not on accelerators: there each chunk is a kernel launch of its own, and the
        # slice copy runs at HBM bandwidth.
        big = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
        big_w = {n: stacked.pop(n) for n in big}
        big_w = {n: w.reshape(w.shape[0], -1, w.shape[-1]) if n == "wo"
                 else w.reshape(w.shape[0], w.shape[1], -1) for n, w in big_w.items()}
        dense = _streamed_matmul

      def body(carry, xs):
        h, k_cache, v_cache = carry
        p, lora, i = xs
        out = {}
        layer_dense = None if dense is None else (lambda x, name: dense(x, big_w[name], i))

        def kv(k, v):
          if k_cache is None:
            return k, v
          out["k"] = write(k_cache, k[None], (i, 0, 0, 0, cache_index))
          out["v"] = write(v_cache, v[None], (i, 0, 0, cache_index, 0))
          return (jax.lax.dynamic_index_in_dim(out["k"], i, keepdims=False),
                  jax.lax.dynamic_index_in_dim(out["v"], i, keepdims=False))

        key = None if not dropout else jax.random.fold_in(lora_dropout_key, i)
        h = block(h, p, kv, layer_dense, lora, key)
        return (h, out.get("k", k_cache), out.get("v", v_cache)), None

      if policy is not None:
        # prevent_cse=False, as JAX advises under scan: the loop already keeps XLA from merging
        # the recomputation back into the forward pass, and the barriers would only cost.
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
      init = (x, None, None) if cache is None else (x, cache.k, cache.v)
      (x, k_cache, v_cache), _ = jax.lax.scan(body, init,
                                              (stacked, adapters, jnp.arange(cfg.num_layers)))
      if cache is not None:
        new_cache = KVCache(k_cache, v_cache, key_valid)
    if new_cache is not None:
      new_cache = constrain_kv_cache(new_cache)
    return rms_norm(x, self.final_norm[...].astype(dt), cfg.rms_eps), new_cache

  def grouped_forward(self, prompts: jax.Array, prompt_valid: jax.Array, tokens: jax.Array,
                      valid: jax.Array, lora_dropout_key: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """One pass over N left-padded prompts [N, Lp] and their G = B / N continuations [B, T]
    (rows n G .. n G + G - 1 continue prompt n): returns final hidden states of the prompts
    [N, Lp, D] and of the continuations [B, T, D]. The same function as running each row's
    prompt and continuation as one sequence (continuation tokens attend to their prompt and to
    their own earlier valid tokens; positions continue from the prompt's valid count), with each
    prompt's dense work done once.

    Each group runs as one packed row of Lp + G T positions (its prompt, then its G
    continuations), so every position-wise product runs once over all N Lp + B T positions,
    instead of once for the prompts and once for the continuations through a key/value cache
    repeated to every row: on XLA's CPU backend the prompts' own small products, their
    gradients, the cache copies and the two passes' weight-gradient sums cost more than their
    FLOPs (issue 22's train step). The attention splits each packed row again: the prompt over
    itself, each continuation over its prompt's keys and its own.
    """
    cfg = self.cfg
    n, lp = prompts.shape
    b, t = tokens.shape
    if b % n:
      raise ValueError(f"{b} continuation rows are not a multiple of {n} prompts")
    group = b // n
    positions = continuation_positions(prompt_valid, valid, group)
    pack = lambda a, c: jnp.concatenate([a, c.reshape(n, group * t)], axis=1)  # [N, Lp + G T]
    K, G, dh = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    scale = dh ** -0.5
    causal_p = jnp.arange(lp)[None, :] <= jnp.arange(lp)[:, None]
    mask_p = causal_p[None, None, None] & prompt_valid[:, None, None, None, :]  # [N,1,1,Lp,Lp]
    causal_c = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    mask_c = jnp.concatenate(  # [B, 1, 1, T, Lp + T]: the prompt's valid keys, then causal own
        [jnp.broadcast_to(jnp.repeat(prompt_valid, group, axis=0)[:, None, None, None, :],
                          (b, 1, 1, t, lp)),
         causal_c[None, None, None] & valid[:, None, None, None, :]], axis=-1)

    def attend(q, k, v):
      # [rows, T, K, G, Dh] -> [rows, K, G, T, Dh]; keys [rows, K, Dh, T]; values [rows, K, T, Dh]
      qs = lambda x, r, s: x.reshape(r, s, K, G, dh).transpose(0, 2, 3, 1, 4)
      ks = lambda x, r, s: x.reshape(r, s, K, dh).transpose(0, 2, 3, 1)
      vs = lambda x, r, s: x.reshape(r, s, K, dh).transpose(0, 2, 1, 3)
      kp, vp = ks(k[:, :lp], n, lp), vs(v[:, :lp], n, lp)
      o_p = attention(qs(q[:, :lp], n, lp), kp, vp, mask_p, scale)
      k_all = jnp.concatenate([jnp.repeat(kp, group, axis=0), ks(k[:, lp:], b, t)], axis=-1)
      v_all = jnp.concatenate([jnp.repeat(vp, group, axis=0), vs(v[:, lp:], b, t)], axis=-2)
      o_c = attention(qs(q[:, lp:], b, t), k_all, v_all, mask_c, scale)
      back = lambda o: o.transpose(0, 3, 1, 2, 4).reshape(n, -1, cfg.num_heads, dh)
      return jnp.concatenate([back(o_p), back(o_c)], axis=1)

    hidden, _ = self(pack(prompts, tokens), pack(left_positions(prompt_valid), positions),
                     pack(prompt_valid, valid), lora_dropout_key=lora_dropout_key, attend=attend)
    return hidden[:, :lp], hidden[:, lp:].reshape(b, t, -1)

  def unembedding(self) -> jax.Array:
    """[D, V] output projection (the transposed embedding when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def logits(self, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V]."""
    w = self.unembedding().astype(hidden.dtype)
    return jnp.einsum("...d,dv->...v", hidden, w).astype(jnp.float32)


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


def _stacked_lora(layers: int, din: int, rank: int, dout: int, rngs: nnx.Rngs) -> nnx.LoRA:
  """`layers` `nnx.LoRA(din, rank, dout)` adapters stacked on a leading axis (`nnx.vmap`): each
  layer's A is initialised on its own key, B at zero, so the adapted model starts equal to the
  base."""
  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(r):
    return nnx.LoRA(din, rank, dout, rngs=r)
  return make(rngs)


def _lora_dense(dense, lora: dict, cfg: ModelConfig, dropout: float, key):
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


def _streamed_matmul(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
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


def init_model(cfg: ModelConfig, seed: int, shardings=None) -> tuple[nnx.GraphDef, nnx.State]:
  """Builds the model and splits it into (graphdef, params) for pure functions.

  Initialisation runs as one jitted program (eagerly, every random op of a new shape would
  compile on its own); with `shardings` each parameter is created in place on its devices.
  """
  graphdef, _ = abstract_model(cfg)
  make = lambda: nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=seed)))[1]
  return graphdef, jax.jit(make, out_shardings=shardings)()


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """Shapes only (no allocation), for sharding specs and checkpoint targets."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """float32 `logits / T`; `temperature <= 0` (greedy) scales by 1. T is a scalar or one per
  row of `logits[..., :]`."""
  t = jnp.asarray(temperature, jnp.float32)
  return logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[..., None]


def continuation_positions(prompt_valid: jax.Array, valid: jax.Array, group: int) -> jax.Array:
  """Positions [B, T] of continuation tokens `valid` [B, T] after left-padded prompts
  `prompt_valid` [B / group, Lp], each continuing `group` consecutive rows: counted on from the
  prompt's valid tokens, advancing at valid tokens only (never below 0)."""
  before = jnp.repeat(jnp.sum(prompt_valid, axis=-1, dtype=jnp.int32), group)[:, None]
  return jnp.maximum(before + jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def left_positions(valid: jax.Array) -> jax.Array:
  """Positions counted from each row's first real token (left padding gets 0)."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array) -> jax.Array:
  """The one log-prob definition: `log_softmax(logits / T)[target]` over the full vocabulary, f32.

  Used by the sampler, the trainer's recompute and (later) the reference model, so they agree by
  construction. `temperature <= 0` means greedy decoding; its log-probs are taken at T = 1.
  """
  z = scale_logits(logits, temperature)
  picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(z, axis=-1)
