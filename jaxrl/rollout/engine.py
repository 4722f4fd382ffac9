"""Continuous-batching decode engine: fixed slots that each advance on their own.

The static sampler (`static_sampler.make_sampler`) decodes a whole batch in lockstep: the batch
is as slow as its longest row, and rows that ended early idle until then. This engine keeps
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

The device programs live in `decode_programs` (`make_engine_fns` for the four above,
`make_driver_fns` for their batched versions), the records they pass around (`Prefix`,
`DecodeState`) in `slot_state`, and the host-side bookkeeping of a run in `scheduler`; this
module holds `Engine`, which ties them together. All the programs are pure and jitted and donate
the decode state, so the KV cache is updated in place; nothing recompiles per request. Sampling
follows the static sampler exactly, so the same key and request ids give the same tokens
whatever the slot a request lands in or when it is admitted.

On a mesh (the one the params are placed on: the rollout mesh, the train mesh when colocated, or
on several processes this process's own devices, where the params are published for its rollout
thread) every program pins the KV caches it returns (`decode_programs`); `Engine` passes the mesh
of the params it is given. Placement only: the tokens are the same.

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
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl.parallel.sharding import mesh_of
from jaxrl.rollout.decode_programs import make_driver_fns, make_engine_fns
from jaxrl.rollout.scheduler import EngineOutput, Requests, Scheduler
from jaxrl.rollout.slot_state import Prefix
from jaxrl.rollout.static_sampler import eos_tuple


def default_buckets(max_prompt_len: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` (or less if the limit is smaller) up to and including
  `max_prompt_len`: at most log2(max) prefill programs, each prompt padded by less than 2x."""
  out, b = [], min(smallest, max_prompt_len)
  while b < max_prompt_len:
    out.append(b)
    b *= 2
  return tuple(out) + (max_prompt_len,)



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

  `fused_sampling` is `static_sampler.pick_tokens`'s `fused` (None: on off CPU). The slots' KV
  cache is of the model's `kv_cache_dtype` (`init_decode_state(params).cache`).
  """

  def __init__(self, graphdef: nnx.GraphDef, *, num_slots: int, max_prompt_len: int,
               max_new_tokens: int, eos_id: int | Sequence[int], pad_id: int,
               prefill_buckets: Sequence[int] | None = None, steps_per_dispatch: int = 8,
               refresh_kv: bool = True, prefill_batch: int = 16, compact: bool = True,
               short_window: int | None = None, fused_sampling: bool | None = None):
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
                 max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                 fused_sampling=fused_sampling)
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
          steps: int | None = None,
          on_tokens: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None] | None = None,
          cancelled: Callable[[int], bool] | None = None) -> EngineOutput:
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

    Live rows (a server's streaming and disconnects): after every dispatch, `on_tokens(row,
    tokens, logprobs, versions)` gets each row that dispatch decoded, with all its tokens so far;
    a row for which `cancelled(row)` is then true ends there (its slot takes the next row; its
    output keeps the tokens made so far; `stats["cancel"]` counts them).
    """
    requests = Requests.make(prompts, request_ids, temperature, top_k, top_p, group_size,
                             self.max_prompt_len)
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)
    return Scheduler(self, requests, key, np.int32(steps or self.steps_per_dispatch),
                     int(version), params, on_finish, params_source, on_tokens=on_tokens,
                     cancelled=cancelled).run()
