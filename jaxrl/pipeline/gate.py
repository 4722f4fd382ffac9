"""The submission gate of the forced-lag pipeline: L+1 batch slots between the rollout worker and
the trainer, with one release point.

Contract (lag L >= 0, capacity L+1, batch ids 0, 1, 2, ...):

- The worker calls `reserve()` before producing batch b; it blocks while L+1 slots are held.
- The trainer's `pull()` of batch t first frees the slot of batch t-1, then waits for batch t.
  Release on the *next* pull, never on hand-off: releasing when batch t is handed over would let
  batch t+L+1 start with params one version older, making staleness L+1 and L = 0 asynchronous.
- Hence batches 0..L may be reserved before any pull, and after k >= 1 pulls exactly L+k batches
  have been reserved once the worker has caught up; with L = 0 nothing of batch t+1 is reserved
  before the trainer asks for it.
- Delivered items reach the trainer strictly in batch-id order, whatever order they arrive in.

The gate is the only flow control: delivered items wait in an unbounded dict (at most L+1 of them
by construction), never in a bounded queue that could block a worker holding a slot.

A lag that changes (`rollout.lag = "auto"`, `jaxrl.pipeline.tuner`): the gate holds the lag of
every batch id, a schedule of `set_lag(from_batch, lag)` changes, and batch b takes a slot only
while fewer than `lag_of(b) + 1` are held, i.e. once the pull of batch `b - lag_of(b)` has begun:
exactly the fixed-lag rule for the lag in force at b, so batch b is made with params version
`version_of(b) = max(0, b - lag_of(b))` whatever the timing. The ring has `max_lag + 1` slots. A
change may name only batches not yet reserved; raising the lag lets the worker run one batch
further ahead at once, lowering it makes the worker wait for the pulls the smaller lag needs.

Supervision: `fail(exc)` wakes the trainer, whose current or next `pull()` raises `WorkerFailed`
carrying the worker's traceback; a watchdog raises `StallError` when no batch arrives for
`stall_timeout_s`; `close()` wakes every waiter. All state sits behind ONE `threading.Condition`
and every wait is `while not predicate: cond.wait(timeout)`, so a notify can never be lost.
"""

from __future__ import annotations

import threading
import time
import traceback

from jaxrl.core.errors import UserError

# Waits wake at least this often so a deadline is never overshot by more than this, even if a
# notify were missed; notifies do the real work.
_POLL_S = 0.05


class PipelineClosed(Exception):
  """The pipeline was closed (shutdown): raised to waiters instead of blocking forever."""


class WorkerFailed(RuntimeError):
  """The rollout worker died. `__cause__` is the worker's exception; the message holds its
  traceback text, so the trainer's error shows where the worker actually failed."""


class StallError(UserError, RuntimeError):
  """No batch arrived within `rollout.stall_timeout_s` while the trainer waited: one line naming
  the key (`python -m jaxrl.train` ends with it, without a traceback)."""


class LagGate:
  """Host-side coordinator of the forced-lag ring (see the module docstring for the contract).

  Thread-safety: `reserve`/`deliver`/`fail` may be called from any worker thread(s), `pull` from
  one trainer thread; `stats` and `close` from anywhere. The blocked-time accounting
  (worker_blocked_s, worker_waiting) assumes one reserving thread, as RolloutWorker has.
  """

  def __init__(self, lag: int, stall_timeout_s: float = 600.0, max_lag: int | None = None):
    """`lag`: the lag of batch 0 on; `max_lag` (default `lag`): the largest `set_lag` may set,
    which sizes the ring."""
    for name, v in (("rollout.lag", lag), ("rollout.max_lag", lag if max_lag is None else max_lag)):
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if not stall_timeout_s > 0:
      raise ValueError(f"rollout.stall_timeout_s must be > 0, got {stall_timeout_s!r}")
    self.lag = lag  # the lag of batch 0 (`lag_of` gives any batch's)
    self.max_lag = max(lag, lag if max_lag is None else max_lag)
    self.capacity = self.max_lag + 1  # >= 1 always, so L = 0 can never deadlock on an empty gate
    self._schedule: list[tuple[int, int]] = [(0, lag)]  # (first batch id, its lag), ascending
    self.stall_timeout_s = float(stall_timeout_s)
    self._cond = threading.Condition()
    self._submitted = 0  # batch ids 0..submitted-1 have been reserved
    self._freed = 0  # batch ids 0..freed-1 have released their slot
    self._consumed = 0  # batch ids 0..consumed-1 have been pulled
    self._completed = 0
    self._ready: dict[int, object] = {}  # delivered, not yet pulled
    self._delivered_ids: set[int] = set()  # delivered and not yet pulled (guards double delivery)
    self._failure: BaseException | None = None
    self._failure_text = ""
    self._closed = False
    self._last_progress = time.monotonic()
    self._max_held = 0
    self._worker_blocked_s = 0.0
    self._trainer_wait_s = 0.0
    self._reserve_since: float | None = None  # start of the worker's current blocked reserve()
    self._pull_since: float | None = None  # start of the trainer's current pull() wait
    self._last_pull_waited = False  # the last pull found its batch not yet delivered
    self._counters = {"regenerated": 0, "filtered": 0}

  # -- worker side ---------------------------------------------------------------------------

  def reserve(self) -> int | None:
    """Takes a slot for the next batch and returns its id; blocks while all L+1 slots are held.

    Returns None once the gate is closed or has failed (the worker should exit).
    """
    with self._cond:
      start = time.monotonic()
      blocked = False
      try:
        while self._open() and self._full_locked():
          if not blocked:
            blocked, self._reserve_since = True, start
          self._cond.wait(_POLL_S)
      finally:
        if blocked:
          self._worker_blocked_s += time.monotonic() - start
          self._reserve_since = None
      return self._take_slot_locked() if self._open() else None

  def try_reserve(self) -> int | None:
    """`reserve()` without waiting: the next batch id if a slot is free now, else None (also
    when the gate is closed or failed). For a worker that runs inline, between the trainer's
    pulls (`InlineWorker`)."""
    with self._cond:
      if not self._open() or self._full_locked():
        return None
      return self._take_slot_locked()

  def _full_locked(self) -> bool:
    # The next batch may start once the pull of batch `b - lag_of(b)` has begun (module docstring).
    return self._submitted - self._freed >= self._lag_of_locked(self._submitted) + 1

  def _take_slot_locked(self) -> int:
    batch_id = self._submitted
    self._submitted += 1
    self._max_held = max(self._max_held, self._submitted - self._freed)
    self._check()
    self._cond.notify_all()
    return batch_id

  def deliver(self, batch_id: int, item) -> None:
    """Hands the finished batch `batch_id` to the trainer (it is pulled in batch-id order).

    Delivering an id that was never reserved or was already delivered raises ValueError. After
    `close()` the item is dropped: nobody will pull it.
    """
    with self._cond:
      if self._closed:
        return
      if not self._consumed <= batch_id < self._submitted or batch_id in self._delivered_ids:
        raise ValueError(f"deliver({batch_id}): not a reserved, undelivered batch (reserved "
                         f"{self._consumed}..{self._submitted - 1}, delivered "
                         f"{sorted(self._delivered_ids)})")
      self._ready[batch_id] = item
      self._delivered_ids.add(batch_id)
      self._completed += 1
      self._last_progress = time.monotonic()
      self._cond.notify_all()

  def fail(self, exc: BaseException) -> None:
    """Records that the worker died with `exc` and wakes the trainer. The first failure wins."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    with self._cond:
      if self._failure is None:
        self._failure, self._failure_text = exc, text
      self._cond.notify_all()

  def add(self, counter: str, n: int = 1) -> None:
    """Adds `n` to a cumulative counter reported by `stats()` (e.g. "regenerated", "filtered")."""
    with self._cond:
      self._counters[counter] = self._counters.get(counter, 0) + n

  # -- trainer side --------------------------------------------------------------------------

  def pull(self) -> tuple[int, object]:
    """Frees the slot of the previously pulled batch, then returns `(batch_id, item)` for the next
    batch in order, waiting for it.

    Raises WorkerFailed (within ~_POLL_S of `fail()`, immediately when notified), PipelineClosed
    after `close()`, StallError when no batch was delivered for `stall_timeout_s` (measured from
    the later of this pull's start and the last delivery). A failed or stalled pull frees nothing
    twice: the release of batch t-1 is idempotent, so calling pull again is safe.
    """
    with self._cond:
      self._release_locked()
      start = time.monotonic()
      self._pull_since = start
      self._last_pull_waited = False
      try:
        while True:
          self._raise_if_failed()
          if self._closed:
            raise PipelineClosed("pipeline closed")
          if self._consumed in self._ready:
            break
          self._last_pull_waited = True
          now = time.monotonic()
          deadline = max(start, self._last_progress) + self.stall_timeout_s
          if now >= deadline:
            raise StallError(
                f"no rollout batch arrived for {self.stall_timeout_s:g} s while the trainer waited "
                f"for batch {self._consumed} (rollout.stall_timeout_s={self.stall_timeout_s:g}; "
                "raise it if rollouts are this slow, or look for what holds the rollout "
                f"worker); gate: {self._stats_locked()}")
          self._cond.wait(min(_POLL_S, deadline - now))
      finally:
        self._trainer_wait_s += time.monotonic() - start
        self._pull_since = None
      batch_id = self._consumed
      item = self._ready.pop(batch_id)
      self._delivered_ids.discard(batch_id)
      self._consumed += 1
      self._check()
      return batch_id, item

  def release(self) -> None:
    """Frees the slot of the previously pulled batch now, as the next `pull()` would first do
    (idempotent). An inline worker calls it before producing what that pull will return."""
    with self._cond:
      self._release_locked()

  def _release_locked(self) -> None:
    if self._freed < self._consumed:
      self._freed = self._consumed
      self._cond.notify_all()

  def stats(self) -> dict:
    """A consistent snapshot of the gate's state and cumulative counters.

    slots_held, capacity (= L+1), utilization (= held / capacity), max_slots_held (high-water
    mark), submitted (= reserved), completed (= delivered), consumed (= pulled), ready (delivered,
    not pulled), worker_blocked_s / trainer_wait_s (total seconds reserve() / pull() waited,
    including a wait in progress), worker_waiting / trainer_waiting (reserve() is blocked on a full
    ring / pull() is blocked on a batch not yet delivered),
    regenerated / filtered and any other counter passed to `add`, closed, failed.
    """
    with self._cond:
      return self._stats_locked()

  def close(self) -> None:
    """Shuts the gate: every waiter wakes (reserve returns None, pull and handoff waits checking
    `closed` raise PipelineClosed). Idempotent."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  # -- the lag of each batch -------------------------------------------------------------------

  def set_lag(self, from_batch: int, lag: int) -> None:
    """Batches `from_batch`, `from_batch + 1`, ... take lag `lag` (0 <= lag <= max_lag) until the
    next change. `from_batch` must not be reserved yet (a reserved batch keeps the version its
    lag gave it) nor precede an earlier change."""
    with self._cond:
      if not 0 <= lag <= self.max_lag:
        raise ValueError(f"set_lag: lag {lag} outside 0..{self.max_lag} (rollout.max_lag)")
      if from_batch < self._submitted or from_batch < self._schedule[-1][0]:
        raise ValueError(f"set_lag({from_batch}): batches up to {self._submitted - 1} are "
                         f"reserved and the last change is at batch {self._schedule[-1][0]}")
      if lag != self._schedule[-1][1]:
        self._schedule.append((from_batch, lag))
      # Only the entries still in force for the last pulled batch onward are kept.
      while len(self._schedule) > 1 and self._schedule[1][0] <= max(self._consumed - 1, 0):
        self._schedule.pop(0)
      self._cond.notify_all()

  def lag_of(self, batch_id: int) -> int:
    """The lag batch `batch_id` is (or will be, as set so far) made under."""
    with self._cond:
      return self._lag_of_locked(batch_id)

  def version_of(self, batch_id: int) -> int:
    """The params version batch `batch_id` is made with: `max(0, b - lag_of(b))`."""
    with self._cond:
      return max(0, batch_id - self._lag_of_locked(batch_id))

  def version_floor(self, first_batch: int) -> int:
    """The oldest params version a batch >= `first_batch` can still ask for, as set so far (a
    batch a change could still reach is >= `first_batch + max_lag`, so its version is >=
    `first_batch`)."""
    with self._cond:
      return min(max(0, b - self._lag_of_locked(b))
                 for b in range(first_batch, first_batch + self.capacity))

  def next_to_make(self) -> int | None:
    """The first batch not yet delivered, which one worker is making or starts next, when it
    holds or may now take a slot (under its lag as set so far); None while the ring is full."""
    with self._cond:
      b = self._completed
      if b < self._submitted or b - self._freed < self._lag_of_locked(b) + 1:
        return b
      return None

  def _lag_of_locked(self, batch_id: int) -> int:
    lag = self._schedule[0][1]
    for first, entry in self._schedule:
      if first > batch_id:
        break
      lag = entry
    return lag

  # -- checkpoints ---------------------------------------------------------------------------

  def quiesce(self, timeout: float) -> dict[int, object]:
    """Waits until the ring is full and every reserved batch is delivered; returns the delivered,
    unpulled items by batch id.

    The worker is then blocked in `reserve()` and produces nothing (its RNG does not move) until
    the trainer's next pull: the state a checkpoint needs. Raises WorkerFailed if the worker
    died, PipelineClosed after `close()`, StallError after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    with self._cond:
      while True:
        self._raise_if_failed()
        if self._closed:
          raise PipelineClosed("pipeline closed")
        if self._full_locked() and self._completed == self._submitted:
          return dict(self._ready)
        left = deadline - time.monotonic()
        if left <= 0:
          raise StallError(f"the rollout worker did not finish its reserved batches within "
                           f"{timeout:g} s for a checkpoint (rollout.stall_timeout_s); gate: "
                           f"{self._stats_locked()}")
        self._cond.wait(min(_POLL_S, left))

  def delivered(self) -> tuple[dict[int, object], dict]:
    """What a checkpoint of a ring that is not full holds, without waiting (the worker failed, or
    waits on rollouts that will not come): the delivered, unpulled items by batch id and the
    gate's counters with the undelivered reservations given back, so a resumed worker reserves
    the first undelivered batch again. Batches are delivered in order here (`Receiver`), so the
    delivered ones are the consumed .. completed - 1 that follow the last pull."""
    with self._cond:
      ready = {b: self._ready[b] for b in sorted(self._ready)}
      if sorted(ready) != list(range(self._consumed, self._consumed + len(ready))):
        raise RuntimeError(f"delivered batches {sorted(ready)} do not follow the last pull "
                           f"({self._consumed - 1}): the ring cannot be saved as it is")
      state = self._checkpoint_state_locked()
      state["submitted"] = state["completed"] = self._consumed + len(ready)
      return ready, state

  def checkpoint_state(self) -> dict:
    """The counters a resumed gate needs (JSON); pair with `quiesce()`'s items."""
    with self._cond:
      return self._checkpoint_state_locked()

  def _checkpoint_state_locked(self) -> dict:
    return {"submitted": self._submitted, "freed": self._freed, "consumed": self._consumed,
            "completed": self._completed, "max_held": self._max_held,
            "counters": dict(self._counters), "schedule": [list(e) for e in self._schedule]}

  def restore(self, state: dict, ready: dict[int, object]) -> None:
    """Puts a fresh gate (before its worker starts) where a checkpointed one was: the worker's
    next `reserve()` returns the next batch id, and `ready` (the delivered, unpulled batches)
    is pulled first, in order."""
    with self._cond:
      if self._submitted or self._consumed:
        raise RuntimeError("LagGate.restore() needs a fresh gate")
      want = set(range(state["consumed"], state["submitted"]))
      if set(ready) != want:
        raise ValueError(f"restore: ready batches {sorted(ready)} != the reserved, unpulled "
                         f"{sorted(want)}")
      self._submitted, self._freed = state["submitted"], state["freed"]
      self._consumed, self._completed = state["consumed"], state["completed"]
      self._max_held = state["max_held"]
      self._counters = dict(state["counters"])
      # A checkpoint of a fixed lag before schedules were saved: that lag throughout.
      self._schedule = [(int(b), int(lag)) for b, lag in state.get("schedule", [[0, self.lag]])]
      if any(not 0 <= lag <= self.max_lag for _, lag in self._schedule):
        raise ValueError(f"restore: lags {self._schedule} outside 0..{self.max_lag}")
      self._ready = dict(ready)
      self._delivered_ids = set(ready)
      self._last_progress = time.monotonic()
      self._check()
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    with self._cond:
      return self._closed

  @property
  def last_pull_waited(self) -> bool:
    """The last `pull()` found its batch not yet delivered: the worker was the slower side."""
    with self._cond:
      return self._last_pull_waited

  @property
  def ended(self) -> bool:
    """Closed, or its worker failed: nothing more will be delivered."""
    with self._cond:
      return not self._open()

  # -- internals -----------------------------------------------------------------------------

  def _open(self) -> bool:
    return not self._closed and self._failure is None

  def _raise_if_failed(self) -> None:
    if self._failure is not None:
      raise WorkerFailed(
          f"rollout worker failed: {type(self._failure).__name__}: {self._failure}\n"
          f"--- worker traceback ---\n{self._failure_text}") from self._failure

  def _check(self) -> None:
    # The gate's invariants; a violation is a bug in the gate, so fail loudly where it happens.
    held = self._submitted - self._freed
    assert 0 <= held <= self.capacity, (held, self.capacity)
    assert self._freed <= self._consumed <= self._submitted, (self._freed, self._consumed)
    assert len(self._ready) <= self.capacity, len(self._ready)

  def _stats_locked(self) -> dict:
    now = time.monotonic()
    held = self._submitted - self._freed
    out = {
        "slots_held": held,
        "capacity": self.capacity,
        # The lag of the batch pulled last (the one this step consumes): its staleness after warm-up.
        "lag": self._lag_of_locked(max(self._consumed - 1, 0)),
        "utilization": held / self.capacity,
        "max_slots_held": self._max_held,
        "submitted": self._submitted,
        "completed": self._completed,
        "consumed": self._consumed,
        "ready": len(self._ready),
        "worker_blocked_s": self._worker_blocked_s
        + (now - self._reserve_since if self._reserve_since is not None else 0.0),
        "trainer_wait_s": self._trainer_wait_s
        + (now - self._pull_since if self._pull_since is not None else 0.0),
        # Blocked *now*: a waiter that was notified but has not run yet is not counted, so
        # "worker_waiting" really means the ring is full and the worker is idle.
        "worker_waiting": self._reserve_since is not None and held >= self.capacity,
        "trainer_waiting": self._pull_since is not None and self._consumed not in self._ready,
        "closed": self._closed,
        "failed": self._failure is not None,
    }
    out.update(self._counters)
    return out
