"""Continuous-batching decode engine: fixed slots that each advance on their own.

The static sampler (`sampler.make_sampler`) decodes a whole batch in lockstep: the batch is as
slow as its longest row, and rows that ended early idle until then. This engine keeps
`num_slots` requests in flight and refills a slot as soon as its request ends, in the shape of
JetStream's Engine API (`init_decode_state`, `prefill`, `insert`, `generate`) so that an adapter
to it, or to MaxText's OfflineEngine-style drivers, stays thin:

- `prefill(params, tokens, true_length) -> Prefix` runs one prompt, right-padded to a length
  bucket (powers of two up to `max_prompt_len`), so prompt lengths compile a bounded number of
  programs. The prefix holds the prompt's KV and the logits after its last real token.
- `insert(prefix, state, slot, request_id, key, temperature, top_k, top_p, version)` copies the
  prefix into a slot and draws the slot's first token from the prefix's logits with the
  request's own RNG, so the G samples of one prompt share one prefill and differ only by
  request id.
- `generate(params, state, version, steps)` runs up to `steps` decode steps in one dispatch
  (a `lax.while_loop` that also stops once every slot is done). Each slot has its own position,
  cache index, token count, EOS test (any of several ids) and `max_new_tokens` budget; a done
  slot records nothing. Every produced token records its log-prob and the params `version` of
  the dispatch that produced it.
- `refresh(params, state)` recomputes every slot's KV under new params (partial rollouts, below).

All four are pure and jitted; `insert`, `generate` and `refresh` donate the decode state, so the
KV cache (the only large buffer) is updated in place. Slot ids, request ids, sampling settings
and versions are array arguments: nothing recompiles per request, only per prefill bucket (and,
in `Engine.run`, per decode program of `Engine.programs()`).

Why each slot's cache region starts at cache slot 0 with the prompt's real tokens: positions and
cache indices then coincide (`pos`), and one per-slot index says both where the next token goes
and which position it rotates by. The model's cache write takes a single index for the batch, so
a decode step `vmap`s the model over slots (one index each); the model itself is unchanged.

Sampling follows the static sampler exactly (`sampler.pick_tokens`): request r draws token t
with `fold_in(fold_in(key, r), t)`, log-probs are `log_softmax(logits / T)` over the full
vocabulary. The same key and request ids therefore give the same tokens as the static sampler,
whatever the slot a request lands in or when it is admitted.

On a mesh (the one the params are placed on: the rollout mesh, the train mesh when colocated, or
on several processes this process's own devices, where the params are published for its rollout
thread) every program pins the KV caches it returns: the decode state's slots over 'data' and kv
heads over 'tensor', the prefix pool's and a prefix's kv heads over 'tensor' (their rows stay
whole: an insert then reads its pool row on every device); see
`parallel.sharding.constrain_kv_cache`.
Slot counts or heads the axes do not divide stay replicated. The jitted functions take it as a
static `mesh=None` keyword; `Engine` passes the mesh of the params it is given. Placement only:
the tokens are the same.

`Engine.run` is the host-side driver (`scheduler.Scheduler`): it reads each dispatch's snapshot
with plain host copies, so its mesh must be this process's own devices (every array fully
addressable; no program it launches involves another process). It keeps every slot busy, streams
finished groups to `on_finish`, and returns rows in request order in the sampler's format plus
per-token versions. It drives batched versions of the same computations (`make_driver_fns`):
prompts prefilled ahead into a pool, one insert dispatch per round of admissions, and for each
decode dispatch the program `Engine.plan` picks (fewer slots, or a shorter cache window, when
that is all the occupied slots need).

With `compact=False` only the full program runs, and the outputs are bit-identical to one
`prefill` per prompt, one `insert` per row and `generate` over all slots (tested). The other
programs give the same tokens; their log-probs differ in float rounding (up to ~1e-6: the
matmuls and attention sums run over other shapes), well inside the log-prob contract.

Partial rollouts (`run(..., params_source=...)`): between dispatches the driver asks the source
for `(version, params)`. On a new version it switches: later tokens are produced and stamped with
it. By default (`refresh_kv=True`) it first recomputes the KV of every in-flight slot (its prompt
and the tokens generated so far) under the new params, so a token stamped v is exactly a sample
of policy v given its prefix and its log-prob is that policy's, which the trainer's off-policy
corrections assume. `refresh_kv=False` keeps the stale KV (cheaper, PipelineRL-style): the
prefix's keys/values then mix versions and the stamp is only approximate.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.transformer import KVCache
from jaxrl.parallel.sharding import ROLLOUT_ROW_AXES, constrain_kv_cache, mesh_of
from jaxrl.rollout.static_sampler import eos_tuple, is_eos, pick_tokens
from jaxrl.rollout.scheduler import EngineOutput, Requests, Scheduler


class Prefix(NamedTuple):
  """One prefilled prompt, ready to be inserted into any number of slots. The driver's prefix
  pool (`make_driver_fns`) has the same fields with a leading axis of pool rows."""

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


def default_buckets(max_prompt_len: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` (or less if the limit is smaller) up to and including
  `max_prompt_len`: at most log2(max) prefill programs, each prompt padded by less than 2x."""
  out, b = [], min(smallest, max_prompt_len)
  while b < max_prompt_len:
    out.append(b)
    b *= 2
  return tuple(out) + (max_prompt_len,)


def _batch_axis(x: jax.Array) -> int:
  """The slot (batch) axis of a KV cache leaf: 4th from the end of k/v in either layout
  (stacked [L, B, K, ., .] or per layer [B, K, ., .]); first of `valid` [B, S]."""
  return x.ndim - 4 if x.ndim >= 4 else 0


def _put_row(buf: jax.Array, row: jax.Array, slot: jax.Array) -> jax.Array:
  """Writes `row` (batch axis of 1, maybe shorter along the last axes) into `buf` at `slot`."""
  axis = _batch_axis(buf)
  starts = [jnp.int32(0)] * buf.ndim
  starts[axis] = slot
  return jax.lax.dynamic_update_slice(buf, row.astype(buf.dtype), starts)


def _get_row(buf: jax.Array, row: jax.Array) -> jax.Array:
  """Row `row` of `buf` along its batch axis, keeping that axis (size 1)."""
  return jax.lax.dynamic_slice_in_dim(buf, row, 1, axis=_batch_axis(buf))


# Fields a decode dispatch changes; the rest (request id, key, sampling settings) it only reads.
_DECODED = ("cache", "seq", "pos", "last", "done", "count", "tokens", "logprobs", "versions")


def _gather(state: DecodeState, idx: jax.Array, window: int | None = None) -> DecodeState:
  """The sub-state of slots `idx`, with the KV cache and `seq` cut to their first `window`
  cache slots (None: all)."""
  if window is not None:
    cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, window, axis=axis)
    k, v = state.cache.k, state.cache.v
    state = state._replace(seq=cut(state.seq, 1), cache=KVCache(
        jax.tree.map(lambda x: cut(x, x.ndim - 1), k),
        jax.tree.map(lambda x: cut(x, x.ndim - 2), v), cut(state.cache.valid, 1)))
  return jax.tree.map(lambda x: jnp.take(x, idx, _batch_axis(x)), state)


def _scatter(state: DecodeState, sub: DecodeState, idx: jax.Array) -> DecodeState:
  """Writes a decoded `_gather` sub-state (any window) back into `state` (in place under
  donation)."""
  def put(x, y):
    ax = _batch_axis(x)
    return x.at[tuple(idx if i == ax else slice(0, n) for i, n in enumerate(y.shape))].set(y)
  return state._replace(**{f: jax.tree.map(put, getattr(state, f), getattr(sub, f))
                           for f in _DECODED})


def _place(cache: KVCache, mesh, rows: bool = True) -> KVCache:
  """`cache` pinned on `mesh` (None: as it is): slots over 'data' (`rows`, else whole) and kv heads
  over 'tensor'."""
  if mesh is None:
    return cache
  return constrain_kv_cache(cache, mesh, ROLLOUT_ROW_AXES if rows else ())


def _decode_slots(model, layers, tok, pos, live, cache):
  """One token per slot, each at its own position and cache index -> (logits [B, V], cache).

  The model writes a whole batch at one cache index; vmapping it over slots (a batch of one
  each) gives every slot its own index without touching the model.
  """
  axes = jax.tree.map(_batch_axis, cache)

  def one(tok, pos, live, c):
    c = jax.tree.map(jnp.expand_dims, c, axes)
    hidden, c = model(tok[None, None], pos[None, None], live[None, None], c, pos, layers=layers)
    return model.logits(hidden[0, 0]), jax.tree.map(jnp.squeeze, c, axes)

  return jax.vmap(one, in_axes=(0, 0, 0, axes), out_axes=(0, axes))(tok, pos, live, cache)


class _Core:
  """The engine's per-prompt, per-slot and per-step computations (traced inside the jitted
  functions of `make_engine_fns` and `make_driver_fns`, which share them so that both give
  the same tokens)."""

  def __init__(self, graphdef, *, num_slots, max_prompt_len, max_new_tokens, eos_ids, pad_id):
    self.graphdef, self.B, self.N = graphdef, num_slots, max_new_tokens
    self.S = max_prompt_len + max_new_tokens
    self.eos_ids, self.pad_id = eos_tuple(eos_ids, "make_engine_fns"), pad_id

  def prefill(self, model, tokens: jax.Array, true_length: jax.Array, mesh=None) -> Prefix:
    # Right padding: the real tokens sit at cache slots and positions 0..len-1, as in a slot.
    T = tokens.shape[0]
    valid = jnp.arange(T) < true_length
    cache = _place(KVCache.zeros(model.cfg, 1, T), mesh, rows=False)
    hidden, cache = model(tokens[None], jnp.arange(T)[None], valid[None], cache, 0)
    logits = model.logits(jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, 0, False))
    return Prefix(_place(cache, mesh, rows=False), tokens, jnp.asarray(true_length, jnp.int32),
                  logits)

  def insert(self, prefix: Prefix, state: DecodeState, slot, request_id, key, temperature, top_k,
             top_p, version, mesh=None) -> DecodeState:
    S, N, pad_id = self.S, self.N, self.pad_id
    put = lambda buf, row: _put_row(buf, row, slot)
    in_prompt = jnp.arange(S) < prefix.length
    # The prefix's stale tail (bucket padding) and the slot's previous request stay in the
    # cache but are masked: only [0, length) is valid.
    cache = _place(KVCache(jax.tree.map(put, state.cache.k, prefix.cache.k),
                           jax.tree.map(put, state.cache.v, prefix.cache.v),
                           put(state.cache.valid, in_prompt[None])), mesh)
    prompt = jnp.zeros((S,), jnp.int32).at[:prefix.tokens.shape[0]].set(prefix.tokens)
    seq = put(state.seq, jnp.where(in_prompt, prompt, pad_id)[None])
    request_key = jax.random.fold_in(key, request_id)
    tok, lp = pick_tokens(prefix.logits[None], 0, request_key[None], temperature, top_k, top_p)
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
        versions=set_(state.versions, jnp.where(first, version, -1)))

  def decode(self, model, layers, states: tuple[DecodeState, ...], version, steps, mesh=None
             ) -> tuple[DecodeState, ...]:
    """Up to `steps` decode steps of every slot of each state in `states` (any number of
    slots, any cache length that holds the live slots' positions), all in one loop that stops
    early once every slot is done. Each state's cache is pinned on `mesh` in the loop carry."""
    N = self.N

    def one(s: DecodeState) -> DecodeState:
      live = ~s.done
      # Done slots still run (fixed shapes) but feed an invalid token and record nothing.
      logits, cache = _decode_slots(model, layers, s.last, s.pos, live, s.cache)
      cache = _place(cache, mesh)
      tok, lp = pick_tokens(logits, s.count, s.key, s.temperature, s.top_k, s.top_p)
      fed = (jnp.arange(s.seq.shape[1])[None, :] == s.pos[:, None]) & live[:, None]
      new = (jnp.arange(N)[None, :] == s.count[:, None]) & live[:, None]
      count = s.count + live
      return s._replace(
          cache=cache, seq=jnp.where(fed, s.last[:, None], s.seq), pos=s.pos + live,
          last=jnp.where(live, tok, s.last),
          done=s.done | (live & (is_eos(tok, self.eos_ids) | (count >= N))), count=count,
          tokens=jnp.where(new, tok[:, None], s.tokens),
          logprobs=jnp.where(new, lp[:, None], s.logprobs),
          versions=jnp.where(new, version, s.versions))

    going = lambda c: (c[0] < steps) & ~jnp.all(jnp.concatenate([s.done for s in c[1]]))
    states = tuple(s._replace(cache=_place(s.cache, mesh)) for s in states)
    _, states = jax.lax.while_loop(going, lambda c: (c[0] + 1, tuple(map(one, c[1]))),
                                   (jnp.int32(0), states))
    return states

  def model(self, params):
    """(model, layers): unrolled models get their per-layer weights prepared once here rather
    than sliced in every decode step."""
    model = nnx.merge(self.graphdef, params)
    return model, (None if model.cfg.scan_layers else model.layer_weights())


def make_engine_fns(graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
                    max_new_tokens: int, eos_ids: Sequence[int], pad_id: int):
  """The pure jitted functions of the engine: `(init_decode_state, prefill, insert, generate,
  refresh)`; see the module docstring. Shapes are fixed by the arguments here."""
  core = _Core(graphdef, num_slots=num_slots, max_prompt_len=max_prompt_len,
               max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
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
        cache=_place(KVCache.zeros(cfg, B, S), mesh), seq=jnp.full((B, S), pad_id, jnp.int32),
        pos=zeros_i(B),
        last=zeros_i(B), done=jnp.ones((B,), bool), count=zeros_i(B), request_id=zeros_i(B),
        key=jax.random.split(jax.random.key(0), B), temperature=jnp.ones((B,), jnp.float32),
        top_k=zeros_i(B), top_p=jnp.ones((B,), jnp.float32),
        tokens=jnp.full((B, N), pad_id, jnp.int32), logprobs=jnp.zeros((B, N), jnp.float32),
        versions=jnp.full((B, N), -1, jnp.int32))

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
    _, cache = model(state.seq, positions, valid, _place(KVCache.zeros(model.cfg, B, S), mesh), 0)
    return state._replace(cache=_place(cache, mesh))

  # The decode state (and with it the KV cache) is donated: each call updates it in place
  # instead of copying the cache, and the caller never touches the old state again.
  jit = functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("mesh",))
  return init_decode_state, prefill, jit(core.insert), jit(generate), jit(refresh)


class DriverFns(NamedTuple):
  """The batched functions `Engine.run` drives (see `make_driver_fns`)."""

  # Each also takes a static `mesh=None` keyword: the mesh its KV caches are split over.
  init_pool: Callable  # (params) -> Prefix pool of Q rows
  prefill_many: Callable  # (params, pool, tokens [Q, T], lengths [Q], rows [Q], n) -> pool
  insert_many: Callable  # (pool, state, admit_i [5, B], admit_f [2, B], m, key) -> pool, state
  step: Callable  # (params, state, idx, version, steps, *, groups) -> (state, snapshot)


def make_driver_fns(graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
                    max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
                    pool_rows: int) -> DriverFns:
  """Batched versions of `prefill`, `insert` and `generate` for a host driver, one dispatch
  however many prompts or rows each handles (see the module docstring):

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
               max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
  B, Q, Lmax = core.B, pool_rows, max_prompt_len

  @functools.partial(jax.jit, static_argnames=("mesh",))
  def init_pool(params, mesh=None) -> Prefix:
    cfg = nnx.merge(graphdef, params).cfg
    return Prefix(_place(KVCache.zeros(cfg, Q, Lmax), mesh, rows=False),
                  jnp.full((Q, Lmax), pad_id, jnp.int32), jnp.ones((Q,), jnp.int32),
                  jnp.zeros((Q, cfg.vocab_size), jnp.float32))

  def prefill_many(params, pool: Prefix, tokens, lengths, rows, n, mesh=None) -> Prefix:
    model = nnx.merge(graphdef, params)

    def one(i, pool):
      prefix, row = core.prefill(model, tokens[i], lengths[i], mesh), rows[i]
      put = lambda buf, x: _put_row(buf, x, row)
      cache = KVCache(jax.tree.map(put, pool.cache.k, prefix.cache.k),
                      jax.tree.map(put, pool.cache.v, prefix.cache.v), pool.cache.valid)
      return Prefix(_place(cache, mesh, rows=False), put(pool.tokens, prefix.tokens[None]),
                    pool.length.at[row].set(prefix.length), pool.logits.at[row].set(prefix.logits))

    return jax.lax.fori_loop(0, n, one, pool._replace(cache=_place(pool.cache, mesh, rows=False)))

  def insert_many(pool: Prefix, state: DecodeState, admit_i, admit_f, m, key, mesh=None):
    def one(j, state):
      row = admit_i[1, j]
      get = lambda x: _get_row(x, row)
      prefix = Prefix(KVCache(jax.tree.map(get, pool.cache.k), jax.tree.map(get, pool.cache.v),
                              pool.cache.valid), pool.tokens[row], pool.length[row],
                      pool.logits[row])
      return core.insert(prefix, state, admit_i[0, j], admit_i[2, j], key, admit_f[0, j],
                         admit_i[3, j], admit_f[1, j], admit_i[4, j], mesh)

    state = state._replace(cache=_place(state.cache, mesh))
    return pool, jax.lax.fori_loop(0, m, one, state)

  def step(params, state: DecodeState, idx, version, steps, *,
           groups: tuple[tuple[int, int | None], ...], mesh=None):
    model, layers = core.model(params)
    if groups == ((B, None),):
      state, = core.decode(model, layers, (state,), version, steps, mesh)
    else:
      at = np.cumsum([0] + [n for n, _ in groups])
      ids = [idx[at[g]:at[g + 1]] for g in range(len(groups))]
      subs = core.decode(model, layers, tuple(_gather(state, i, w) for i, (_, w) in zip(
          ids, groups)), version, steps, mesh)
      for i, sub in zip(ids, subs):
        state = _scatter(state, sub, i)
      state = state._replace(cache=_place(state.cache, mesh))
    snapshot = (jnp.stack([state.done.astype(jnp.int32), state.count]), state.tokens,
                state.logprobs, state.versions)
    return state, snapshot

  return DriverFns(init_pool,
                   jax.jit(prefill_many, donate_argnums=(1,), static_argnames=("mesh",)),
                   jax.jit(insert_many, donate_argnums=(0, 1), static_argnames=("mesh",)),
                   jax.jit(step, static_argnames=("groups", "mesh"), donate_argnums=(1,)))


@functools.lru_cache(maxsize=64)
def _shared(make, graphdef, **shape):
  """`make(graphdef, **shape)`, built once per model structure and shape."""
  return make(graphdef, **shape)


class Engine:
  """Host-side slot manager over the pure engine functions (one per model shape and budget).

  Not thread-safe: one `run` at a time. Counters in `stats` let callers and tests see how work
  was batched: `prefill` (prompts prefilled) and `insert` (rows inserted), `prefill_call` and
  `insert_call` (the dispatches doing them), `dispatch` (decode dispatches), `compact`, `short`
  and `split` (those that decoded fewer slots, all of them over a shorter cache window, or some
  of them; see `plan`) and `refresh`.

  `prefill_batch` (Q) is the size of the prefix pool: prompts prefilled ahead of their
  admission, up to Q per prefill dispatch.

  Decode programs (`plan`): with `compact=True` a dispatch decodes only what it must. At most
  half the slots occupied: only those, gathered into B/2, B/4 or B/8 slots. More: the slots
  whose positions stay below `short_window` W during the dispatch over the first W cache slots
  only, and the rest (B/8 or B/4 of them, or none) over the whole cache. Each choice is one
  program, compiled on first use (`warmup` compiles them all). `short_window` None picks the
  largest power of two <= S/4 if it is at least 2 x max_prompt_len (else no split); 0 turns the
  split off. `compact=False` decodes every slot over the whole cache in every dispatch.
  """

  def __init__(self, graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
               max_new_tokens: int, eos_id: int | Sequence[int], pad_id: int,
               prefill_buckets: Sequence[int] | None = None, steps_per_dispatch: int = 8,
               refresh_kv: bool = True, prefill_batch: int = 16, compact: bool = True,
               short_window: int | None = None):
    eos_ids = eos_tuple(eos_id, "Engine")
    if (num_slots < 1 or max_new_tokens < 1 or max_prompt_len < 1 or steps_per_dispatch < 1
        or prefill_batch < 1):
      raise ValueError(f"Engine: num_slots={num_slots}, max_prompt_len={max_prompt_len}, "
                       f"max_new_tokens={max_new_tokens}, steps_per_dispatch="
                       f"{steps_per_dispatch} and prefill_batch={prefill_batch} must all be >= 1")
    buckets = tuple(sorted(set(prefill_buckets or default_buckets(max_prompt_len))))
    if buckets[-1] < max_prompt_len or buckets[0] < 1:
      raise ValueError(f"Engine: prefill_buckets={buckets} must be >= 1 and reach "
                       f"max_prompt_len={max_prompt_len}")
    self.num_slots, self.max_prompt_len, self.max_new_tokens = (num_slots, max_prompt_len,
                                                                max_new_tokens)
    self.eos_ids, self.pad_id, self.buckets = eos_ids, pad_id, buckets
    self.steps_per_dispatch, self.refresh_kv = steps_per_dispatch, refresh_kv
    self.pool_rows = prefill_batch
    shape = dict(num_slots=num_slots, max_prompt_len=max_prompt_len,
                 max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    # Engines of one model and shape share their jitted functions, and so their compiled
    # programs (the trainer builds several; so do tests and benchmarks).
    (self.init_decode_state, self._prefill, self.insert, self.generate,
     self.refresh) = _shared(make_engine_fns, graphdef, **shape)
    self.fns = _shared(make_driver_fns, graphdef, pool_rows=prefill_batch, **shape)
    self.compact = compact
    S = max_prompt_len + max_new_tokens
    if short_window is None:
      w = 1 << max(0, (S // 4).bit_length() - 1)
      short_window = w if w >= 2 * max_prompt_len else 0
    if not 0 <= short_window < S:
      raise ValueError(f"Engine: short_window={short_window} must be in [0, {S})")
    self.short_window = W = short_window if compact else 0
    B = num_slots
    self._programs = [((B, None),)]
    if compact:
      self._programs = [((b, None),) for b in sorted({max(1, B >> j) for j in range(4)})]
      if W:
        self._programs.append(((B, W),))
        # Two groups cost one more model call per step and the copies of the long group's
        # whole cache per dispatch: worth it for a few long rows only (at B/2 of them, the
        # step costs as much as the full one here).
        self._programs += [((B - n, W), (n, None))
                           for n in sorted({max(1, B >> j) for j in (3, 2)}) if n < B]
    self.stats = collections.Counter()

  def bucket(self, length: int) -> int:
    """The smallest prefill bucket holding `length` tokens."""
    for b in self.buckets:
      if length <= b:
        return b
    raise ValueError(f"prompt of {length} tokens exceeds max_prompt_len={self.max_prompt_len}")

  def prefill(self, params, tokens: Sequence[int]) -> Prefix:
    """Pads one prompt (a token list) to its bucket and prefills it (for `insert`)."""
    n = len(tokens)
    padded = np.full((self.bucket(n),), self.pad_id, np.int32)
    padded[:n] = tokens
    return self._prefill(params, padded, np.int32(n), mesh=mesh_of(params))

  def programs(self) -> list[tuple[tuple[int, int | None], ...]]:
    """Every decode program `plan` can choose, in its order of preference: groups of (slots,
    cache window; None: the whole cache)."""
    return list(self._programs)

  def plan(self, reach: dict[int, int]) -> tuple[tuple[tuple[int, int | None], ...], list[int]]:
    """The decode program for the occupied slots `reach` (slot -> the highest cache slot it
    can write this dispatch, plus one) -> (groups, the slot ids of every group in order).
    Free slots fill the groups up: they run but record nothing."""
    B, W = self.num_slots, self.short_window
    free = [s for s in range(B) if s not in reach]
    for groups in self._programs:
      if len(groups) == 1 and groups[0][1] is None:  # all slots, or a compacted few
        n = groups[0][0]
        if len(reach) <= n and (n <= B // 2 or n == B and not W):
          live = list(reach)
          return groups, live + free[:n - len(live)]
      else:  # n_long slots over the whole cache, the others over its first W slots only
        n_long = groups[1][0] if len(groups) == 2 else 0
        order = sorted(reach, key=lambda s: -reach[s]) + free
        if not order[n_long:] or reach.get(order[n_long], 0) <= W:
          return groups, order[n_long:] + order[:n_long]
    return ((B, None),), list(range(B))

  def warmup(self, params) -> None:
    """Compiles every program `run` can reach (each prefill bucket, the inserts, and every
    decode program of `programs()`) on an empty state, so that no run compiles (for the mesh
    `params` are placed on, as `run` uses it)."""
    mesh = mesh_of(params)
    state, pool = self.init_decode_state(params, mesh=mesh), self.fns.init_pool(params, mesh=mesh)
    Q, B = self.pool_rows, self.num_slots
    for T in self.buckets:
      pool = self.fns.prefill_many(params, pool, np.zeros((Q, T), np.int32),
                                   np.ones((Q,), np.int32), np.zeros((Q,), np.int32),
                                   np.int32(0), mesh=mesh)
    pool, state = self.fns.insert_many(pool, state, np.zeros((5, B), np.int32),
                                       np.zeros((2, B), np.float32), np.int32(0),
                                       jax.random.key(0), mesh=mesh)
    for groups in self._programs:
      n = sum(b for b, _ in groups)
      state, snap = self.fns.step(params, state, np.arange(n, dtype=np.int32), np.int32(0),
                                  np.int32(1), groups=groups, mesh=mesh)
    jax.block_until_ready((state, snap, pool))

  def run(self, params, prompts: Sequence[Sequence[int]], request_ids: Sequence[int], key,
          temperature=1.0, top_k=0, top_p=1.0, group_size: int = 1, version: int = 0,
          on_finish: Callable[[int, EngineOutput], None] | None = None,
          params_source: Callable[[], tuple[int, object]] | None = None,
          steps: int | None = None) -> EngineOutput:
    """Generates `group_size` samples of each prompt; rows are prompt-major (row = p*G + g),
    as in the static sampler, and `request_ids`, `temperature`, `top_k`, `top_p` are one per
    row (or one for all).

    Keeps every slot busy: prompts are prefilled ahead into the prefix pool (once per prompt,
    several per dispatch), and their members are inserted as slots free up (one dispatch per
    round of admissions). After each dispatch of `steps_per_dispatch` decode steps (with the
    program `plan` picks) the finished slots are freed; their rows are copied out while the
    next dispatch runs, and when the last member of a group finishes, `on_finish(prompt_index,
    EngineOutput of its G rows)` is called (groups complete out of order).

    `params_source`, if given, is called before every dispatch (and before the first admission)
    and returns `(version, params)`; a new version is switched to at once (partial rollouts,
    see the module docstring), and `params`/`version` are then only the fallback for a source
    that returns None. Without it every token is produced by `params` and stamped `version`.
    `steps` overrides `steps_per_dispatch` for this run (an array argument: no recompile).
    """
    requests = Requests.make(prompts, request_ids, temperature, top_k, top_p, group_size,
                             self.max_prompt_len)
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)
    return Scheduler(self, requests, key, np.int32(steps or self.steps_per_dispatch),
                     int(version), params, on_finish, params_source).run()
