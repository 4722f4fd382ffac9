"""The model's configuration and its key/value cache record.

`ModelConfig` describes an architecture (enough for real Llama / Qwen checkpoints) and checks its
own fields when built; `KVCache` is the per-layer keys and values a decode loop carries between
calls of `Transformer`. Both are plain records, importable without building a model.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core import platform
from jaxrl.core import names

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# What a KV cache may be stored in (`ModelConfig.kv_cache_dtype`): the compute dtypes and two
# 8-bit floats (keys and values rounded to them as written, no scale; read back upcast).
KV_CACHE_DTYPES = {**DTYPES, "float8_e4m3fn": jnp.float8_e4m3fn,
                   "float8_e5m2": jnp.float8_e5m2}

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

# The attention of a forward pass without a KV cache (`ModelConfig.attention`).
ATTENTION_IMPLS = names.ATTENTION_IMPLS

# How a mixture-of-experts layer runs its experts' products (`ModelConfig.moe_dispatch`,
# `jaxrl.models.moe.resolve_dispatch`).
MOE_DISPATCHES = names.MOE_DISPATCHES


# "auto" on CPU: rows up to this many positions attend densely (the fastest form there, and the
# default run's); longer rows blockwise. A dense `[rows, heads, T, T]` f32 score tensor per layer
# at 1,024 positions is 4 MiB per head and row, and it grows with the square of the length.
AUTO_DENSE_MAX_LENGTH = 1024


def resolve_attention(choice: str, backend: str | None = None, length: int | None = None) -> str:
  """The attention a forward uses for `ModelConfig.attention` `choice` on `backend` (None: JAX's
  default backend, read when the forward is traced), for rows of `length` positions (None:
  short). A named implementation is itself ("cudnn": cuDNN's flash attention on a CUDA GPU,
  bf16/f16; "pallas_tpu": the Pallas TPU kernel, interpreted off TPU; neither has run on its
  device yet); "auto" is "dense" or "xla":

  "auto" is "dense" on CPU for rows up to `AUTO_DENSE_MAX_LENGTH` positions: there it is the
  fastest (its own gradient rule, `layers.attention`), and the default run stays bit for bit
  what it was. Longer rows on CPU, and every row elsewhere, get "xla"
  (`jaxrl.kernels.attention`, blockwise): memory linear in the sequence instead of a
  [rows, heads, T, T] score tensor per layer.
  """
  if choice not in ATTENTION_IMPLS:
    raise ValueError(f"attention={choice!r} is not one of {ATTENTION_IMPLS}")
  if choice != "auto":
    return choice
  backend = platform.current() if backend is None else backend
  short = length is None or length <= AUTO_DENSE_MAX_LENGTH
  return "dense" if backend == "cpu" and short else "xla"


def resolve_decode_attention(choice: str, backend: str | None = None) -> str:
  """The single-token decode attention for `ModelConfig.decode_attention` `choice` on `backend`
  (None: JAX's default, read when the decode step is traced): "dense" (`layers.decode_attention`:
  every cache slot, f32 keys) or a `jaxrl.kernels.decode_attention` implementation (filled slots
  only, in the cache's dtype). "auto" is "dense" on CPU, where the default run was measured with
  it, and "xla" elsewhere. No GPU or TPU has run any of them yet."""
  if choice not in names.DECODE_ATTENTION_IMPLS:
    raise ValueError(f"decode_attention={choice!r} is not one of {names.DECODE_ATTENTION_IMPLS}")
  if choice != "auto":
    return choice
  backend = platform.current() if backend is None else backend
  return "dense" if backend == "cpu" else "xla"


def resolve_kv_cache_dtype(choice: str | None, dtype: str, backend: str | None = None) -> str:
  """The KV cache's storage dtype for `choice` (`names.KV_CACHE_DTYPES`, or None: the compute
  dtype) on a model computing in `dtype`, on `backend` (None: JAX's default, read when called).
  "auto" is bfloat16 on a GPU or TPU (half the bytes every decode step reads) and `dtype` on
  CPU, where the default run was measured with it."""
  if choice is None:
    return dtype
  if choice not in names.KV_CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype={choice!r} is not one of {names.KV_CACHE_DTYPES}")
  if choice != "auto":
    return choice
  backend = platform.current() if backend is None else backend
  return dtype if backend == "cpu" else "bfloat16"


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
  # `layers.rope_inv_freq`): "none", "linear" (every frequency divided by `rope_factor`) or
  # "llama3" (Llama 3.1+: low frequencies divided by `rope_factor`, high ones kept, a smooth ramp
  # between, with band edges at `rope_original_max_positions / rope_{low,high}_freq_factor`
  # positions).
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
  # The attention of forward passes without a KV cache (training, scoring, `grouped_forward`,
  # `packed_forward`): "dense" (a dense mask), "xla" (`jaxrl.kernels.attention`, blockwise,
  # memory linear in the sequence), "cudnn", "pallas_tpu" or "auto" (`resolve_attention`).
  attention: str = "auto"
  # Single-token decode's attention over the KV cache (`resolve_decode_attention`): "dense",
  # "xla" (only the filled slots, up to the longest row, in the cache's dtype), "pallas_tpu",
  # "pallas_gpu" or "auto".
  decode_attention: str = "auto"
  # The KV cache's storage (`resolve_kv_cache_dtype`): None = the compute dtype `dtype` (the
  # trainer's model), or a `names.KV_CACHE_DTYPES` name (the sampler's model: `rollout.
  # kv_cache_dtype`). Attention reads it in that dtype and upcasts inside; 8-bit floats are
  # upcast to the compute dtype for the products. Log-probs stay the float32 softmax's.
  kv_cache_dtype: str | None = None
  # LoRA (`jaxrl.models.lora`): rank 0 = none. With a rank, every layer gets an `nnx.LoRA`
  # adapter (A [din, rank], B [rank, dout], `nnx.LoRAParam`) on each of `lora_targets`
  # (`names.LORA_TARGETS`), whose product scaled by `lora_alpha / lora_rank` is added to that
  # projection's output; `lora_dropout` drops the adapter's input when a dropout key is given.
  lora_rank: int = 0
  lora_alpha: float = 32.0
  lora_targets: tuple[str, ...] = ()
  lora_dropout: float = 0.0
  # Mixture of experts (`jaxrl.models.moe`, Qwen3-MoE): 0 = a dense MLP in every layer. With E
  # experts every layer's MLP is E SwiGLU experts of width `moe_intermediate_size`; each token
  # takes the sum of its `num_experts_per_tok` most probable experts (float32 router), weighted
  # by their probabilities, renormalised to sum 1 with `norm_topk_prob`. `moe_dispatch`: the
  # grouped matmul (`MOE_DISPATCHES`).
  num_experts: int = 0
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  moe_dispatch: str = "auto"
  # > 0: each expert takes at most ceil(factor x tokens x k / E) of a forward pass's token-expert
  # assignments, the later tokens' beyond that dropped (they skip that expert); 0: dropless.
  moe_capacity_factor: float = 0.0

  def __post_init__(self):
    # Checked here, not at trace time: a typo in `rope_scaling` would otherwise quietly mean
    # "none" somewhere, or fail deep inside jit.
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not one of {tuple(REMAT_POLICIES)}")
    resolve_attention(self.attention, "cpu")  # raises on an unknown name
    resolve_decode_attention(self.decode_attention, "cpu")
    resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype, "cpu")
    unknown = set(self.lora_targets) - set(names.LORA_TARGETS)
    if unknown or (self.lora_rank and not self.lora_targets):
      raise ValueError(f"lora_targets={self.lora_targets!r}: a non-empty subset of "
                       f"{names.LORA_TARGETS}")
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
        raise ValueError(f"num_experts={self.num_experts} needs 1 <= num_experts_per_tok <= "
                         f"num_experts and moe_intermediate_size >= 1; got "
                         f"{self.num_experts_per_tok}, {self.moe_intermediate_size}")
      if self.moe_capacity_factor < 0:
        raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor} must be >= 0")
      if self.moe_dispatch not in MOE_DISPATCHES:
        raise ValueError(f"moe_dispatch={self.moe_dispatch!r} is not one of {MOE_DISPATCHES}")
      if self.lora_rank and set(self.lora_targets) & {"gate", "up", "down"}:
        raise ValueError(f"lora_targets={self.lora_targets!r}: a mixture-of-experts model "
                         "adapts only q, k, v, o")
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
  def qwen3_30b_a3b(cls, **overrides) -> "ModelConfig":
    """Qwen3-30B-A3B shapes (30.5B parameters, 3.35B active per token: 8 of 128 experts)."""
    kw = dict(vocab_size=151936, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
              head_dim=128, mlp_dim=6144, rope_theta=1000000.0, rms_eps=1e-6, qk_norm=True,
              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
              norm_topk_prob=True, scan_layers=True)
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
    """An empty cache of `batch` rows and `slots` slots, keys and values in the config's
    `kv_cache_dtype` (`resolve_kv_cache_dtype`)."""
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, slots)
    v_shape = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
    dt = KV_CACHE_DTYPES[resolve_kv_cache_dtype(cfg.kv_cache_dtype, cfg.dtype)]
    # Separate buffers throughout: the decode loop donates the cache, and XLA refuses to donate
    # one buffer twice.
    if cfg.scan_layers:
      zeros = lambda shape: jnp.zeros((cfg.num_layers, *shape), dt)
    else:
      zeros = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(zeros(k_shape), zeros(v_shape), jnp.zeros((batch, slots), bool))
