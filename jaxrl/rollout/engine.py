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
and versions are array arguments: nothing recompiles per request, only per prefill bucket.

Why each slot's cache region starts at cache slot 0 with the prompt's real tokens: positions and
cache indices then coincide (`pos`), and one per-slot index says both where the next token goes
and which position it rotates by. The model's cache write takes a single index for the batch, so
a decode step `vmap`s the model over slots (one index each); the model itself is unchanged.

Sampling follows the static sampler exactly (`sampler.pick_tokens`): request r draws token t
with `fold_in(fold_in(key, r), t)`, log-probs are `log_softmax(logits / T)` over the full
vocabulary. The same key and request ids therefore give the same tokens as the static sampler,
whatever the slot a request lands in or when it is admitted.

`Engine.run` is the host-side driver: it keeps every slot busy (prefill once per prompt, insert
its G members into free slots, dispatch `generate`, collect finished slots, free them), streams
finished groups to `on_finish`, and returns rows in request order in the sampler's format plus
per-token versions.

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
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.transformer import KVCache
from jaxrl.rollout.sampler import eos_tuple, is_eos, pick_tokens


class Prefix(NamedTuple):
  """One prefilled prompt, ready to be inserted into any number of slots."""

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


class EngineOutput(NamedTuple):
  """The static sampler's `SampleOutput` fields (host arrays) plus per-token versions."""

  tokens: np.ndarray  # [R, N] int32, pad_id after EOS
  logprobs: np.ndarray  # [R, N] float32, 0 where mask is False
  mask: np.ndarray  # [R, N] bool: generated tokens up to and including the first EOS
  lengths: np.ndarray  # [R] int32
  versions: np.ndarray  # [R, N] int32 policy version per token, -1 where mask is False


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


def make_engine_fns(graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
                    max_new_tokens: int, eos_ids: Sequence[int], pad_id: int):
  """The pure jitted functions of the engine: `(init_decode_state, prefill, insert, generate,
  refresh)`; see the module docstring. Shapes are fixed by the arguments here."""
  B, N = num_slots, max_new_tokens
  S = max_prompt_len + max_new_tokens
  eos_ids = eos_tuple(eos_ids, "make_engine_fns")

  @jax.jit
  def init_decode_state(params) -> DecodeState:
    """All slots empty (done). `params` only supplies the model config (shapes of the cache)."""
    cfg = nnx.merge(graphdef, params).cfg
    zeros_i = lambda *shape: jnp.zeros(shape, jnp.int32)
    # Every field its own buffer: the state is donated, and XLA refuses to donate one buffer
    # twice.
    return DecodeState(
        cache=KVCache.zeros(cfg, B, S), seq=jnp.full((B, S), pad_id, jnp.int32), pos=zeros_i(B),
        last=zeros_i(B), done=jnp.ones((B,), bool), count=zeros_i(B), request_id=zeros_i(B),
        key=jax.random.split(jax.random.key(0), B), temperature=jnp.ones((B,), jnp.float32),
        top_k=zeros_i(B), top_p=jnp.ones((B,), jnp.float32),
        tokens=jnp.full((B, N), pad_id, jnp.int32), logprobs=jnp.zeros((B, N), jnp.float32),
        versions=jnp.full((B, N), -1, jnp.int32))

  @jax.jit
  def prefill(params, tokens: jax.Array, true_length: jax.Array) -> Prefix:
    # Right padding: the real tokens sit at cache slots and positions 0..len-1, as in a slot.
    model = nnx.merge(graphdef, params)
    T = tokens.shape[0]
    valid = jnp.arange(T) < true_length
    cache = KVCache.zeros(model.cfg, 1, T)
    hidden, cache = model(tokens[None], jnp.arange(T)[None], valid[None], cache, 0)
    logits = model.logits(jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, 0, False))
    return Prefix(cache, tokens, jnp.asarray(true_length, jnp.int32), logits)

  def insert(prefix: Prefix, state: DecodeState, slot, request_id, key, temperature, top_k,
             top_p, version) -> DecodeState:
    put = lambda buf, row: _put_row(buf, row, slot)
    in_prompt = jnp.arange(S) < prefix.length
    # The prefix's stale tail (bucket padding) and the slot's previous request stay in the
    # cache but are masked: only [0, length) is valid.
    cache = KVCache(jax.tree.map(put, state.cache.k, prefix.cache.k),
                    jax.tree.map(put, state.cache.v, prefix.cache.v),
                    put(state.cache.valid, in_prompt[None]))
    prompt = jnp.zeros((S,), jnp.int32).at[:prefix.tokens.shape[0]].set(prefix.tokens)
    seq = put(state.seq, jnp.where(in_prompt, prompt, pad_id)[None])
    request_key = jax.random.fold_in(key, request_id)
    tok, lp = pick_tokens(prefix.logits[None], 0, request_key[None], temperature, top_k, top_p)
    first = jnp.arange(N) == 0
    set_ = lambda buf, value: buf.at[slot].set(value)
    return DecodeState(
        cache=cache, seq=seq, pos=set_(state.pos, prefix.length), last=set_(state.last, tok[0]),
        done=set_(state.done, is_eos(tok[0], eos_ids) | (N <= 1)), count=set_(state.count, 1),
        request_id=set_(state.request_id, request_id), key=set_(state.key, request_key),
        temperature=set_(state.temperature, temperature), top_k=set_(state.top_k, top_k),
        top_p=set_(state.top_p, top_p),
        tokens=set_(state.tokens, jnp.where(first, tok[0], pad_id)),
        logprobs=set_(state.logprobs, jnp.where(first, lp[0], 0.0)),
        versions=set_(state.versions, jnp.where(first, version, -1)))

  def decode_slots(model, layers, tok, pos, live, cache):
    """One token per slot, each at its own position and cache index -> (logits [B, V], cache).

    The model writes a whole batch at one cache index; vmapping it over slots (a batch of one
    each) gives every slot its own index without touching the model.
    """
    axes = jax.tree.map(_batch_axis, cache)

    def one(tok, pos, live, c):
      c = jax.tree.map(jnp.expand_dims, c, axes)
      hidden, c = model(tok[None, None], pos[None, None], live[None, None], c, pos,
                        layers=layers)
      return model.logits(hidden[0, 0]), jax.tree.map(jnp.squeeze, c, axes)

    return jax.vmap(one, in_axes=(0, 0, 0, axes), out_axes=(0, axes))(tok, pos, live, cache)

  def generate(params, state: DecodeState, version, steps) -> DecodeState:
    model = nnx.merge(graphdef, params)
    # Unrolled models: per-layer weights prepared once here rather than sliced in every step.
    layers = None if model.cfg.scan_layers else model.layer_weights()
    at_pos = jnp.arange(S)[None, :]
    at_count = jnp.arange(N)[None, :]

    def body(carry):
      i, s = carry
      live = ~s.done
      # Done slots still run (fixed shapes) but feed an invalid token and record nothing.
      logits, cache = decode_slots(model, layers, s.last, s.pos, live, s.cache)
      tok, lp = pick_tokens(logits, s.count, s.key, s.temperature, s.top_k, s.top_p)
      fed = (at_pos == s.pos[:, None]) & live[:, None]
      new = (at_count == s.count[:, None]) & live[:, None]
      count = s.count + live
      return i + 1, s._replace(
          cache=cache, seq=jnp.where(fed, s.last[:, None], s.seq), pos=s.pos + live,
          last=jnp.where(live, tok, s.last),
          done=s.done | (live & (is_eos(tok, eos_ids) | (count >= N))), count=count,
          tokens=jnp.where(new, tok[:, None], s.tokens),
          logprobs=jnp.where(new, lp[:, None], s.logprobs),
          versions=jnp.where(new, version, s.versions))

    _, state = jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[1].done), body,
                                  (jnp.int32(0), state))
    return state

  def refresh(params, state: DecodeState) -> DecodeState:
    # One forward over every slot's held tokens (prompt + fed completion, cache slots < pos)
    # rebuilds the whole cache under `params`; `last` is fed by the next step as usual.
    model = nnx.merge(graphdef, params)
    valid = jnp.arange(S)[None, :] < state.pos[:, None]
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    _, cache = model(state.seq, positions, valid, KVCache.zeros(model.cfg, B, S), 0)
    return state._replace(cache=cache)

  # The decode state (and with it the KV cache) is donated: each call updates it in place
  # instead of copying the cache, and the caller never touches the old state again.
  return (init_decode_state, prefill, jax.jit(insert, donate_argnums=(1,)),
          jax.jit(generate, donate_argnums=(1,)), jax.jit(refresh, donate_argnums=(1,)))


class Engine:
  """Host-side slot manager over the pure engine functions (one per model shape and budget).

  Not thread-safe: one `run` at a time. Counters in `stats` (`prefill`, `insert`, `dispatch`,
  `refresh`) let callers and tests see how work was batched.
  """

  def __init__(self, graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
               max_new_tokens: int, eos_id: int | Sequence[int], pad_id: int,
               prefill_buckets: Sequence[int] | None = None, steps_per_dispatch: int = 8,
               refresh_kv: bool = True):
    eos_ids = eos_tuple(eos_id, "Engine")
    if num_slots < 1 or max_new_tokens < 1 or max_prompt_len < 1 or steps_per_dispatch < 1:
      raise ValueError(f"Engine: num_slots={num_slots}, max_prompt_len={max_prompt_len}, "
                       f"max_new_tokens={max_new_tokens} and steps_per_dispatch="
                       f"{steps_per_dispatch} must all be >= 1")
    buckets = tuple(sorted(set(prefill_buckets or default_buckets(max_prompt_len))))
    if buckets[-1] < max_prompt_len or buckets[0] < 1:
      raise ValueError(f"Engine: prefill_buckets={buckets} must be >= 1 and reach "
                       f"max_prompt_len={max_prompt_len}")
    self.num_slots, self.max_prompt_len, self.max_new_tokens = (num_slots, max_prompt_len,
                                                                max_new_tokens)
    self.eos_ids, self.pad_id, self.buckets = eos_ids, pad_id, buckets
    self.steps_per_dispatch, self.refresh_kv = steps_per_dispatch, refresh_kv
    (self.init_decode_state, self._prefill, self.insert, self.generate,
     self.refresh) = make_engine_fns(graphdef, num_slots=num_slots, max_prompt_len=max_prompt_len,
                                     max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                     pad_id=pad_id)
    self.stats = collections.Counter()

  def bucket(self, length: int) -> int:
    """The smallest prefill bucket holding `length` tokens."""
    for b in self.buckets:
      if length <= b:
        return b
    raise ValueError(f"prompt of {length} tokens exceeds max_prompt_len={self.max_prompt_len}")

  def prefill(self, params, tokens: Sequence[int]) -> Prefix:
    """Pads one prompt (a token list) to its bucket and prefills it."""
    n = len(tokens)
    padded = np.full((self.bucket(n),), self.pad_id, np.int32)
    padded[:n] = tokens
    self.stats["prefill"] += 1
    return self._prefill(params, padded, np.int32(n))

  def run(self, params, prompts: Sequence[Sequence[int]], request_ids: Sequence[int], key,
          temperature=1.0, top_k=0, top_p=1.0, group_size: int = 1, version: int = 0,
          on_finish: Callable[[int, EngineOutput], None] | None = None,
          params_source: Callable[[], tuple[int, object]] | None = None,
          steps: int | None = None) -> EngineOutput:
    """Generates `group_size` samples of each prompt; rows are prompt-major (row = p*G + g),
    as in the static sampler, and `request_ids`, `temperature`, `top_k`, `top_p` are one per
    row (or one for all).

    Keeps every slot busy: a prompt is prefilled once when its first member gets a free slot
    and its members are inserted as slots free up. After each dispatch of
    `steps_per_dispatch` decode steps, finished slots are collected and freed; when the last
    member of a group finishes, `on_finish(prompt_index, EngineOutput of its G rows)` is called
    (groups complete out of order).

    `params_source`, if given, is called before every dispatch (and before the first admission)
    and returns `(version, params)`; a new version is switched to at once (partial rollouts,
    see the module docstring), and `params`/`version` are then only the fallback for a source
    that returns None. Without it every token is produced by `params` and stamped `version`.
    `steps` overrides `steps_per_dispatch` for this run (an array argument: no recompile).
    """
    G, P, N = group_size, len(prompts), self.max_new_tokens
    R = P * G
    ids = np.asarray(request_ids, np.int64)
    if G < 1 or ids.shape != (R,):
      raise ValueError(f"run: need group_size >= 1 and one request id per row ({P} prompts x "
                       f"{G} = {R}), got {ids.shape[0] if ids.ndim else ids} ids")
    for p, prompt in enumerate(prompts):
      if not 1 <= len(prompt) <= self.max_prompt_len:
        raise ValueError(f"prompt {p} has {len(prompt)} tokens; the engine takes 1 to "
                         f"max_prompt_len={self.max_prompt_len} (nothing is truncated)")
    per_row = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (R,))
    temps, ks, ps = (per_row(temperature, np.float32), per_row(top_k, np.int32),
                     per_row(top_p, np.float32))
    ids = ids.astype(np.int32)
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)

    out = EngineOutput(np.full((R, N), self.pad_id, np.int32), np.zeros((R, N), np.float32),
                       np.zeros((R, N), bool), np.zeros((R,), np.int32),
                       np.full((R, N), -1, np.int32))
    cur_version, cur_params = int(version), params
    if params_source is not None:
      got = params_source()
      if got is not None:
        cur_version, cur_params = int(got[0]), got[1]
    state = self.init_decode_state(cur_params)
    free = collections.deque(range(self.num_slots))
    slot_row: dict[int, int] = {}
    waiting = collections.deque(range(P))
    current = None  # [prompt index, prefix, prefix version, next member]
    left_in_group = [G] * P
    finished = 0

    while finished < R:
      while free and (current is not None or waiting):
        if current is None:
          p = waiting.popleft()
          current = [p, self.prefill(cur_params, prompts[p]), cur_version, 0]
        p, prefix, prefix_version, g = current
        slot, row = free.popleft(), p * G + g
        state = self.insert(prefix, state, np.int32(slot), ids[row], key, temps[row], ks[row],
                            ps[row], np.int32(prefix_version))
        self.stats["insert"] += 1
        slot_row[slot] = row
        current[3] += 1
        if current[3] == G:
          current = None
      state = self.generate(cur_params, state, np.int32(cur_version),
                            np.int32(steps or self.steps_per_dispatch))
      self.stats["dispatch"] += 1
      done = np.asarray(state.done)
      ended = sorted(s for s in slot_row if done[s])
      if ended:
        finished += self._collect(state, ended, slot_row, free, out, left_in_group, G, on_finish)
      if params_source is not None and finished < R:
        got = params_source()
        if got is not None and int(got[0]) != cur_version:
          cur_version, cur_params = int(got[0]), got[1]
          if self.refresh_kv and slot_row:
            state = self.refresh(cur_params, state)
            self.stats["refresh"] += 1
          if current is not None and self.refresh_kv:
            # Members not yet inserted start from the new params' view of the prompt too.
            current[1:3] = self.prefill(cur_params, prompts[current[0]]), cur_version
    return out

  def _collect(self, state, ended, slot_row, free, out, left_in_group, G, on_finish) -> int:
    """Copies finished slots' rows to `out`, frees the slots, reports completed groups."""
    tokens, logprobs, versions, count = jax.device_get(
        (state.tokens, state.logprobs, state.versions, state.count))
    for slot in ended:
      row = slot_row.pop(slot)
      n = int(count[slot])
      out.tokens[row], out.logprobs[row], out.versions[row] = (tokens[slot], logprobs[slot],
                                                               versions[slot])
      out.mask[row, :n], out.lengths[row] = True, n
      free.append(slot)
      p = row // G
      left_in_group[p] -= 1
      if left_in_group[p] == 0 and on_finish is not None:
        on_finish(p, EngineOutput(*(x[p * G:(p + 1) * G] for x in out)))
    return len(ended)

