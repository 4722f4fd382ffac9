"""The rollout worker: one supervised host thread that fills the lag ring.

Loop: reserve a slot for batch b -> wait for params version `gate.version_of(b)` (=
`params_version(b, lag)` at a fixed lag) -> produce -> deliver. Any exception (including KeyboardInterrupt/SystemExit raised in the thread) is handed to
the gate, so the trainer's pull raises WorkerFailed with the original traceback; the thread then
exits. `stop()` closes the gate, which wakes every wait in this loop; `produce` itself must be
interruptible (poll `worker.should_stop()` in long waits) for stop to be prompt.

`InlineWorker` runs the same loop in the trainer's thread instead, producing, just before each
pull, exactly the batches the threaded worker would have started by then, with the same params
versions: the same batches and the same staleness, with device work launched in one fixed
order. Several processes use it only where a batch cannot be split by process
(`jaxrl.pipeline.producer.process_share` is None): otherwise each process's thread makes its own
share on its own devices, and only the trainer thread launches programs that span processes.
"""

from __future__ import annotations

import threading

from jaxrl.pipeline.gate import LagGate, PipelineClosed
from jaxrl.pipeline.handoff import ParamsHandoff


def params_version(batch_id: int, lag: int) -> int:
  """The params version batch `batch_id` must be generated with under forced lag: max(0, b - L).

  Forced, not "newest": the trainer publishes version t before pulling batch t, and the gate lets
  batch t+L start only after that pull, so version t is always published by then; using exactly
  it makes first-token staleness at consumption exactly min(t, L), independent of timing.
  """
  return max(0, batch_id - lag)


class RolloutWorker:
  """Runs `produce(batch_id, params, version) -> item` for batches 0, 1, 2, ... on a thread.

  Use as a context manager (`with RolloutWorker(...) as w:`) so any exit, including Ctrl-C in the
  main thread, stops the thread.
  """

  def __init__(self, gate: LagGate, handoff: ParamsHandoff, produce, lag: int,
               name: str = "rollout-worker", stop_timeout_s: float = 10.0,
               failed_stop_timeout_s: float = 60.0):
    if lag != gate.lag:  # the lag of batch 0; the gate holds every batch's (`LagGate.lag_of`)
      raise ValueError(f"worker lag {lag} != gate lag {gate.lag}")
    self.stop_timeout_s = stop_timeout_s
    # Leaving on an error, the thread gets longer: it may be inside a call nothing interrupts (an
    # XLA compilation on a slow machine can outlast a short rollout.stall_timeout_s), and a
    # process that exits while a thread is inside XLA aborts (SIGABRT, exit 134) instead of
    # ending with the error's own message and exit status.
    self.failed_stop_timeout_s = failed_stop_timeout_s
    self.gate = gate
    self.handoff = handoff
    self.produce = produce
    self.name = name
    self._thread: threading.Thread | None = None

  def should_stop(self) -> bool:
    """True once the pipeline is shutting down; long-running `produce` code should poll this."""
    return self.gate.closed

  def _run(self) -> None:
    try:
      while True:
        batch_id = self.gate.reserve()
        if batch_id is None:
          return
        version = self.gate.version_of(batch_id)
        params = self.handoff.get(version, should_stop=self.should_stop)
        item = self.produce(batch_id, params, version)
        self.gate.deliver(batch_id, item)
    except PipelineClosed as e:
      if not self.gate.closed:  # raised by user code while the pipeline is open: a real failure
        self.gate.fail(e)
    except BaseException as e:  # noqa: BLE001  (every failure must reach the trainer)
      self.gate.fail(e)

  def start(self) -> None:
    """Starts the thread (once)."""
    if self._thread is not None:
      raise RuntimeError(f"{self.name} already started")
    # daemon: a produce() that ignores should_stop must not keep the interpreter alive at exit;
    # stop() still reports it as an error.
    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
    self._thread.start()

  def stop(self, timeout: float | None = None) -> None:
    """Closes the gate and joins the thread; RuntimeError if it is still alive after `timeout`
    (default `stop_timeout_s`)."""
    timeout = self.stop_timeout_s if timeout is None else timeout
    self.gate.close()
    if self._thread is None:
      return
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise RuntimeError(f"{self.name} did not stop within {timeout:g} s (is produce() polling "
                         f"should_stop()?)")

  def is_alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def __enter__(self) -> "RolloutWorker":
    self.start()
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    if exc is None:
      self.stop()
      return False
    # Leaving on an error: that error is the one the caller sees. A thread that outlives even
    # the longer wait is named in a note on it, never raised in its place.
    try:
      self.stop(max(self.stop_timeout_s, self.failed_stop_timeout_s))
    except RuntimeError as still_running:
      exc.add_note(f"{still_running}; it was left running when the run stopped")
    return False  # never swallow the exception (KeyboardInterrupt included)


class InlineWorker:
  """The rollout loop run by the trainer: call `catch_up()` right before each `gate.pull()`.

  `catch_up` frees the previously pulled batch's slot (as the pull would), then reserves and
  produces every batch that now has a free slot, each with params `gate.version_of(b)`,
  which the trainer has always published by then (see `params_version`). The ring therefore
  holds the same batches, made with the same versions, as with `RolloutWorker`; only the
  overlap of rollout and training is lost. An exception in `produce` propagates to the caller.
  Same context-manager interface as `RolloutWorker`.
  """

  def __init__(self, gate: LagGate, handoff: ParamsHandoff, produce, lag: int):
    if lag != gate.lag:
      raise ValueError(f"worker lag {lag} != gate lag {gate.lag}")
    self.gate, self.handoff, self.produce = gate, handoff, produce

  def should_stop(self) -> bool:
    return self.gate.closed

  def catch_up(self) -> int:
    """Produces the batches the gate lets start now; returns how many."""
    self.gate.release()
    made = 0
    while (batch_id := self.gate.try_reserve()) is not None:
      version = self.gate.version_of(batch_id)
      params = self.handoff.get(version, timeout=0.0)
      self.gate.deliver(batch_id, self.produce(batch_id, params, version))
      made += 1
    return made

  def is_alive(self) -> bool:
    return False

  def stop(self, timeout: float = 10.0) -> None:
    del timeout
    self.gate.close()

  def __enter__(self) -> "InlineWorker":
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    self.stop()
    return False
