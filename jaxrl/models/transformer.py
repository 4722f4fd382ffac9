"""Decoder-only language model of the Llama / Qwen2 / Qwen3 family, in Flax NNX: RMSNorm, rotary
position embeddings (HF "rotate half" layout, optionally "linear" or Llama-3 frequency scaling),
grouped-query attention, SwiGLU MLP, optional q/k/v bias (Qwen2), optional per-head q/k RMSNorm
(Qwen3), optional tied embeddings, separate parameter and compute dtypes.

Layer weights are stacked on a leading `[num_layers]` axis and the forward pass is a `lax.scan`
over layers, so compile time does not grow with depth and the KV cache is one array per K and V.

Positions are explicit per token, so left-padded prompts get positions 0.. from their first real
token; attention masks come from a per-slot validity mask plus causality by slot. One code path
serves the trainer (no cache, whole sequence; or `grouped_forward`, a group's prompt once with
its G completions packed into one row), prefill (slots `[0, T)` of a fresh cache) and decode
(one slot per step). Attention over many queries (`layers.attention`) has its own gradient rule;
single-token decode its own form (`layers.decode_attention`). The building blocks are in
`layers`; the configuration and cache records in `model_config`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.block import Pass, block, cached_block
from jaxrl.models.layers import (KERNEL_OF, attention, attention_mask, config_inv_freq,
                                 embed_lookup, kernel_attend, lora_dims, rms_norm, rope_tables,
                                 stacked_lora, streamed_matmul, streams_weights, write_cache)
from jaxrl.models.logprobs import continuation_positions, left_positions
from jaxrl.models.model_config import (DTYPES, REMAT_POLICIES, KVCache, ModelConfig,
                                       resolve_attention)
from jaxrl.models.moe import expert_shapes
from jaxrl.parallel.sharding import constrain_kv_cache, constrain_rows


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
    if cfg.num_experts:  # `jaxrl.models.moe`: a router and E experts instead of one MLP
      for name, shape in expert_shapes(cfg).items():
        setattr(self, name, normal(L, *shape))
    else:
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
        setattr(self, f"lora_{t}", stacked_lora(L, din, cfg.lora_rank, dout, lora_rngs))

  def _layer_params(self) -> dict:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm"]
    names += list(expert_shapes(self.cfg)) if self.cfg.num_experts else ["w_gate", "w_up",
                                                                         "w_down"]
    if self.cfg.qkv_bias:
      names += ["bq", "bk", "bv"]
    if self.cfg.qk_norm:
      names += ["q_norm", "k_norm"]
    dt = DTYPES[self.cfg.dtype]
    # The router stays in float32 whatever the compute dtype.
    return {n: getattr(self, n)[...].astype(jnp.float32 if n == "router" else dt)
            for n in names}

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
        if "w_gate" in p:
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
      routing: jax.Array | None = None,  # [L, B, T, k] int: recorded experts (MoE only), -1: none
      use_routing: bool = True,  # send tokens to `routing` (else only compare it)
      remat: bool | None = None,  # apply `cfg.remat`; None: only without a cache
  ) -> tuple[jax.Array, KVCache | None]:
    """Returns final hidden states [B, T, D] (after the final norm) and the updated cache.

    `layers` (unrolled models only) lets a decode loop prepare `layer_weights()` once, outside
    the loop. `lora_dropout_key` (training only) turns on `lora_dropout`. `attend(q, k, v)`
    (no cache; `grouped_forward` uses it) replaces the causal attention over `tokens`: q
    [B, T, H, Dh] and k, v [B, T, K, Dh] after bias, norm and rotary in, [B, T, H, Dh] out.
    Without a cache the attention is `cfg.attention`'s (`resolve_attention`); with one,
    always the dense `layers.attention`. `routing` (mixture-of-experts models): every layer's
    recorded experts per token, used instead of the router's own choice (`use_routing`) and
    compared with it in the router statistics (`moe.moe_mlp`'s replay). `remat`: whether the
    layers rematerialise by `cfg.remat` when differentiated; None (the default) is without a
    cache only (training, scoring), so decode and prefill programs stay as they are. The train
    step's two-pass shared-prompt form differentiates through a cache and passes True (scanned
    layers; unrolled ones keep none with a cache).
    """
    if cache is not None and attend is not None:
      raise ValueError("attend replaces the attention over the tokens; it takes no cache")
    cfg = self.cfg
    dt = DTYPES[cfg.dtype]
    B, T = tokens.shape
    x = constrain_rows(embed_lookup(self.embed[...].astype(dt), tokens))

    if cache is not None:
      # Under a training mesh the cache is split like the rows that fill it (a no-op otherwise;
      # the samplers pin theirs for their own mesh).
      cache = constrain_kv_cache(cache)
    key_valid, mask = attention_mask(valid, cache, cache_index)
    # One cos/sin table for q and k of every layer, computed once: behind the barrier XLA keeps
    # it as a buffer instead of recomputing both per element inside every fusion that reads it
    # (the rotary backward's fusions re-evaluated them for each head; issue 22's train step).
    cos, sin = jax.lax.optimization_barrier(rope_tables(positions, config_inv_freq(cfg)))
    impl = resolve_attention(cfg.attention, length=T)
    if cache is None and attend is None and impl != "dense":
      # Each row's own tokens, as the dense mask above: a real token attends the real slots up
      # to its own (segment 0, position = slot); a padding query attends nothing (uniform
      # average, never read: the callers mask padding out of every loss and output). With a
      # cache (prefill, decode: the sampler's path) attention stays dense for now.
      seg = jnp.where(valid, 0, -1)
      slot = jnp.broadcast_to(jnp.arange(T), (B, T))
      attend = kernel_attend(seg, slot, None, impl)
    adapters = self.lora_weights()
    dropout = cfg.lora_dropout if lora_dropout_key is not None else 0.0
    # Single-token decode reads slots up to its own (the mask's causal bound) and no further.
    filled = jnp.broadcast_to(jnp.asarray(cache_index, jnp.int32) + T, (B,)) \
        if cache is not None and T == 1 else None
    run = Pass(cfg, B, T, cos, sin, mask, attend, dropout, lora_dropout_key, filled, valid,
                routing, use_routing)

    # Rematerialise each layer when differentiated (no cache: training or scoring; with one, the
    # train step's shared-prompt passes ask for it). Decode and prefill never take gradients,
    # and their programs stay exactly as they are.
    policy = REMAT_POLICIES[cfg.remat] if (cache is None if remat is None else remat) else None
    if cfg.scan_layers:
      x, k, v, stats = self._scanned_layers(run, x, cache, cache_index, adapters, policy)
    else:
      # Unrolled layers keep no rematerialisation with a cache (the shared-prompt passes of a
      # scanned model do): a rematerialised unrolled layer's gradients differed in the last bits
      # on a 1x8x1 mesh, and deep models, where it matters, scan.
      x, k, v, stats = self._unrolled_layers(run, x, cache, cache_index, layers, adapters,
                                             None if cache is not None else policy)
    if stats is not None:
      # A mixture-of-experts model's routing, per layer, appended for `moe.pop_router_stats`.
      # A model merged outside the loop that calls it (the sampler's decode) cannot record;
      # nothing reads statistics there.
      prev = getattr(self, "router_stats", None)
      before = () if prev is None else prev.get_value()
      try:
        self.router_stats = nnx.Intermediate((*before, stats))
      except flax.errors.TraceContextError:
        pass
    new_cache = None
    if cache is not None:
      new_cache = constrain_kv_cache(KVCache(k, v, key_valid))
    return rms_norm(x, self.final_norm[...].astype(dt), cfg.rms_eps), new_cache

  def _unrolled_layers(self, run: Pass, x: jax.Array, cache: KVCache | None,
                       cache_index: jax.Array | int, layers: tuple[dict, ...] | None,
                       adapters: dict, policy) -> tuple[jax.Array, tuple, tuple, object]:
    """The layers as a Python loop over per-layer weights: (hidden, new keys, new values, router
    statistics stacked [L, ...] or None for a dense model), the keys and values one cache array
    per layer (empty tuples without a cache)."""
    cfg = self.cfg
    # q/k/v and gate/up fused for single-token decode, where each matmul is a pass over its
    # weights; over many tokens (training, scoring, prefill) separate products measured faster
    # on CPU (issue 22's train step, ~1.5 ms of ~60): no weight concatenation per call and no
    # split of the fused product's gradient.
    layers = self.layer_weights(fuse=run.length == 1) if layers is None else layers
    # Unrolled: one cache array per layer, updated in place inside the decode loop.
    ks, vs, stats = [], [], []
    for i in range(cfg.num_layers):
      def kv(k, v, i=i):
        if cache is None:
          return k, v
        ks.append(write_cache(cache.k[i], k, (0, 0, 0, cache_index)))
        vs.append(write_cache(cache.v[i], v, (0, 0, cache_index, 0)))
        return ks[-1], vs[-1]
      lora = {t: (a[i], b[i]) for t, (a, b) in adapters.items()}
      p_i = layers[i] if run.routing is None else {**layers[i], "replay": run.routing[i]}
      key = None if not run.dropout else jax.random.fold_in(run.dropout_key, i)
      if policy is None:
        x, st = block(run, x, p_i, kv, lora=lora, key=key)
      else:
        x, st = jax.checkpoint(
            lambda h, p, lo, kv=kv, key=key: block(run, h, p, kv, lora=lo, key=key),
            policy=policy)(x, p_i, lora)
      stats.append(st)
    stacked = None if stats[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *stats)
    return x, tuple(ks), tuple(vs), stacked

  def _scanned_layers(self, run: Pass, x: jax.Array, cache: KVCache | None,
                      cache_index: jax.Array | int, adapters: dict, policy
                      ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, object]:
    """The layers as one `lax.scan` over the stacked weights: (hidden, new keys, new values,
    router statistics or None), the keys, values and statistics stacked [L, ...] (keys and values
    None without a cache)."""
    cfg = self.cfg
    # Scanned: stacked [L, ...] caches in the carry. Each layer writes its new slots before
    # reading its slice, so XLA updates the carried buffer in place instead of copying it.
    stacked = self._layer_params()
    if run.routing is not None:
      stacked["replay"] = run.routing  # sliced per layer by the scan, like the weights
    dense = None
    if cache is not None and streams_weights(run.length) and policy is None:
      big = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} & set(stacked)
      big_w = {n: stacked.pop(n) for n in big}
      big_w = {n: w.reshape(w.shape[0], -1, w.shape[-1]) if n == "wo"
               else w.reshape(w.shape[0], w.shape[1], -1) for n, w in big_w.items()}
      dense = streamed_matmul

    def body(carry, xs):
      h, k_cache, v_cache = carry
      p, lora, i = xs
      out = {}
      layer_dense = None if dense is None else (lambda x, name: dense(x, big_w[name], i))

      def kv(k, v):
        if k_cache is None:
          return k, v
        out["k"] = write_cache(k_cache, k[None], (i, 0, 0, 0, cache_index))
        out["v"] = write_cache(v_cache, v[None], (i, 0, 0, cache_index, 0))
        return (jax.lax.dynamic_index_in_dim(out["k"], i, keepdims=False),
                jax.lax.dynamic_index_in_dim(out["v"], i, keepdims=False))

      key = None if not run.dropout else jax.random.fold_in(run.dropout_key, i)
      h, stats = block(run, h, p, kv, layer_dense, lora, key)
      return (h, out.get("k", k_cache), out.get("v", v_cache)), stats

    if policy is not None and cache is not None:
      # Differentiated through a cache (the train step's shared-prompt passes): only the layer
      # is rematerialised, with its slice of the carried cache as an input and its updated
      # slice as an output, written back outside. Checkpointing the whole body would save the
      # whole carried [L, ...] cache at every layer.
      def body(carry, xs):
        h, k_cache, v_cache = carry
        p, lora, i = xs
        key = None if not run.dropout else jax.random.fold_in(run.dropout_key, i)
        layer = lambda h, p, lo, ck, cv: cached_block(run, h, p, lo, ck, cv, cache_index,
                                                       key=key)
        (h, k_i, v_i), stats = jax.checkpoint(layer, policy=policy, prevent_cse=False)(
            h, p, lora, jax.lax.dynamic_index_in_dim(k_cache, i, keepdims=False),
            jax.lax.dynamic_index_in_dim(v_cache, i, keepdims=False))
        return (h, jax.lax.dynamic_update_index_in_dim(k_cache, k_i, i, 0),
                jax.lax.dynamic_update_index_in_dim(v_cache, v_i, i, 0)), stats
    elif policy is not None:
      # prevent_cse=False, as JAX advises under scan: the loop already keeps XLA from merging
      # the recomputation back into the forward pass, and the barriers would only cost.
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    init = (x, None, None) if cache is None else (x, cache.k, cache.v)
    (x, k_cache, v_cache), stats = jax.lax.scan(
        body, init, (stacked, adapters, jnp.arange(cfg.num_layers)))
    return x, k_cache, v_cache, stats

  def grouped_forward(self, prompts: jax.Array, prompt_valid: jax.Array, tokens: jax.Array,
                      valid: jax.Array, lora_dropout_key: jax.Array | None = None,
                      routing: jax.Array | None = None, use_routing: bool = True
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
    itself, each continuation over its prompt's keys and its own (dense masks; with
    `cfg.attention` resolving to "xla", one blockwise kernel call over the whole packed row,
    the split expressed as segments).
    """
    cfg = self.cfg
    n, lp = prompts.shape
    b, t = tokens.shape
    if b % n:
      raise ValueError(f"{b} continuation rows are not a multiple of {n} prompts")
    group = b // n
    positions = continuation_positions(prompt_valid, valid, group)
    pack = lambda a, c: jnp.concatenate([a, c.reshape(n, group * t)], axis=1)  # [N, Lp + G T]
    packed_positions = pack(left_positions(prompt_valid), positions)
    impl = resolve_attention(cfg.attention, length=lp + group * t)
    if impl != "dense":
      # The same mask as segments (`jaxrl.kernels.attention`'s group layout): the prompt is
      # segment 0 and shared, continuation g of a group segment g + 1, padding -1. Padding
      # queries then attend nothing (the dense masks let some see keys); no output reads them.
      seg_c = jnp.where(valid, jnp.tile(jnp.arange(1, group + 1), n)[:, None], -1)
      seg = pack(jnp.where(prompt_valid, 0, -1), seg_c)
      shared = pack(prompt_valid, jnp.zeros_like(valid))
      attend = kernel_attend(seg, packed_positions, shared, impl)
    else:
      attend = self._grouped_dense_attend(prompt_valid, valid)
    if routing is not None:  # the continuations' [L, B, T, k]; the prompts' own routing
      routing = jnp.concatenate([jnp.full((cfg.num_layers, n, lp, routing.shape[-1]), -1,
                                          routing.dtype), routing.reshape(
                                              cfg.num_layers, n, group * t, -1)], axis=2)
    hidden, _ = self(pack(prompts, tokens), packed_positions, pack(prompt_valid, valid),
                     lora_dropout_key=lora_dropout_key, attend=attend, routing=routing,
                     use_routing=use_routing)
    return hidden[:, :lp], hidden[:, lp:].reshape(b, t, -1)

  def packed_forward(self, tokens: jax.Array, positions: jax.Array, segment: jax.Array,
                     shared: jax.Array, lora_dropout_key: jax.Array | None = None,
                     routing: jax.Array | None = None, use_routing: bool = True) -> jax.Array:
    """Final hidden states [B, T, D] of packed rows: several sequences per row, each token with
    its segment (-1: padding), its position in its sequence and whether it is a shared prompt
    key (`jaxrl.kernels.attention`'s mask; `jaxrl.learner.packing` lays rows out so). The
    attention is `cfg.attention`'s for rows of T positions, "dense" as the kernels' masked
    `reference`."""
    impl = resolve_attention(self.cfg.attention, length=tokens.shape[1])
    attend = kernel_attend(segment, positions, shared, KERNEL_OF.get(impl, impl))
    hidden, _ = self(tokens, positions, segment >= 0, lora_dropout_key=lora_dropout_key,
                     attend=attend, routing=routing, use_routing=use_routing)
    return hidden

  def _grouped_dense_attend(self, prompt_valid: jax.Array, valid: jax.Array) -> Callable:
    """`grouped_forward`'s dense attention (`layers.attention`) of a packed row: the prompt
    over itself, each continuation over its prompt's keys and its own."""
    cfg = self.cfg
    n, lp = prompt_valid.shape
    b, t = valid.shape
    group = b // n
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

    return attend

  def unembedding(self) -> jax.Array:
    """[D, V] output projection (the transposed embedding when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def logits(self, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V]."""
    w = self.unembedding().astype(hidden.dtype)
    return jnp.einsum("...d,dv->...v", hidden, w).astype(jnp.float32)


def init_model(cfg: ModelConfig, seed: int, shardings=None) -> tuple[nnx.GraphDef, nnx.State]:
  """The model split into (graphdef, params) for pure functions, by one jitted program per config
  and shardings (`_init_program`; with `shardings` each parameter is made on its devices)."""
  leaves, treedef = jax.tree.flatten(shardings)
  try:
    program = _init_program(cfg, treedef, tuple(leaves))
  except TypeError:  # an unhashable config field or sharding: built for this call only
    program = _init_program.__wrapped__(cfg, treedef, tuple(leaves))
  return abstract_model(cfg)[0], program(jax.random.key(seed))


@functools.lru_cache(maxsize=32)
def _init_program(cfg: ModelConfig, treedef, leaves: tuple):
  """The init, compiled once whatever the seed (its key is the argument): seconds on a CPU."""
  return jax.jit(lambda rng: nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=rng)))[1],
                 out_shardings=jax.tree.unflatten(treedef, leaves))


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """Shapes only (no allocation), for sharding specs and checkpoint targets."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))
