"""Validation alongside training: one supervised thread, one pass at a time.

`submit(step, params)` starts a validation pass of the params of `step` (an immutable published
copy, so training may go on donating its own buffers) and returns at once; the trainer keeps
training and collects finished passes with `poll()`, logging each under the step it describes.
Validation never touches the lag ring or the params handoff, so the forced-lag contract is
unchanged.

Bounded blocking: if the previous pass is still running when the next is due, `submit` waits
for it at most `max_wait_s` and then raises `ValidationStalled` (a stuck environment or engine
fails the run loudly instead of hanging it). Any exception of a pass re-raises, with its
traceback, from the trainer's next `poll`/`submit`/`wait`. `asynchronous=False` runs each pass
inline in `submit` (the multi-process mode, where every process must launch computations in the
same order).
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Callable


class ValidationStalled(RuntimeError):
  """A validation pass did not finish within `val.max_wait_s`."""


class ValidationFailed(RuntimeError):
  """A validation pass raised; `__cause__` is its exception, the message has its traceback."""


class Validator:

  def __init__(self, run: Callable[[int, object], dict], *, asynchronous: bool = True,
               max_wait_s: float = 600.0, name: str = "jaxrl-validation"):
    self._run, self.asynchronous, self.max_wait_s, self.name = run, asynchronous, max_wait_s, name
    self._cond = threading.Condition()
    self._busy: int | None = None  # step of the pass in flight
    self._done: list[tuple[int, dict]] = []
    self._error: BaseException | None = None
    self._error_text = ""
    self._thread: threading.Thread | None = None
    self.wait_s = 0.0  # total time the trainer spent waiting for validation

  def _pass(self, step: int, params) -> None:
    t0 = time.monotonic()
    try:
      metrics = dict(self._run(step, params))
      metrics.setdefault("val/time_s", time.monotonic() - t0)
    except BaseException as e:  # noqa: BLE001 - handed to the trainer
      with self._cond:
        self._error, self._error_text = e, traceback.format_exc()
        self._busy = None
        self._cond.notify_all()
      return
    with self._cond:
      self._done.append((step, metrics))
      self._busy = None
      self._cond.notify_all()

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      err, self._error = self._error, None
      raise ValidationFailed(f"validation pass failed:\n{self._error_text}") from err

  def _wait_idle(self, timeout: float) -> None:
    t0 = time.monotonic()
    deadline = t0 + timeout
    with self._cond:
      while self._busy is not None and self._error is None:
        left = deadline - time.monotonic()
        if left <= 0:
          self.wait_s += time.monotonic() - t0
          raise ValidationStalled(
              f"the validation pass of step {self._busy} did not finish within "
              f"val.max_wait_s={self.max_wait_s:g}")
        self._cond.wait(min(left, 0.05))
      self.wait_s += time.monotonic() - t0
      self._raise_if_failed()

  def submit(self, step: int, params) -> None:
    """Starts validating `params` (the policy after `step` updates)."""
    self._wait_idle(self.max_wait_s)
    if not self.asynchronous:
      with self._cond:
        self._busy = step
      self._pass(step, params)
      with self._cond:
        self._raise_if_failed()
      return
    with self._cond:
      self._busy = step
    self._thread = threading.Thread(target=self._pass, args=(step, params), daemon=True,
                                    name=f"{self.name}-{step}")
    self._thread.start()

  def poll(self) -> list[tuple[int, dict]]:
    """Finished passes since the last poll, as `(step, metrics)`, oldest first."""
    with self._cond:
      self._raise_if_failed()
      done, self._done = self._done, []
    return done

  def wait(self) -> list[tuple[int, dict]]:
    """Waits (at most `max_wait_s`) for the pass in flight; returns every unpolled result."""
    self._wait_idle(self.max_wait_s)
    return self.poll()

  def close(self, timeout: float = 5.0) -> None:
    """Gives a running pass `timeout` seconds to end; a daemon thread never blocks exit."""
    t = self._thread
    if t is not None and t.is_alive():
      t.join(timeout)
