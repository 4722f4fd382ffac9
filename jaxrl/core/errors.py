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


class StopWithCheckpoint(UserError):
  """A run-time ending after which the trained state is whole (every rollout process lost while
  the trainer waited for its next batch): the run loop checkpoints its last completed step
  before it ends (`saved(step)`), and the message ends with what to rerun and from where."""

  saved_step: int | None = None
  rerun = "rerun the same command"

  def saved(self, step: int) -> None:
    self.saved_step = int(step)

  def __str__(self) -> str:
    text = super().__str__()
    if self.saved_step is None:
      return f"{text}; {self.rerun} to resume from the last checkpoint"
    return (f"{text}; a checkpoint of step {self.saved_step}, the last completed step, was "
            f"saved: {self.rerun} to resume from it")


class DataFileError(UserError, ValueError):
  """A task's data file that cannot be read as the task needs: the message names the file and,
  for a bad row, its line."""
