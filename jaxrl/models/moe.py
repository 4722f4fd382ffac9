"""Mixture-of-experts MLP (Qwen3-MoE), as pure functions of arrays.

A layer's MLP is E SwiGLU experts. The router (float32 logits and softmax, whatever the compute
dtype) gives each token a probability per expert; the token goes to its k most probable experts
(`num_experts_per_tok`), whose outputs are summed weighted by those probabilities, renormalised
to sum 1 when `norm_topk_prob` is set. Every token reaches all k of its experts (dropless: no
capacity, nothing dropped).

Dispatch: the token-expert assignments are sorted by expert and each expert's products run over
its own rows only (`grouped_matmul`), so the FLOPs scale with k, not with E:
- "ragged_dot": `jax.lax.ragged_dot`, XLA's grouped matmul on GPU and TPU. On CPU JAX lowers it
  to a masked product over every expert for every row (E times the work), hence
- "blocked": rows padded per expert to whole tiles of `tile_rows(...)` rows, each tile one
  batched product with its expert's weight (at most E - 1 partly filled tiles of extra work).
- "auto": "blocked" on CPU, "ragged_dot" elsewhere.

`moe_mlp` also returns the layer's routing statistics (`RouterStats`); `aux_loss` turns the
statistics of every layer into the load-balancing loss (the Switch Transformer form).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core import platform
from jaxrl.models.model_config import MOE_DISPATCHES

# Recorded experts per token (routing replay): -1 where none was recorded.
ROUTING_DTYPE = jnp.int16


class RouterStats(NamedTuple):
  """One layer's routing over the valid tokens of a forward pass (stacked [L, ...] over layers)."""

  counts: jax.Array  # [E] float32: top-k assignments per expert
  probs: jax.Array  # [E] float32: router probabilities summed per expert
  tokens: jax.Array  # [] float32: valid tokens routed
  experts: jax.Array  # [B, T, k] int32: each token's own top-k experts, most probable first
  # Of the valid tokens with recorded experts (`recorded`, routing replay's input): those whose
  # own top-k (as a set) differs from the recorded one, and those whose experts used differ
  # from it (the same without replay, 0 with it): `routing_mismatch`.
  mismatched: jax.Array | float = 0.0
  recorded: jax.Array | float = 0.0
  used_mismatched: jax.Array | float = 0.0
  # Valid tokens' assignments dropped by the capacity (`moe_capacity_factor`; 0 when dropless).
  dropped: jax.Array | float = 0.0


def resolve_dispatch(choice: str, backend: str | None = None) -> str:
  """The grouped matmul of `ModelConfig.moe_dispatch` `choice` on `backend` (None: JAX's default,
  read when traced): "auto" is "blocked" on CPU and "ragged_dot" elsewhere."""
  if choice not in MOE_DISPATCHES:
    raise ValueError(f"moe_dispatch={choice!r} is not one of {MOE_DISPATCHES}")
  if choice != "auto":
    return choice
  backend = platform.current() if backend is None else backend
  return "blocked" if backend == "cpu" else "ragged_dot"


def tile_rows(rows: int, experts: int) -> int:
  """Rows per tile of the "blocked" product for `rows` sorted assignments over `experts`: a power
  of two near a quarter of the mean rows per expert, between 8 and 128 (so the padding, at most
  E - 1 partial tiles, stays a fraction of the rows)."""
  target = max(rows // (4 * experts), 1)
  return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, impl: str) -> jax.Array:
  """x [M, K] rows sorted by group times w [E, K, N], rows of group e (`group_sizes` [E], summing
  to M) by w[e]: [M, N] in x's dtype."""
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(x, w, group_sizes)
  if impl != "blocked":
    raise ValueError(f"grouped matmul {impl!r} is not one of ('ragged_dot', 'blocked')")
  m, e = x.shape[0], w.shape[0]
  b = tile_rows(m, e)
  n_tiles = -(-m // b) + e  # an upper bound: every group rounds up to whole tiles
  per_group = (group_sizes + b - 1) // b
  tile_end = jnp.cumsum(per_group)
  tile_start = tile_end - per_group
  row_start = jnp.cumsum(group_sizes) - group_sizes
  tile = jnp.arange(n_tiles)
  # Unused tiles past the last group get expert E - 1 and no valid rows.
  expert = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), e - 1)
  j = (tile - tile_start[expert])[:, None] * b + jnp.arange(b)[None, :]  # [tiles, b]
  ok = j < group_sizes[expert][:, None]
  src = jnp.where(ok, row_start[expert][:, None] + j, 0)
  xt = jnp.where(ok[..., None], x[src], 0).astype(x.dtype)  # [tiles, b, K]
  yt = jnp.einsum("tbk,tkn->tbn", xt, w[expert])  # [tiles, b, N]
  # Each sorted row's tile and slot.
  r = jnp.arange(m)
  g = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), r, side="right"), e - 1)
  jr = r - row_start[g]
  return yt[tile_start[g] + jr // b, jr % b]


def route(x: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(probs [N, E], weights [N, k], experts [N, k]) of tokens x [N, D] under `router` [D, E]:
  float32 logits and softmax, the k most probable experts (highest first), their probabilities
  (renormalised to sum 1 with `norm_topk_prob`)."""
  logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return probs, weights, experts


def moe_mlp(x: jax.Array, p: dict, cfg, valid: jax.Array | None,
            replay: jax.Array | None = None, use: bool = True) -> tuple[jax.Array, RouterStats]:
  """The experts' MLP of a layer's normed input x [B, T, D] with the layer's weights `p`
  (`router` [D, E], `we_gate`/`we_up` [E, D, F], `we_down` [E, F, D]); `valid` [B, T] (None: all)
  marks the tokens counted in the statistics. `replay` [B, T, k] (routing replay): recorded
  experts per token, -1 where none was recorded. With `use`, each token with recorded experts
  goes to them instead of its own top-k, weighted by this router's probabilities of them
  (renormalised as `norm_topk_prob` says), so the router still gets its gradient; without,
  they are only compared with the router's own choice (the statistics). Returns
  ([B, T, D] in x's dtype, RouterStats)."""
  bsz, t, d = x.shape
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  impl = resolve_dispatch(cfg.moe_dispatch)
  xf = x.reshape(-1, d)
  n = xf.shape[0]
  probs, weights, own = route(xf, p["router"], k, cfg.norm_topk_prob)
  experts = own
  w = jnp.ones((n,), jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
  zero = jnp.zeros((), jnp.float32)
  mismatched, recorded, used_mismatched = zero, zero, zero
  if replay is not None:
    given = replay.reshape(n, k).astype(own.dtype)
    known = jnp.all(given >= 0, axis=-1)
    if use:
      experts = jnp.where(known[:, None], given, own)
      weights = jnp.take_along_axis(probs, experts, axis=-1)
      if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    as_set = lambda a: jnp.sort(a, axis=-1)
    counted = w * known
    recorded = jnp.sum(counted)
    mismatched = jnp.sum(jnp.any(as_set(own) != as_set(given), axis=-1) * counted)
    used_mismatched = jnp.sum(jnp.any(as_set(experts) != as_set(given), axis=-1) * counted)
  flat = experts.reshape(-1)  # [N k]: assignment a is token a // k's choice a % k
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
  xs = xf[order // k]
  gate = grouped_matmul(xs, p["we_gate"], group_sizes, impl)
  up = grouped_matmul(xs, p["we_up"], group_sizes, impl)
  ys = grouped_matmul(jax.nn.silu(gate) * up, p["we_down"], group_sizes, impl)
  back = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
  y = ys[back].reshape(n, k, d)
  dropped = jnp.zeros((), jnp.float32)
  if cfg.moe_capacity_factor:
    # An assignment's rank among its expert's (token order): beyond the capacity it is dropped.
    cap = math.ceil(cfg.moe_capacity_factor * n * k / e)
    rank = back - (jnp.cumsum(group_sizes) - group_sizes)[flat]
    keep = (rank < cap).reshape(n, k)
    weights = jnp.where(keep, weights, 0.0)
    dropped = jnp.sum(~keep * w[:, None])
  out = jnp.sum(y * weights.astype(x.dtype)[..., None], axis=1)
  counts = jnp.zeros((e,), jnp.float32).at[flat].add(jnp.repeat(w, k))
  stats = RouterStats(counts, jnp.sum(probs * w[:, None], axis=0), jnp.sum(w),
                      own.reshape(bsz, t, k).astype(jnp.int32), mismatched, recorded,
                      used_mismatched, dropped)
  return out.reshape(bsz, t, d).astype(x.dtype), stats


def aux_loss(stats: RouterStats, num_experts: int) -> jax.Array:
  """The load-balancing loss of a forward pass's per-layer statistics (stacked [L, ...]):
  `E * sum_e f_e P_e`, with f_e the top-k assignments to expert e per routed token and P_e its
  mean router probability, both pooled over layers: k for perfectly even routing and
  probabilities, up to E when every token goes to the same experts."""
  tokens = jnp.maximum(jnp.sum(stats.tokens), 1.0)
  f = jnp.sum(stats.counts.reshape(-1, num_experts), axis=0) / tokens
  prob = jnp.sum(stats.probs.reshape(-1, num_experts), axis=0) / tokens
  return num_experts * jnp.sum(f * prob)


def routing_mismatch(stats: RouterStats, used: bool = False) -> tuple[jax.Array, jax.Array]:
  """(overall, per layer [L]) fraction of the valid tokens with recorded experts whose own top-k
  (`used`: the experts the layer used) differs from the recorded one, as a set, of one forward
  pass's statistics (stacked [L, ...]); overall pools tokens and layers. 0 without a record."""
  diff = stats.used_mismatched if used else stats.mismatched
  per_layer = diff / jnp.maximum(stats.recorded, 1.0)
  return jnp.sum(diff) / jnp.maximum(jnp.sum(stats.recorded), 1.0), per_layer


def recorded_experts(model) -> jax.Array | None:
  """The experts [L, B, T, k] int16 each token of `model`'s last forward pass went to (the
  sampler's record for routing replay); None for a dense model. `model` must have been merged
  inside the trace that called it (`fresh`)."""
  stats = pop_router_stats(model)
  return None if not stats else stats[-1].experts.astype(ROUTING_DTYPE)


def fresh(model):
  """A copy of `model` (a `Transformer`) owned by the current trace, so a call inside a loop or
  `vmap` body can record its router statistics (`recorded_experts`)."""
  from flax import nnx

  return nnx.merge(*nnx.split(model))


def pooled_aux_loss(passes: list[RouterStats]) -> jax.Array:
  """`aux_loss` over the statistics of several forward passes (e.g. a prompt pass and a
  completion pass) pooled as one."""
  e = passes[0].counts.shape[-1]
  cat = lambda f: jnp.concatenate([getattr(s, f).reshape(-1, e) for s in passes])
  tokens = jnp.concatenate([s.tokens.reshape(-1) for s in passes])
  return aux_loss(RouterStats(cat("counts"), cat("probs"), tokens, passes[0].experts), e)


def expert_shapes(cfg) -> dict[str, tuple[int, ...]]:
  """Per-layer shapes of the MoE weights (without the leading layer axis)."""
  d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size
  return {"router": (d, e), "we_gate": (e, d, f), "we_up": (e, d, f), "we_down": (e, f, d)}


def pop_router_stats(model) -> list[RouterStats]:
  """The router statistics of every forward pass `model` (a `Transformer`, inside the same trace)
  ran since the last call, oldest first, each stacked [L, ...]; removes them from the model.
  Empty for a dense model."""
  from flax import nnx

  state = nnx.pop(model, nnx.Intermediate)
  leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, RouterStats))
  return [x for x in leaves if isinstance(x, RouterStats)]
