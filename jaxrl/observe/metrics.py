"""Run outputs: `metrics.jsonl` (one line per step), a live progress line, the final chart.

Every line is flushed as it is written, so a killed run keeps everything up to its last step.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from jaxrl.observe import curves
from jaxrl.observe import sinks as sinks_lib

if TYPE_CHECKING:  # rich is imported when a terminal display starts
  import rich.console


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "__array__"):
    v = np.asarray(v)
    return v.item() if v.ndim == 0 else v.tolist()
  return v


class MetricsWriter:
  """Appends one JSON object per call to `<run_dir>/metrics.jsonl` (rows kept in memory only when
  `run_dir` is None: the processes of a multi-process run other than process 0), and passes each
  row on to the sinks of `cfg.logging.backends` (`jaxrl.observe.sinks`: TensorBoard, W&B).

  A sink that raises, when built or on a row, is reported in one line on stderr (`jaxrl: warning:
  ...` naming the backend and the error) and dropped; metrics.jsonl and the run go on.
  """

  def __init__(self, run_dir: str | None, keep_lines: int | None = None, *,
               cfg: Any = None):
    """`keep_lines`: a resumed run's file is cut back to its first `keep_lines` lines (what was
    written when the checkpoint was saved), which are loaded into `rows` (and the sinks continue
    their runs from there). `cfg`: the run config whose `logging.backends` picks the sinks (none
    without it, or without a `run_dir`)."""
    self.path = None if run_dir is None else os.path.join(run_dir, "metrics.jsonl")
    self.rows: list[dict] = []
    if self.path is not None and keep_lines is not None and os.path.exists(self.path):
      with open(self.path) as f:
        lines = f.read().splitlines()[:keep_lines]
      if len(lines) < keep_lines:
        raise ValueError(f"{self.path} has {len(lines)} lines, fewer than the {keep_lines} the "
                         "checkpoint was saved after")
      with open(self.path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
      self.rows = [json.loads(line) for line in lines]
    # A fresh run's file must not exist (jaxrl.run.directory moves a previous run aside): "x" makes a
    # mistake there an error instead of two runs appended into one file.
    mode = "a" if keep_lines is not None else "x"
    self._f = None if self.path is None else open(self.path, mode, buffering=1)
    self._steps = sinks_lib.Steps()
    for row in self.rows:
      self._steps(row)
    self.sinks: list[tuple[str, sinks_lib.Sink]] = []
    if run_dir is None or cfg is None:
      return
    ctx = sinks_lib.SinkContext(run_dir, cfg, None if keep_lines is None else list(self.rows))
    for name in sinks_lib.parse_backends(cfg.logging.backends):
      factory = sinks_lib.BACKENDS[name].factory
      if factory is not None:
        try:
          self.sinks.append((name, factory(ctx)))
        except Exception as e:  # noqa: BLE001  reported; the run goes on without it
          self._report(name, e)

  def write(self, row: dict) -> None:
    row = {k: _plain(v) for k, v in row.items()}
    # NaN is not JSON; keep the key so a reader sees the value was bad rather than missing.
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    if self._f is not None:
      self._f.write(json.dumps(row) + "\n")
    self.rows.append(row)
    step, phase = self._steps(row), str(row.get("phase") or "")
    values = sinks_lib.scalars(row)
    for name, sink in list(self.sinks):
      try:
        sink.write(phase, step, values)
      except Exception as e:  # noqa: BLE001  reported once; the run goes on without it
        self._drop(name, sink, e)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
    sinks, self.sinks = self.sinks, []
    for name, sink in sinks:
      try:
        sink.close()
      except Exception as e:  # noqa: BLE001
        self._report(name, e)

  def _drop(self, name: str, sink, error: Exception) -> None:
    self.sinks = [(n, s) for n, s in self.sinks if s is not sink]
    self._report(name, error)
    try:
      sink.close()
    except Exception:  # noqa: BLE001  already reported as failed
      pass

  @staticmethod
  def _report(name: str, error: Exception) -> None:
    text = " ".join(str(error).split()) or "(no message)"
    print(f"jaxrl: warning: metrics backend {name!r} failed and is turned off for the rest of "
          f"the run (metrics.jsonl has every row): {type(error).__name__}: {text}",
          file=sys.stderr, flush=True)


class Progress:
  """The run's console: one progress display per phase, and lines of text (`say`).

  On a terminal: a rich progress bar redrawn in place (steps done, elapsed time, ETA, then the
  caller's text: reward, val, throughput); `newline()` ends it, leaving it on screen, and the next
  `update` starts a new one; `say` prints above a running bar. Anywhere else (a file, a pipe,
  CI, processes other than 0): the plain line `<step>/<total> | <text>` every `every` steps, at
  the last step and when `force` is set.
  """

  def __init__(self, stream: TextIO | None = None, every: int = 10,
               console: rich.console.Console | None = None):
    """`console`: the rich Console to draw on, which makes the display the terminal one (e.g.
    `Console(force_terminal=True, file=io.StringIO())` to see it in a test); by default one on
    `stream` when `stream` is a terminal."""
    self.stream = stream or sys.stdout
    self.every = max(1, every)
    if console is None and self.stream.isatty():
      import rich.console

      console = rich.console.Console(file=self.stream)
    self.console = console
    self.live = console is not None
    self._bar = None  # the running rich.progress.Progress, between the first update and newline
    self._task = None
    self._total = None

  def update(self, step: int, total: int, text: str, force: bool = False) -> None:
    line = f"{step:>5}/{total} | {text}"
    if not self.live:
      if force or step % self.every == 0 or step == total:
        self.stream.write(line + "\n")
        self.stream.flush()
      return
    if self._bar is None or total != self._total:
      self.newline()
      self._start(step, total)
    self._bar.update(self._task, completed=step, text=text, refresh=True)
    if force:  # kept in the scrollback, as a plain line, above the bar
      self.console.print(line, markup=False, highlight=False, soft_wrap=True)

  def _start(self, step: int, total: int) -> None:
    import rich.progress as rp
    from rich.table import Column

    # On a narrow terminal the text wraps; the bar, counts and times keep their width.
    fixed = lambda: Column(no_wrap=True)  # noqa: E731
    # Redirecting stdout/stderr (so stray prints land above the bar) only when the bar is on one.
    redirect = self.console.file in (sys.stdout, sys.stderr)
    self._bar = rp.Progress(
        rp.BarColumn(bar_width=24, table_column=fixed()),
        rp.MofNCompleteColumn(table_column=fixed()), rp.TimeElapsedColumn(table_column=fixed()),
        rp.TextColumn("ETA", table_column=fixed()), rp.TimeRemainingColumn(table_column=fixed()),
        rp.TextColumn("| {task.fields[text]}", markup=False,
                      table_column=Column(overflow="fold", ratio=1)),
        console=self.console, redirect_stdout=redirect, redirect_stderr=redirect)
    self._bar.start()
    # Starting at `step` (a resumed run) keeps the steps already done out of the speed estimate.
    self._task = self._bar.add_task("", total=total, completed=step, text="")
    self._total = total
    # An exception that ends the run leaves the bar drawn and the cursor shown.
    atexit.register(self.newline)

  def newline(self) -> None:
    if self._bar is not None:
      self._bar.stop()
      self._bar = None
      atexit.unregister(self.newline)

  def say(self, text: str) -> None:
    if self.live:
      self.console.print(text, markup=False, soft_wrap=True)
      return
    self.stream.write(text + "\n")
    self.stream.flush()


class Timer:
  def __init__(self):
    self.t0 = time.perf_counter()

  def __call__(self) -> float:
    return time.perf_counter() - self.t0


def finish(run_dir: str, summary: dict, rows: list[dict], title: str, progress: Progress) -> None:
  """A finished run's curves.png and summary.json, and its last console lines."""
  write_chart(os.path.join(run_dir, "curves.png"), rows, title)
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  how = (f"resumed at step {summary['resumed_from_step']}" if "resumed_from_step" in summary
         else f"{summary.get('sft/time_s', 0):.0f} s warm-up"
         + (" loaded from the warm-up cache" if summary.get("sft/from_cache") else ""))
  progress.say(
      f"\n{accuracy_summary(summary)}\n"
      f"time: {summary['total_time_s']:.0f} s total ({how}, {summary['rl/time_s']:.0f} s RL)\n"
      f"wrote {run_dir}/metrics.jsonl, curves.png, summary.json, config.json")


def _measured(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def accuracy_summary(summary: dict) -> str:
  """The summary's held-out accuracy line: before RL -> after (gain); only the pass that ran
  when one did not (val.at_start, val.at_end); that validation was off when none ran."""
  before, after = summary.get("val/accuracy_before_rl"), summary.get("val/accuracy_after_rl")
  steps = summary.get("rl/steps")
  if _measured(before) and _measured(after):
    return (f"held-out accuracy: {before:.3f} before RL -> {after:.3f} after {steps} RL steps "
            f"({after - before:+.3f})")
  if _measured(after):
    return f"held-out accuracy: {after:.3f} after RL (no pass before it: val.at_start=false)"
  if _measured(before):
    return f"held-out accuracy: {before:.3f} before RL (no pass after it: val.at_end=false)"
  return ("held-out accuracy: not measured (validation was off: val.at_start=false, "
          "val.at_end=false and val.every > train.steps)")


def rl_progress_text(row: dict, val_accuracy: float | None = None,
                     skipped_prompts: int = 0) -> str:
  """The RL progress line's text for metrics row `row`: reward, the latest held-out accuracy
  (left out before any validation pass, or with validation off), seconds per step, generation
  throughput (`perf/gen_tokens_per_s`: completion tokens / the batch's rollout time), then
  skipped updates and prompts skipped so far when there are any."""
  parts = [f"reward {row['reward']:.3f}"]
  if _measured(val_accuracy):
    parts.append(f"val {val_accuracy:.3f}")
  parts.append(f"{row['perf/step_time_s']:.2f} s/step")
  gen = row.get("perf/gen_tokens_per_s")
  if _measured(gen):
    parts.append(f"gen {gen:.0f} tok/s")
  if row.get("train/skipped_updates"):
    parts.append(f"{row['train/skipped_updates']} skipped")
  if skipped_prompts:
    parts.append(f"{skipped_prompts} prompt{'s' if skipped_prompts != 1 else ''} skipped")
  return " | ".join(parts)


def write_chart(path: str, rows: list[dict], title: str) -> None:
  """The run's chart (`curves.CURVES`: reward, held-out accuracy, response length, entropy,
  staleness over RL steps) from its metrics rows."""
  curves.write_curves(path, {title: rows}, title=title)
