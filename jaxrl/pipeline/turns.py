"""Turns on shared devices: the trainer lets the rollout worker's device work go first.

Colocated on a CPU, the sampler's programs and the train step's run on the same cores, and XLA
runs two programs at once by splitting the cores between them: each takes about as long as
both together. With a lag, the worker is the critical path whenever generation is the longer
side (a slow reward, a judge, a sandbox: the case a lag is for), so sharing the cores with the
train step makes every batch, and with it every step, later by the train step's own work. The
train step has all the time the worker spends waiting on its environments to run alone.

`SamplerFirst` orders the two without changing what either computes:
- the worker marks the batch it makes (`making(batch_id)`) and each device section of it (one
  sampler call and the copy of its outputs to the host, `section()`);
- the trainer, when its pull had to wait for the batch (the worker is the slower side), waits
  once the pull has freed a slot (`LagPipeline.pull`, `wait(upto)`) until the batch the worker
  makes next (`LagGate.next_to_make`) has run its first device section, or ended. The train
  step then runs while the worker waits on that batch's environments.

Where the trainer is the slower side, its pulls find their batches delivered and nothing waits:
two small programs on a CPU's cores then finish sooner side by side than one after the other
(the default run at lag 1: about 41 s of RL either way, 53 s when every step waited). At lag 0 no
batch can be in flight during a step, and nothing ever waits. A wait is bounded by one device
section of the worker, never by its environments or by the gate; it ends at once when the
pipeline closes or its worker fails (`give_up`). Batches, versions and staleness are the gate's
alone and do not change.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

_POLL_S = 0.05  # a wait re-checks `give_up` at least this often


class SamplerFirst:
  """The worker's first device section of each batch goes before the trainer's next step (the
  module docstring). Thread-safe: one worker thread marks, one trainer thread waits."""

  def __init__(self):
    self._cond = threading.Condition()
    self._batch: int | None = None  # the batch the worker is making now
    # Batches 0.._first_done-1 ran their first section (or ended). A resumed pipeline needs no
    # count of the batches made before its checkpoint: the first it makes raises it past them.
    self._first_done = 0
    self.waited_s = 0.0  # the trainer's total time in `wait`
    self.waits = 0  # waits that found the worker's section not yet run

  @contextlib.contextmanager
  def making(self, batch_id: int):
    """The worker makes `batch_id` inside this context (in batch order)."""
    with self._cond:
      self._batch = batch_id
    try:
      yield
    finally:
      self._done(batch_id)

  @contextlib.contextmanager
  def section(self):
    """One device section of the batch being made (a sampler call and the copy of its outputs
    to the host); the first of each batch is the one the trainer waits for."""
    try:
      yield
    finally:
      if self._batch is not None:
        self._done(self._batch)

  def _done(self, batch_id: int) -> None:
    with self._cond:
      if batch_id + 1 > self._first_done:
        self._first_done = batch_id + 1
        self._cond.notify_all()

  def wait(self, upto: int, give_up: Callable[[], bool], timeout_s: float) -> float:
    """Waits until batches 0..upto-1 ran their first device section (or ended), `give_up()`
    holds, or `timeout_s` passed; returns the seconds waited."""
    began = time.monotonic()
    with self._cond:
      if self._first_done >= upto:
        return 0.0
      self.waits += 1
      deadline = began + timeout_s
      while self._first_done < upto and not give_up():
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._cond.wait(min(left, _POLL_S))
    waited = time.monotonic() - began
    self.waited_s += waited
    return waited
