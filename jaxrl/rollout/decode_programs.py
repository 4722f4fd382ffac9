"""The slot engine's device programs: pure, jitted, fixed-shape (see `engine` for the whole).

`make_engine_fns` builds the per-request functions in the shape of JetStream's Engine API
(`init_decode_state`, `prefill`, `insert`, `generate`, plus `refresh`); `make_driver_fns` builds
the batched versions of the same computations that the host driver (`scheduler.Scheduler`)
dispatches. Both trace one `_Core`, so they give the same tokens.

All are pure and jitted; `insert`, `generate` and `refresh` (and the driver's `insert_many`,
`prefill_many` and `step`) donate the decode state or the pool, so the KV cache (the only large
buffer) is updated in place. Slot ids, request ids, sampling settings and versions are array
arguments: nothing recompiles per request, only per prefill bucket (and, for the driver, per
decode program of `Engine.programs()`).

Why each slot's cache region starts at cache slot 0 with the prompt's real tokens: positions and
cache indices then coincide (`pos`), and one per-slot index says both where the next token goes
and which position it rotates by. The model's cache write takes a single index for the batch, so
a decode step `vmap`s the model over slots (one index each); the model itself is unchanged.

Sampling follows the static sampler exactly (`static_sampler.pick_tokens`): request r draws token
t with `fold_in(fold_in(key, r), t)`, log-probs are `log_softmax(logits / T)` over the full
vocabulary. The same key and request ids therefore give the same tokens as the static sampler,
whatever the slot a request lands in or when it is admitted.

On a mesh every program pins the KV caches it returns: the decode state's slots over 'data' and
kv heads over 'tensor', the prefix pool's and a prefix's kv heads over 'tensor' (their rows stay
whole: an insert then reads its pool row on every device); see
`parallel.sharding.constrain_kv_cache`. Slot counts or heads the axes do not divide stay
replicated. The jitted functions take it as a static `mesh=None` keyword. Placement only: the
tokens are the same.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import moe
from jaxrl.models.model_config import KVCache
from jaxrl.rollout.slot_state import (DecodeState, DriverFns, Prefix, batch_axis, gather_slots,
                                      get_row, place_cache, put_row, scatter_slots)
from jaxrl.rollout.static_sampler import eos_tuple, is_eos, pick_tokens


def _decode_slots(model, layers, tok, pos, live, cache):
  """One token per slot, each at its own position and cache index -> (logits [B, V], cache,
  the fed tokens' experts [B, L, k] of a mixture-of-experts model, else None).

  The model writes a whole batch at one cache index; vmapping it over slots (a batch of one
  each) gives every slot its own index without touching the model.
  """
  axes = jax.tree.map(batch_axis, cache)

  def one(tok, pos, live, c):
    c = jax.tree.map(jnp.expand_dims, c, axes)
    m = moe.fresh(model) if model.cfg.num_experts else model  # records its routing
    hidden, c = m(tok[None, None], pos[None, None], live[None, None], c, pos, layers=layers)
    experts = moe.recorded_experts(m) if model.cfg.num_experts else None
    return (model.logits(hidden[0, 0]), jax.tree.map(jnp.squeeze, c, axes),
            None if experts is None else experts[:, 0, 0])

  return jax.vmap(one, in_axes=(0, 0, 0, axes), out_axes=(0, axes, 0))(tok, pos, live, cache)


class _Core:
  """The engine's per-prompt, per-slot and per-step computations (traced inside the jitted
  functions of `make_engine_fns` and `make_driver_fns`, which share them so that both give
  the same tokens)."""

  def __init__(self, graphdef, *, num_slots, max_prompt_len, max_new_tokens, eos_ids, pad_id,
               fused_sampling=None):
    self.graphdef, self.B, self.N = graphdef, num_slots, max_new_tokens
    self.fused = fused_sampling
    self.S = max_prompt_len + max_new_tokens
    self.eos_ids, self.pad_id = eos_tuple(eos_ids, "make_engine_fns"), pad_id

  def prefill(self, model, tokens: jax.Array, true_length: jax.Array, mesh=None) -> Prefix:
    # Right padding: the real tokens sit at cache slots and positions 0..len-1, as in a slot.
    T = tokens.shape[0]
    valid = jnp.arange(T) < true_length
    cache = place_cache(KVCache.zeros(model.cfg, 1, T), mesh, rows=False)
    hidden, cache = model(tokens[None], jnp.arange(T)[None], valid[None], cache, 0)
    logits = model.logits(jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, 0, False))
    return Prefix(place_cache(cache, mesh, rows=False), tokens, jnp.asarray(true_length, jnp.int32),
                  logits)

  def insert(self, prefix: Prefix, state: DecodeState, slot, request_id, key, temperature, top_k,
             top_p, version, mesh=None) -> DecodeState:
    S, N, pad_id = self.S, self.N, self.pad_id
    put = lambda buf, row: put_row(buf, row, slot)
    in_prompt = jnp.arange(S) < prefix.length
    # The prefix's stale tail (bucket padding) and the slot's previous request stay in the
    # cache but are masked: only [0, length) is valid.
    cache = place_cache(KVCache(jax.tree.map(put, state.cache.k, prefix.cache.k),
                           jax.tree.map(put, state.cache.v, prefix.cache.v),
                           put(state.cache.valid, in_prompt[None])), mesh)
    prompt = jnp.zeros((S,), jnp.int32).at[:prefix.tokens.shape[0]].set(prefix.tokens)
    seq = put(state.seq, jnp.where(in_prompt, prompt, pad_id)[None])
    request_key = jax.random.fold_in(key, request_id)
    tok, lp = pick_tokens(prefix.logits[None], 0, request_key[None], temperature, top_k, top_p,
                          self.fused)
    first = jnp.arange(N) == 0
    set_ = lambda buf, value: buf.at[slot].set(value)
    return DecodeState(
        cache=cache, seq=seq, pos=set_(state.pos, prefix.length), last=set_(state.last, tok[0]),
        done=set_(state.done, is_eos(tok[0], self.eos_ids) | (N <= 1)),
        count=set_(state.count, 1), request_id=set_(state.request_id, request_id),
        key=set_(state.key, request_key), temperature=set_(state.temperature, temperature),
        top_k=set_(state.top_k, top_k), top_p=set_(state.top_p, top_p),
        tokens=set_(state.tokens, jnp.where(first, tok[0], pad_id)),
        logprobs=set_(state.logprobs, jnp.where(first, lp[0], 0.0)),
        versions=set_(state.versions, jnp.where(first, version, -1)),
        routing=None if state.routing is None else set_(state.routing, -1))

  def decode(self, model, layers, states: tuple[DecodeState, ...], version, steps, mesh=None
             ) -> tuple[DecodeState, ...]:
    """Up to `steps` decode steps of every slot of each state in `states` (any number of
    slots, any cache length that holds the live slots' positions), all in one loop that stops
    early once every slot is done. Each state's cache is pinned on `mesh` in the loop carry."""
    N = self.N

    def one(s: DecodeState) -> DecodeState:
      live = ~s.done
      # Done slots still run (fixed shapes) but feed an invalid token and record nothing.
      logits, cache, experts = _decode_slots(model, layers, s.last, s.pos, live, s.cache)
      cache = place_cache(cache, mesh)
      tok, lp = pick_tokens(logits, s.count, s.key, s.temperature, s.top_k, s.top_p,
                            self.fused)
      fed = (jnp.arange(s.seq.shape[1])[None, :] == s.pos[:, None]) & live[:, None]
      new = (jnp.arange(N)[None, :] == s.count[:, None]) & live[:, None]
      count = s.count + live
      return s._replace(
          cache=cache, seq=jnp.where(fed, s.last[:, None], s.seq), pos=s.pos + live,
          last=jnp.where(live, tok, s.last),
          done=s.done | (live & (is_eos(tok, self.eos_ids) | (count >= N))), count=count,
          tokens=jnp.where(new, tok[:, None], s.tokens),
          logprobs=jnp.where(new, lp[:, None], s.logprobs),
          versions=jnp.where(new, version, s.versions),
          routing=None if experts is None else jnp.where(  # token count - 1 was fed
              ((jnp.arange(N)[None, :] == s.count[:, None] - 1) & live[:, None])[..., None, None],
              experts[:, None], s.routing))

    going = lambda c: (c[0] < steps) & ~jnp.all(jnp.concatenate([s.done for s in c[1]]))
    states = tuple(s._replace(cache=place_cache(s.cache, mesh)) for s in states)
    _, states = jax.lax.while_loop(going, lambda c: (c[0] + 1, tuple(map(one, c[1]))),
                                   (jnp.int32(0), states))
    return states

  def model(self, params):
    """(model, layers): unrolled models get their per-layer weights prepared once here rather
    than sliced in every decode step."""
    model = nnx.merge(self.graphdef, params)
    return model, (None if model.cfg.scan_layers else model.layer_weights())


def make_engine_fns(graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
                    max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
                    fused_sampling: bool | None = None):
  """The pure jitted functions of the engine: `(init_decode_state, prefill, insert, generate,
  refresh)`; see `engine`'s module docstring. Shapes are fixed by the arguments here;
  `fused_sampling` is `static_sampler.pick_tokens`'s `fused`."""
  core = _Core(graphdef, num_slots=num_slots, max_prompt_len=max_prompt_len,
               max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
               fused_sampling=fused_sampling)
  B, N, S = core.B, core.N, core.S

  @functools.partial(jax.jit, static_argnames=("mesh",))
  def init_decode_state(params, mesh=None) -> DecodeState:
    """All slots empty (done). `params` only supplies the model config (shapes of the cache);
    `mesh` splits the cache (see the module docstring)."""
    cfg = nnx.merge(graphdef, params).cfg
    zeros_i = lambda *shape: jnp.zeros(shape, jnp.int32)
    # Every field its own buffer: the state is donated, and XLA refuses to donate one buffer
    # twice.
    return DecodeState(
        cache=place_cache(KVCache.zeros(cfg, B, S), mesh), seq=jnp.full((B, S), pad_id, jnp.int32),
        pos=zeros_i(B),
        last=zeros_i(B), done=jnp.ones((B,), bool), count=zeros_i(B), request_id=zeros_i(B),
        key=jax.random.split(jax.random.key(0), B), temperature=jnp.ones((B,), jnp.float32),
        top_k=zeros_i(B), top_p=jnp.ones((B,), jnp.float32),
        tokens=jnp.full((B, N), pad_id, jnp.int32), logprobs=jnp.zeros((B, N), jnp.float32),
        versions=jnp.full((B, N), -1, jnp.int32),
        routing=jnp.full((B, N, cfg.num_layers, cfg.num_experts_per_tok), -1,
                         moe.ROUTING_DTYPE) if cfg.num_experts else None)

  @functools.partial(jax.jit, static_argnames=("mesh",))
  def prefill(params, tokens: jax.Array, true_length: jax.Array, mesh=None) -> Prefix:
    return core.prefill(nnx.merge(graphdef, params), tokens, true_length, mesh)

  def generate(params, state: DecodeState, version, steps, mesh=None) -> DecodeState:
    model, layers = core.model(params)
    return core.decode(model, layers, (state,), version, steps, mesh)[0]

  def refresh(params, state: DecodeState, mesh=None) -> DecodeState:
    # One forward over every slot's held tokens (prompt + fed completion, cache slots < pos)
    # rebuilds the whole cache under `params`; `last` is fed by the next step as usual.
    model = nnx.merge(graphdef, params)
    valid = jnp.arange(S)[None, :] < state.pos[:, None]
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    empty = place_cache(KVCache.zeros(model.cfg, B, S), mesh)
    _, cache = model(state.seq, positions, valid, empty, 0)
    experts = moe.recorded_experts(model)
    if experts is not None:
      # The fed completion tokens' experts under `params` too: token j of a slot sits at cache
      # slot pos - count + 1 + j, and tokens j < count - 1 have been fed.
      j = jnp.arange(N)[None, :]
      at = jnp.clip(state.pos[:, None] - state.count[:, None] + 1 + j, 0, S - 1)  # [B, N]
      now = jnp.take_along_axis(jnp.moveaxis(experts, 0, 2), at[..., None, None], axis=1)
      fed = (j < state.count[:, None] - 1) & ~state.done[:, None]
      state = state._replace(routing=jnp.where(fed[..., None, None], now, state.routing))
    return state._replace(cache=place_cache(cache, mesh))

  # The decode state (and with it the KV cache) is donated: each call updates it in place
  # instead of copying the cache, and the caller never touches the old state again.
  jit = functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("mesh",))
  return init_decode_state, prefill, jit(core.insert), jit(generate), jit(refresh)


def make_driver_fns(graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
                    max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
                    pool_rows: int, fused_sampling: bool | None = None) -> DriverFns:
  """Batched versions of `prefill`, `insert` and `generate` for a host driver, one dispatch
  however many prompts or rows each handles (see `engine`'s module docstring):

  - `prefill_many` prefills the first `n` of Q prompts (one length bucket T, right-padded)
    into rows `rows` of a prefix pool of Q = `pool_rows` prompts at `max_prompt_len` cache
    slots;
  - `insert_many` inserts the first `m` of B admissions, each from a pool row into a slot
    (`admit_i` rows: slot, pool row, request id, top_k, version; `admit_f`: temperature,
    top_p);
  - `step` runs `generate` on groups of slots (static `groups`: one program each): group g is
    `groups[g][0]` slots of `idx` (in order), gathered out of the state with the KV cache cut to
    its first `groups[g][1]` cache slots (None: all of it) and written back after; all groups
    advance in the same loop. `((B, None),)` decodes the state in place (`idx` unused). It
    returns the state and a snapshot for the host ([2, B] int32 done | count, tokens, logprobs,
    versions: fresh buffers, which the host reads while the donated state goes on to the next
    dispatch).

  `insert_many` donates the pool and returns it, so a later prefill into a row it read runs
  after it (a data dependency, not an ordering guarantee of the runtime). Each prompt and row is
  computed exactly as `prefill` and `insert` compute it (a loop inside one program, not a
  batched matmul), so tokens and log-probs do not depend on how many share a call. A group's
  windowed cache must hold every position its live slots reach within the dispatch.
  """
  core = _Core(graphdef, num_slots=num_slots, max_prompt_len=max_prompt_len,
               max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
               fused_sampling=fused_sampling)
  B, Q, Lmax = core.B, pool_rows, max_prompt_len

  @functools.partial(jax.jit, static_argnames=("mesh",))
  def init_pool(params, mesh=None) -> Prefix:
    cfg = nnx.merge(graphdef, params).cfg
    return Prefix(place_cache(KVCache.zeros(cfg, Q, Lmax), mesh, rows=False),
                  jnp.full((Q, Lmax), pad_id, jnp.int32), jnp.ones((Q,), jnp.int32),
                  jnp.zeros((Q, cfg.vocab_size), jnp.float32))

  def prefill_many(params, pool: Prefix, tokens, lengths, rows, n, mesh=None) -> Prefix:
    model = nnx.merge(graphdef, params)

    def one(i, pool):
      prefix, row = core.prefill(model, tokens[i], lengths[i], mesh), rows[i]
      put = lambda buf, x: put_row(buf, x, row)
      cache = KVCache(jax.tree.map(put, pool.cache.k, prefix.cache.k),
                      jax.tree.map(put, pool.cache.v, prefix.cache.v), pool.cache.valid)
      return Prefix(place_cache(cache, mesh, rows=False), put(pool.tokens, prefix.tokens[None]),
                    pool.length.at[row].set(prefix.length), pool.logits.at[row].set(prefix.logits))

    pool = pool._replace(cache=place_cache(pool.cache, mesh, rows=False))
    return jax.lax.fori_loop(0, n, one, pool)

  def insert_many(pool: Prefix, state: DecodeState, admit_i, admit_f, m, key, mesh=None):
    def one(j, state):
      row = admit_i[1, j]
      get = lambda x: get_row(x, row)
      prefix = Prefix(KVCache(jax.tree.map(get, pool.cache.k), jax.tree.map(get, pool.cache.v),
                              pool.cache.valid), pool.tokens[row], pool.length[row],
                      pool.logits[row])
      return core.insert(prefix, state, admit_i[0, j], admit_i[2, j], key, admit_f[0, j],
                         admit_i[3, j], admit_f[1, j], admit_i[4, j], mesh)

    state = state._replace(cache=place_cache(state.cache, mesh))
    return pool, jax.lax.fori_loop(0, m, one, state)

  def step(params, state: DecodeState, idx, version, steps, *,
           groups: tuple[tuple[int, int | None], ...], mesh=None):
    model, layers = core.model(params)
    if groups == ((B, None),):
      state, = core.decode(model, layers, (state,), version, steps, mesh)
    else:
      at = np.cumsum([0] + [n for n, _ in groups])
      ids = [idx[at[g]:at[g + 1]] for g in range(len(groups))]
      subs = core.decode(model, layers, tuple(gather_slots(state, i, w) for i, (_, w) in zip(
          ids, groups)), version, steps, mesh)
      for i, sub in zip(ids, subs):
        state = scatter_slots(state, sub, i)
      state = state._replace(cache=place_cache(state.cache, mesh))
    snapshot = (jnp.stack([state.done.astype(jnp.int32), state.count]), state.tokens,
                state.logprobs, state.versions, state.routing)
    return state, snapshot

  return DriverFns(init_pool,
                   jax.jit(prefill_many, donate_argnums=(1,), static_argnames=("mesh",)),
                   jax.jit(insert_many, donate_argnums=(0, 1), static_argnames=("mesh",)),
                   jax.jit(step, static_argnames=("groups", "mesh"), donate_argnums=(1,)))
