"""One decoder layer, as the model's layer loops run it (`jaxrl.models.transformer`): attention
through the layer's KV cache or a given attention, then the output projection, the residual and
the MLP (dense, or the experts'). `Pass` is what every layer of one forward pass shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.kernels.decode_attention import decode_attention as decode_kernel
from jaxrl.models.layers import (attention, decode_attention, lora_dense, matmul_rows,
                                 project_qkv, rms_norm, write_cache)
from jaxrl.models.model_config import DTYPES, ModelConfig, resolve_decode_attention
from jaxrl.models.moe import moe_mlp
from jaxrl.parallel.sharding import constrain_rows


class Pass(NamedTuple):
  """What every layer of one forward pass shares."""

  cfg: ModelConfig
  rows: int  # B
  length: int  # T: tokens per row in this call
  cos: jax.Array  # rotary tables of `rope_tables`, float32 [B, T, 1, Dh]
  sin: jax.Array
  mask: jax.Array  # [B, 1, 1, T, S] bool: which slots each token attends to
  attend: Callable | None  # replaces the attention over the tokens (`Transformer.__call__`)
  dropout: float  # LoRA dropout rate, 0 unless a dropout key was given
  dropout_key: jax.Array | None
  filled: jax.Array | None = None  # [B] int: decode's slots in use (`cache_index + 1`)
  valid: jax.Array | None = None  # [B, T] bool: real tokens (counted in router statistics)
  routing: jax.Array | None = None  # [L, B, T, k]: experts to replay (`moe.moe_mlp`)
  use_routing: bool = True  # replay them (else only compare them with the router's own)


def block(run: Pass, h, p, kv, dense=None, lora=None, key=None):
  """One decoder layer: (hidden, router statistics or None for a dense MLP). `kv(k, v)` stores
  the new keys/values and returns all of them; `dense(x, name)` multiplies by weight `name`
  (default: `p[name]`); `lora`: this layer's adapters (target -> (A, B)), added to the
  projections they adapt (`key`: dropout)."""
  dense = dense or (lambda x, name: matmul_rows(x, p[name]))
  if lora:
    dense = lora_dense(dense, lora, run.cfg, run.dropout, key)
  # Under a training mesh, rows stay split over the batch axes through the layer (see
  # `constrain_rows`): the residual stream with d_model whole, intermediates row-split with
  # their other dims left to XLA.
  h = constrain_rows(h)
  q, k, v = project_qkv(run, h, p, dense)
  if run.attend is not None:
    o = run.attend(q, k, v)
  else:
    o = cache_attention(run, q, k, v, kv)
  return block_mlp(run, h, p, o, dense)


def cached_block(run: Pass, h, p, lora, k_cache, v_cache, cache_index, key=None):
  """`block` over one layer's cache arrays k [B, K, Dh, S], v [B, K, S, Dh]: ((hidden, updated
  keys, updated values), router statistics or None); the form a rematerialised layer with a
  cache takes (`Transformer.__call__`'s `remat`)."""
  out = {}

  def kv(k, v):
    out["k"] = write_cache(k_cache, k, (0, 0, 0, cache_index))
    out["v"] = write_cache(v_cache, v, (0, 0, cache_index, 0))
    return out["k"], out["v"]

  h, stats = block(run, h, p, kv, lora=lora, key=key)
  return (h, out["k"], out["v"]), stats


def cache_attention(run: Pass, q, k, v, kv):
  """Causal attention of q [B, T, H, Dh] over the keys and values `kv` returns once it has
  stored k, v [B, T, K, Dh]: [B, T, H, Dh] in the compute dtype."""
  cfg, B, T = run.cfg, run.rows, run.length
  dt = DTYPES[cfg.dtype]
  K, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
  scale = cfg.head_dim ** -0.5
  k_all, v_all = kv(k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))  # [B,K,Dh,S], [B,K,S,Dh]
  qg = q.reshape(B, T, K, G, cfg.head_dim)
  if T == 1:
    impl = resolve_decode_attention(cfg.decode_attention)
    if impl == "dense":
      o = decode_attention(qg[:, 0], k_all, v_all, run.mask, scale, dt)
    else:  # the mask's [B, S] row (valid and causal) with the fill bound for skipping blocks
      o = decode_kernel(qg[:, 0], k_all, v_all, run.mask[:, 0, 0, 0, :], run.filled,
                        scale=scale, implementation=impl, out_dtype=dt)
    return o.reshape(B, 1, cfg.num_heads, cfg.head_dim)
  o = attention(qg.transpose(0, 2, 3, 1, 4), k_all.astype(dt), v_all.astype(dt), run.mask, scale)
  return o.transpose(0, 3, 1, 2, 4).reshape(B, T, cfg.num_heads, cfg.head_dim)


def block_mlp(run: Pass, h, p, o, dense):
  """The rest of a layer after attention: output projection, residual, MLP (dense, or the
  experts': `moe.moe_mlp`). Returns (hidden, router statistics or None)."""
  cfg = run.cfg
  rows = lambda x: constrain_rows(x, jax.sharding.PartitionSpec.UNCONSTRAINED)
  h = constrain_rows(h + rows(dense(rows(o.reshape(run.rows, run.length, -1)), "wo")))
  m = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
  if cfg.num_experts:
    y, stats = moe_mlp(m, p, cfg, run.valid, p.get("replay"), run.use_routing)
    return constrain_rows(h + rows(y)), stats
  if "w_gate_up" in p:
    gate, up = jnp.split(dense(m, "w_gate_up"), 2, axis=-1)
  else:
    gate, up = dense(m, "w_gate"), dense(m, "w_up")
  return constrain_rows(h + rows(dense(rows(jax.nn.silu(gate) * up), "w_down"))), None
