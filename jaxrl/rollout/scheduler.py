"""The host side of `Engine.run`: which prompt is prefilled into which pool row, which row is
admitted into which slot, when finished rows are copied out, and when the params switch.

The engine's device functions (`decode_programs.make_driver_fns`) are pure and take fixed
shapes; all the bookkeeping of one run lives here, in one `Scheduler` object with named fields,
so that the order of its dispatches can be read in one loop (`Scheduler.run`). It drives batched
versions of the engine's computations so that the host does little per token:

- Prompts are prefilled ahead into a pool of `prefill_batch` prefixes, as many per dispatch as
  there are free pool rows (one dispatch per length bucket), each prompt still computed alone;
- each round of admissions (the free slots, filled with prompts' members in prompt order) is one
  dispatch of inserts;
- each decode dispatch also returns a snapshot of `done`, `count` and the per-token rows; the
  host copies finished rows out of it while the next dispatch runs;
- `Engine.plan` picks each dispatch's decode program: when at most half the slots are occupied,
  only those (gathered into B/2, B/4 or B/8 slots); else, if `short_window` is set, the slots
  whose positions stay under it over that many cache slots, and the few others (B/8 or B/4 of
  them) over the whole cache. A decode step costs about its slots x the cache length they
  attend over, so the drain of a long-tailed batch (a few long rows left) and many short rows
  next to a few long ones both cost less than every slot over the whole cache.

Every dispatch passes `mesh`, the mesh the run's params are placed on (None off a mesh), so the
engine splits its KV caches over it (`decode_programs` module docstring).

Every host array handed to a dispatch is fresh: on CPU a dispatch may read numpy inputs in place
after it returns, so they are never written again.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from jaxrl.parallel.sharding import mesh_of
from jaxrl.rollout.slot_state import DecodeState, DriverFns, Prefix


class EngineOutput(NamedTuple):
  """The static sampler's `SampleOutput` fields (host arrays) plus per-token versions."""

  tokens: np.ndarray  # [R, N] int32, pad_id after EOS
  logprobs: np.ndarray  # [R, N] float32, 0 where mask is False
  mask: np.ndarray  # [R, N] bool: generated tokens up to and including the first EOS
  lengths: np.ndarray  # [R] int32
  versions: np.ndarray  # [R, N] int32 policy version per token, -1 where mask is False
  # Mixture-of-experts models: [R, N, L, k] int16 experts of each fed token, -1 where none
  # (`static_sampler.SampleOutput.routing`); None for a dense model.
  routing: np.ndarray | None = None


class SlotEngine(Protocol):
  """What a `Scheduler` reads of its engine (`engine.Engine` is one): the shapes, the jitted
  programs, `bucket` and `plan`. The scheduler depends on this, not on `engine`, which imports
  the scheduler."""

  num_slots: int
  max_new_tokens: int
  pad_id: int
  pool_rows: int  # rows of the prefix pool
  short_window: int
  refresh_kv: bool
  stats: collections.Counter  # dispatch counters, bumped by the scheduler
  fns: DriverFns
  init_decode_state: Callable[..., DecodeState]  # (params, *, mesh) -> empty state
  refresh: Callable[..., DecodeState]  # (params, state, *, mesh) -> state with KV recomputed

  def bucket(self, length: int) -> int: ...

  def plan(self, reach: dict[int, int]
           ) -> tuple[tuple[tuple[int, int | None], ...], list[int]]: ...


@dataclasses.dataclass(frozen=True)
class Requests:
  """The rows of one run, checked and one setting per row: row r = p * group_size + g is
  member g of prompt p (prompt-major, as in the static sampler)."""

  prompts: Sequence[Sequence[int]]
  lengths: list[int]  # tokens per prompt
  group_size: int
  request_id: np.ndarray  # [R] int32: each row's RNG stream (fold_in(key, request_id))
  temperature: np.ndarray  # [R] float32
  top_k: np.ndarray  # [R] int32
  top_p: np.ndarray  # [R] float32

  @classmethod
  def make(cls, prompts, request_ids, temperature, top_k, top_p, group_size: int,
           max_prompt_len: int) -> Requests:
    """Checks the run's arguments (before anything is dispatched) and broadcasts the sampling
    settings to one per row."""
    G, P = group_size, len(prompts)
    R = P * G
    ids = np.asarray(request_ids, np.int64)
    if G < 1 or ids.shape != (R,):
      raise ValueError(f"run: need group_size >= 1 and one request id per row ({P} prompts x "
                       f"{G} = {R}), got {ids.shape[0] if ids.ndim else ids} ids")
    for p, prompt in enumerate(prompts):
      if not 1 <= len(prompt) <= max_prompt_len:
        raise ValueError(f"prompt {p} has {len(prompt)} tokens; the engine takes 1 to "
                         f"max_prompt_len={max_prompt_len} (nothing is truncated)")
    per_row = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (R,))
    return cls(prompts, [len(p) for p in prompts], G, ids.astype(np.int32),
               per_row(temperature, np.float32), per_row(top_k, np.int32),
               per_row(top_p, np.float32))

  @property
  def num_rows(self) -> int:
    return len(self.prompts) * self.group_size


@dataclasses.dataclass
class PoolEntry:
  """A prompt prefilled into the prefix pool; its row is freed once every member is inserted
  (the group shares the one prefill)."""

  prompt: int
  row: int  # the pool row holding its prefix
  version: int  # params version it was prefilled with: stamps each member's first token
  inserted: int = 0  # members inserted into slots so far


class Ended(NamedTuple):
  """A row whose slot finished in a dispatch, to be copied out of that dispatch's snapshot."""

  slot: int
  row: int
  length: int  # tokens generated, the EOS included


@dataclasses.dataclass
class PendingCopy:
  """The rows a dispatch finished, copied out while the next dispatch runs."""

  snapshot: tuple  # the dispatch's (done | count [2, B], tokens, logprobs, versions, routing)
  ended: list[Ended]


class Admissions:
  """One insert dispatch's arguments, filled on the host in the layout `insert_many` reads."""

  def __init__(self, num_slots: int):
    self.ints = np.zeros((5, num_slots), np.int32)  # slot, pool row, request id, top_k, version
    self.floats = np.zeros((2, num_slots), np.float32)  # temperature, top_p
    self.count = 0
    # Pool rows this dispatch reads for the last time: free once it is dispatched.
    self.last_reads: list[int] = []

  def add(self, slot: int, entry: PoolEntry, row: int, requests: Requests) -> None:
    self.ints[:, self.count] = (slot, entry.row, requests.request_id[row], requests.top_k[row],
                                entry.version)
    self.floats[:, self.count] = requests.temperature[row], requests.top_p[row]
    self.count += 1


@dataclasses.dataclass
class Scheduler:
  """The host state of one `Engine.run`; `run()` drives the engine's dispatches to the end.

  Rows move waiting (prompt not yet prefilled) -> `entries` (prefix in the pool) -> a slot
  (`slot_row`) -> `pending` (finished, not yet copied) -> `out`.
  """

  engine: SlotEngine
  requests: Requests
  key: jax.Array  # typed PRNG key of the run; each row folds in its request id
  steps: np.int32  # decode steps per dispatch (an array argument: no recompile)
  version: int  # params version in use: stamps every token produced from now on
  params: object  # the params of `version`
  on_finish: Callable[[int, EngineOutput], None] | None = None
  params_source: Callable[[], tuple[int, object] | None] | None = None
  # After each dispatch: `on_tokens(row, tokens, logprobs, versions)` for every row it decoded
  # (the row's tokens so far), and rows with `cancelled(row)` true end there, freeing their slot.
  on_tokens: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None] | None = None
  cancelled: Callable[[int], bool] | None = None
  # The mesh of `params` (static in every dispatch: it places the KV caches); None off a mesh.
  mesh: object = dataclasses.field(init=False)
  # The decode state and the prefix pool: each dispatch donates them and returns the new ones.
  state: DecodeState = dataclasses.field(init=False)
  pool: Prefix = dataclasses.field(init=False)
  out: EngineOutput = dataclasses.field(init=False)  # rows in request order, filled as they end
  free_slots: collections.deque = dataclasses.field(init=False)  # slots with no request
  slot_row: dict[int, int] = dataclasses.field(init=False)  # occupied slot -> row
  # Host view of each slot: its prompt's length and the tokens generated so far (as of the last
  # dispatch), which bound the cache slots it can reach in the next one.
  slot_length: list[int] = dataclasses.field(init=False)
  slot_count: list[int] = dataclasses.field(init=False)
  free_pool_rows: collections.deque = dataclasses.field(init=False)  # rows no entry still needs
  entries: collections.deque = dataclasses.field(init=False)  # PoolEntry, in prompt order
  waiting: collections.deque = dataclasses.field(init=False)  # prompts not prefilled yet
  left_in_group: list[int] = dataclasses.field(init=False)  # members per prompt not yet copied
  finished: int = 0  # rows whose slot has ended
  pending: PendingCopy | None = None

  def __post_init__(self):
    # The source is asked before anything is dispatched, so the first tokens already use the
    # newest params.
    if self.params_source is not None:
      got = self.params_source()
      if got is not None:
        self.version, self.params = int(got[0]), got[1]
    engine, R, N, B = (self.engine, self.requests.num_rows, self.engine.max_new_tokens,
                       self.engine.num_slots)
    self.mesh = mesh_of(self.params)
    self.state = engine.init_decode_state(self.params, mesh=self.mesh)
    self.pool = engine.fns.init_pool(self.params, mesh=self.mesh)
    routing = self.state.routing
    self.out = EngineOutput(np.full((R, N), engine.pad_id, np.int32),
                            np.zeros((R, N), np.float32), np.zeros((R, N), bool),
                            np.zeros((R,), np.int32), np.full((R, N), -1, np.int32),
                            None if routing is None else np.full((R, *routing.shape[1:]), -1,
                                                                 routing.dtype))
    self.free_slots, self.slot_row = collections.deque(range(B)), {}
    self.slot_length, self.slot_count = [0] * B, [0] * B
    self.free_pool_rows = collections.deque(range(engine.pool_rows))
    self.entries = collections.deque()
    self.waiting = collections.deque(range(len(self.requests.prompts)))
    self.left_in_group = [self.requests.group_size] * len(self.requests.prompts)

  def run(self) -> EngineOutput:
    """Admit, dispatch, then do the host work while that dispatch runs; until every row ends."""
    R, Q = self.requests.num_rows, self.engine.pool_rows
    while self.finished < R:
      self.admit()
      snapshot = self.dispatch()
      # Host work while the dispatch runs: copy out the previous dispatch's finished rows, and
      # prefill the next prompts once half the pool (or all that is left to do) is free.
      self.collect()
      if self.waiting and len(self.free_pool_rows) >= min(max(1, Q // 2), len(self.waiting)):
        self.prefill_next(min(len(self.free_pool_rows), len(self.waiting)))
      self.retire(snapshot)
      if self.params_source is not None and self.finished < R:
        self.poll_params()
    self.collect()
    return self.out

  def prefill(self, entries: Sequence[PoolEntry], params) -> None:
    """Prefills the entries' prompts into their pool rows: one dispatch per length bucket."""
    engine, Q, req = self.engine, self.engine.pool_rows, self.requests
    by_bucket = collections.defaultdict(list)
    for e in entries:
      by_bucket[engine.bucket(req.lengths[e.prompt])].append(e)
    for T, items in by_bucket.items():
      tokens = np.full((Q, T), engine.pad_id, np.int32)
      lengths, rows = np.ones((Q,), np.int32), np.zeros((Q,), np.int32)
      for i, e in enumerate(items):
        n = req.lengths[e.prompt]
        tokens[i, :n], lengths[i], rows[i] = req.prompts[e.prompt], n, e.row
      self.pool = engine.fns.prefill_many(params, self.pool, tokens, lengths, rows,
                                          np.int32(len(items)), mesh=self.mesh)
      engine.stats["prefill"] += len(items)
      engine.stats["prefill_call"] += 1

  def prefill_next(self, n: int) -> None:
    """Prefills the next `n` waiting prompts into free pool rows with the current params."""
    batch = [PoolEntry(self.waiting.popleft(), self.free_pool_rows.popleft(), self.version)
             for _ in range(n)]
    self.prefill(batch, self.params)
    self.entries.extend(batch)

  def insert(self, batch: Admissions) -> None:
    """Dispatches one round of inserts (if any), then frees the pool rows it read last: the
    pool it returns is what the next prefill takes, so refilling them cannot overtake it."""
    if batch.count:
      self.pool, self.state = self.engine.fns.insert_many(
          self.pool, self.state, batch.ints, batch.floats, np.int32(batch.count), self.key,
          mesh=self.mesh)
      self.engine.stats["insert"] += batch.count
      self.engine.stats["insert_call"] += 1
    self.free_pool_rows.extend(batch.last_reads)

  def admit(self) -> None:
    """Inserts members of the prefilled prompts into the free slots, in prompt order: one
    dispatch per round (more only if the pool must be refilled within the round)."""
    G, B = self.requests.group_size, self.engine.num_slots
    batch = Admissions(B)
    while self.free_slots and (self.entries or self.waiting):
      if not self.entries:
        if not self.free_pool_rows:  # every row waits for this round's inserts: do them now
          self.insert(batch)
          batch = Admissions(B)  # fresh arrays: the dispatched ones may still be read
        self.prefill_next(min(len(self.free_pool_rows), len(self.waiting)))
      e = self.entries[0]
      slot, row = self.free_slots.popleft(), e.prompt * G + e.inserted
      batch.add(slot, e, row, self.requests)
      self.slot_row[slot] = row
      self.slot_length[slot], self.slot_count[slot] = self.requests.lengths[e.prompt], 1
      e.inserted += 1
      if e.inserted == G:
        self.entries.popleft()
        batch.last_reads.append(e.row)
    self.insert(batch)

  def dispatch(self) -> tuple:
    """Runs up to `steps` decode steps of the occupied slots (the program `Engine.plan`
    picks) and starts copying the snapshot to the host -> the snapshot."""
    engine, k, N = self.engine, self.steps, self.engine.max_new_tokens
    B, stats = engine.num_slots, engine.stats
    # A slot holds position len + count - 1 and writes at most min(k, N - count) more.
    groups, idx = engine.plan({s: self.slot_length[s] + self.slot_count[s] - 1
                               + min(k, N - self.slot_count[s]) for s in self.slot_row})
    self.state, snapshot = engine.fns.step(self.params, self.state, np.asarray(idx, np.int32),
                                           np.int32(self.version), k, groups=groups,
                                           mesh=self.mesh)
    for x in snapshot:
      if x is not None:
        x.copy_to_host_async()
    stats["dispatch"] += 1
    stats["compact"] += groups[0][0] < B and groups[0][1] is None
    stats["short"] += groups == ((B, engine.short_window),)
    stats["split"] += len(groups) == 2
    return snapshot

  def retire(self, snapshot: tuple) -> None:
    """Reads the dispatch's done flags and counts (waits for it), frees the slots that ended
    and keeps their rows for `collect` after the next dispatch."""
    done_count = np.asarray(snapshot[0])
    live = list(self.slot_row)  # the slots that dispatch decoded: none changed since
    for s in live:
      self.slot_count[s] = int(done_count[1, s])
    if self.on_tokens is not None:
      tokens, logprobs, versions = (np.asarray(x) for x in snapshot[1:4])
      for s in live:
        n = self.slot_count[s]
        self.on_tokens(self.slot_row[s], tokens[s, :n], logprobs[s, :n], versions[s, :n])
    stop = self.cancelled or (lambda row: False)
    ended = [Ended(s, self.slot_row.pop(s), self.slot_count[s]) for s in live
             if done_count[0, s] or stop(self.slot_row[s])]
    self.engine.stats["cancel"] += sum(not done_count[0, e.slot] for e in ended)
    self.free_slots.extend(e.slot for e in ended)
    self.finished += len(ended)
    if ended:
      self.pending = PendingCopy(snapshot, ended)

  def collect(self) -> None:
    """Copies the pending finished rows into `out` and reports the groups they complete."""
    if self.pending is None:
      return
    out, G = self.out, self.requests.group_size
    tokens, logprobs, versions = (np.asarray(x) for x in self.pending.snapshot[1:4])
    routing = self.pending.snapshot[4]
    routing = None if routing is None else np.asarray(routing)
    for e in self.pending.ended:
      out.tokens[e.row], out.logprobs[e.row], out.versions[e.row] = (
          tokens[e.slot], logprobs[e.slot], versions[e.slot])
      if routing is not None:
        out.routing[e.row] = routing[e.slot]
      out.mask[e.row, :e.length], out.lengths[e.row] = True, e.length
      p = e.row // G
      self.left_in_group[p] -= 1
      if self.left_in_group[p] == 0 and self.on_finish is not None:
        self.on_finish(p, EngineOutput(*(None if x is None else x[p * G:(p + 1) * G]
                                         for x in out)))
    self.pending = None

  def poll_params(self) -> None:
    """Switches to the source's params if their version is new (partial rollouts)."""
    got = self.params_source()
    if got is None or int(got[0]) == self.version:
      return
    self.version, self.params = int(got[0]), got[1]
    refresh_kv = self.engine.refresh_kv
    if refresh_kv and self.slot_row:
      self.state = self.engine.refresh(self.params, self.state, mesh=self.mesh)
      self.engine.stats["refresh"] += 1
    # Prompts prefilled but not started are prefilled again under the new params (as if
    # prefilled now); with `refresh_kv` a started group's remaining members too.
    again = [e for e in self.entries if refresh_kv or e.inserted == 0]
    if again:
      self.prefill(again, self.params)
      for e in again:
        e.version = self.version
