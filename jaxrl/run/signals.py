"""Stopping a run cleanly: the first SIGTERM / SIGINT asks for a checkpoint and a clean exit."""

from __future__ import annotations

import os
import signal


class Stop:
  """Set by SIGTERM / SIGINT (preemption, Ctrl-C): the run checkpoints and exits cleanly.

  The handler only records the signal; the trainer acts on it between steps. A second signal
  restores the default handlers and acts at once: a second Ctrl-C raises KeyboardInterrupt, a
  second SIGTERM terminates the process.
  """

  def __init__(self):
    self.signal: int | None = None

  def __call__(self) -> bool:
    return self.signal is not None

  def handler(self, signum, frame) -> None:
    if self.signal is None:
      self.signal = signum
      return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signum == signal.SIGINT:
      raise KeyboardInterrupt
    os.kill(os.getpid(), signum)
