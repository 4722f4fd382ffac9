"""Stopping a run cleanly: the first SIGTERM / SIGINT asks for a checkpoint and a clean exit."""

from __future__ import annotations

import os
import signal
import sys


class Stop:
  """Set by SIGTERM / SIGINT (preemption, Ctrl-C): the run checkpoints and exits cleanly.

  The handler only records the signal; the trainer acts on it between steps. A second signal
  restores the default handlers and acts at once: a second SIGTERM terminates the process; a
  second Ctrl-C ends it with one `jaxrl:` line and exit status 130 (`quit_on_second`, the
  default: no KeyboardInterrupt traceback from whichever thread it lands in, and no half-run
  cleanup; the last finished checkpoint is what a rerun resumes from), or raises
  KeyboardInterrupt (`quit_on_second=False`, for a caller that handles it).
  """

  def __init__(self, quit_on_second: bool = True):
    self.signal: int | None = None
    self.quit_on_second = quit_on_second

  def __call__(self) -> bool:
    return self.signal is not None

  def handler(self, signum, frame) -> None:
    if self.signal is None:
      self.signal = signum
      return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signum == signal.SIGINT:
      if not self.quit_on_second:
        raise KeyboardInterrupt
      sys.stdout.flush()
      os.write(2, b"\njaxrl: interrupted twice: stopped at once, without a checkpoint; the same "
                  b"command resumes from the last finished one\n")
      os._exit(130)
    os.kill(os.getpid(), signum)
