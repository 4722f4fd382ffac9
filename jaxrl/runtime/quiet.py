"""Orbax's background noise, silenced: what its threads print about a failure that also reaches
the caller, who reports it in one line (`jaxrl.runtime.checkpoint`).

A save that fails (a full disk) or a restore that fails (a damaged checkpoint) leaves Orbax's
threads and TensorStore's callbacks to report it again, each with a traceback:

- TensorStore's callbacks into an event loop Orbax has already closed print `RuntimeError: Event
  loop is closed` (through `sys.unraisablehook`, without an object, or `sys.excepthook`), one
  traceback per pending read or write;
- Orbax logs each failed background operation at ERROR with its traceback (absl logging);
- coroutines of the failed operation that never ran are reported as "Exception ignored" when
  they are collected, at the latest when the process exits;
- the failed operation's other tasks, whose errors nobody awaited once the first one raised, are
  logged by asyncio ("Task exception was never retrieved") when they are collected, at a moment
  the garbage collector picks.

`install()` filters exactly these (the first by its type, message and raising frame, the others
by the Orbax source file they come from or were raised in); every other exception, log line and warning passes.
`JAXRL_DEBUG=1` leaves them all on the console.
"""

from __future__ import annotations

import logging
import os
import sys

_ORBAX = os.sep + "orbax" + os.sep


def debug() -> bool:
  """`JAXRL_DEBUG` asks for every traceback (anything but "", "0", "false")."""
  return os.environ.get("JAXRL_DEBUG", "").strip().lower() not in ("", "0", "false")


def closed_loop_callback(exc_type, exc, tb) -> bool:
  """A TensorStore callback into an Orbax event loop that is already closed."""
  if exc_type is not RuntimeError or str(exc) != "Event loop is closed":
    return False
  last = None
  while tb is not None:
    last, tb = tb, tb.tb_next
  return last is not None and last.tb_frame.f_code.co_name == "_check_closed"


def from_orbax(obj) -> bool:
  """An Orbax coroutine (never run, or abandoned with its operation)."""
  code = getattr(obj, "cr_code", None)
  return code is not None and _ORBAX in code.co_filename


class _OrbaxErrors(logging.Filter):
  """Drops Orbax's ERROR records (a failed background operation, which its caller also raises)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and _ORBAX in (record.pathname or ""))


def raised_in_orbax(exc_info) -> bool:
  """An exception whose traceback passes through Orbax's source."""
  tb = exc_info[2] if isinstance(exc_info, tuple) and len(exc_info) == 3 else None
  while tb is not None:
    if _ORBAX in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


class _OrbaxTasks(logging.Filter):
  """Drops asyncio's reports of Orbax tasks whose errors nobody retrieved (the operation's
  caller has the first of them and reports it)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and raised_in_orbax(record.exc_info))


def install() -> None:
  """Installs the filters (nothing with `JAXRL_DEBUG`). Each hook is wrapped at most once: a
  hook that is already jaxrl's stays; one that something else has put back since (a test
  harness restoring its own) is wrapped again."""
  if debug():
    return
  if not getattr(sys.excepthook, "_jaxrl_quiet", False):
    excepthook = sys.excepthook

    def quiet_excepthook(exc_type, exc, tb):
      if not closed_loop_callback(exc_type, exc, tb):
        excepthook(exc_type, exc, tb)

    quiet_excepthook._jaxrl_quiet = True
    sys.excepthook = quiet_excepthook
  if not getattr(sys.unraisablehook, "_jaxrl_quiet", False):
    unraisablehook = sys.unraisablehook

    def quiet_unraisablehook(unraisable):
      if not (from_orbax(unraisable.object) or closed_loop_callback(
          unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)):
        unraisablehook(unraisable)

    quiet_unraisablehook._jaxrl_quiet = True
    sys.unraisablehook = quiet_unraisablehook
  absl = logging.getLogger("absl")  # Orbax logs through absl's logger
  if not any(isinstance(f, _OrbaxErrors) for f in absl.filters):
    absl.addFilter(_OrbaxErrors())
  tasks = logging.getLogger("asyncio")  # a task's unretrieved error is logged here
  if not any(isinstance(f, _OrbaxTasks) for f in tasks.filters):
    tasks.addFilter(_OrbaxTasks())
