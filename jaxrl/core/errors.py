"""Errors a user can cause and fix: a bad config key, a missing or malformed file, a run directory
in use; and, at run time, what a key or the machine decides: a full disk during a checkpoint, a
rollout or evaluation stall (`rollout.stall_timeout_s`, `val.max_wait_s`), a regeneration cap.
`python -m jaxrl.train` prints them as one line, `jaxrl: <message>`, and exits non-zero without a
traceback (`--config.debug=true` or `JAXRL_DEBUG=1` shows it). docs/failures.md lists them.

Each concrete error also derives from the built-in class it refines (ValueError for a malformed
file, ...), so code that catches the built-in class keeps working.
"""

from __future__ import annotations


class UserError(Exception):
  """An error whose message alone tells the user what to change (it names the key, file, line
  or directory)."""


class DataFileError(UserError, ValueError):
  """A task's data file that cannot be read as the task needs: the message names the file and,
  for a bad row, its line."""
