"""The records the slot engine's device programs and its host-side scheduler share, and the
helpers that move slot rows in and out of them.

`Prefix` is one prefilled prompt (or, with a leading axis, the driver's prefix pool);
`DecodeState` is everything the slots carry between dispatches; `DriverFns` names the batched
programs `engine.Engine.run` drives. Both `decode_programs` (which builds and traces them) and
`scheduler` (which only passes them from one dispatch to the next) import them from here, so
neither depends on the other or on `engine`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.models.model_config import KVCache
from jaxrl.parallel.sharding import ROLLOUT_ROW_AXES, constrain_kv_cache


class Prefix(NamedTuple):
  """One prefilled prompt, ready to be inserted into any number of slots. The driver's prefix
  pool (`decode_programs.make_driver_fns`) has the same fields with a leading axis of pool rows."""

  cache: KVCache  # batch axis of 1, `bucket` cache slots; real tokens in [0, length)
  tokens: jax.Array  # [bucket] int32, the prompt right-padded
  length: jax.Array  # int32 scalar, the number of real tokens
  logits: jax.Array  # [V] float32 after the last real token (draws the first new token)


class DecodeState(NamedTuple):
  """Everything the slots carry between dispatches; B = num_slots, S = max_prompt_len + N."""

  cache: KVCache  # [.., B, .., S]: slot b's prompt then completion at cache slots 0..
  seq: jax.Array  # [B, S] int32: the tokens held in the cache (prompt, then fed completion)
  pos: jax.Array  # [B] int32: position and cache slot where `last` goes next
  last: jax.Array  # [B] int32: the newest token, drawn but not yet fed
  done: jax.Array  # [B] bool: the slot records nothing (ended, or never filled)
  count: jax.Array  # [B] int32: tokens generated so far (the next one's index t)
  request_id: jax.Array  # [B] int32
  key: jax.Array  # [B] typed PRNG keys, fold_in(key, request_id)
  temperature: jax.Array  # [B] float32 (<= 0: greedy)
  top_k: jax.Array  # [B] int32 (0: off)
  top_p: jax.Array  # [B] float32 (1: off)
  tokens: jax.Array  # [B, N] int32, pad_id after the last generated token
  logprobs: jax.Array  # [B, N] float32, 0 after the last generated token
  versions: jax.Array  # [B, N] int32: params version that produced each token, -1 after
  # Mixture-of-experts models: [B, N, L, k] int16, the experts each token went to when it was
  # fed (routing replay), -1 where not fed yet; None for a dense model.
  routing: jax.Array | None = None


class DriverFns(NamedTuple):
  """The batched functions `Engine.run` drives (see `decode_programs.make_driver_fns`)."""

  # Each also takes a static `mesh=None` keyword: the mesh its KV caches are split over.
  init_pool: Callable  # (params) -> Prefix pool of Q rows
  prefill_many: Callable  # (params, pool, tokens [Q, T], lengths [Q], rows [Q], n) -> pool
  insert_many: Callable  # (pool, state, admit_i [5, B], admit_f [2, B], m, key) -> pool, state
  step: Callable  # (params, state, idx, version, steps, *, groups) -> (state, snapshot)


def batch_axis(x: jax.Array) -> int:
  """The slot (batch) axis of a KV cache leaf: 4th from the end of k/v in either layout
  (stacked [L, B, K, ., .] or per layer [B, K, ., .]); first of `valid` [B, S]."""
  return x.ndim - 4 if x.ndim >= 4 else 0


def put_row(buf: jax.Array, row: jax.Array, slot: jax.Array) -> jax.Array:
  """Writes `row` (batch axis of 1, maybe shorter along the last axes) into `buf` at `slot`."""
  axis = batch_axis(buf)
  starts = [jnp.int32(0)] * buf.ndim
  starts[axis] = slot
  return jax.lax.dynamic_update_slice(buf, row.astype(buf.dtype), starts)


def get_row(buf: jax.Array, row: jax.Array) -> jax.Array:
  """Row `row` of `buf` along its batch axis, keeping that axis (size 1)."""
  return jax.lax.dynamic_slice_in_dim(buf, row, 1, axis=batch_axis(buf))


# Fields a decode dispatch changes; the rest (request id, key, sampling settings) it only reads.
_DECODED = ("cache", "seq", "pos", "last", "done", "count", "tokens", "logprobs", "versions",
            "routing")


def gather_slots(state: DecodeState, idx: jax.Array, window: int | None = None) -> DecodeState:
  """The sub-state of slots `idx`, with the KV cache and `seq` cut to their first `window`
  cache slots (None: all)."""
  if window is not None:
    cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, window, axis=axis)
    k, v = state.cache.k, state.cache.v
    state = state._replace(seq=cut(state.seq, 1), cache=KVCache(
        jax.tree.map(lambda x: cut(x, x.ndim - 1), k),
        jax.tree.map(lambda x: cut(x, x.ndim - 2), v), cut(state.cache.valid, 1)))
  return jax.tree.map(lambda x: jnp.take(x, idx, batch_axis(x)), state)


def scatter_slots(state: DecodeState, sub: DecodeState, idx: jax.Array) -> DecodeState:
  """Writes a decoded `gather_slots` sub-state (any window) back into `state` (in place under
  donation)."""
  def put(x, y):
    ax = batch_axis(x)
    return x.at[tuple(idx if i == ax else slice(0, n) for i, n in enumerate(y.shape))].set(y)
  return state._replace(**{f: jax.tree.map(put, getattr(state, f), getattr(sub, f))
                           for f in _DECODED})


def place_cache(cache: KVCache, mesh, rows: bool = True) -> KVCache:
  """`cache` pinned on `mesh` (None: as it is): slots over 'data' (`rows`, else whole) and kv heads
  over 'tensor'."""
  if mesh is None:
    return cache
  return constrain_kv_cache(cache, mesh, ROLLOUT_ROW_AXES if rows else ())

