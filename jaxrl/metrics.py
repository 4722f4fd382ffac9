"""Run outputs: `metrics.jsonl` (one line per step), a live progress line, the final chart.

Every line is flushed as it is written, so a killed run keeps everything up to its last step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO

import numpy as np

from jaxrl import plotting


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "__array__"):
    v = np.asarray(v)
    return v.item() if v.ndim == 0 else v.tolist()
  return v


class MetricsWriter:
  """Appends one JSON object per call to `<run_dir>/metrics.jsonl` (rows kept in memory only when
  `run_dir` is None: the processes of a multi-process run other than process 0)."""

  def __init__(self, run_dir: str | None, keep_lines: int | None = None):
    """`keep_lines`: a resumed run's file is cut back to its first `keep_lines` lines (what was
    written when the checkpoint was saved), which are loaded into `rows`."""
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
    # A fresh run's file must not exist (jaxrl.run_dir moves a previous run aside): "x" makes a
    # mistake there an error instead of two runs appended into one file.
    mode = "a" if keep_lines is not None else "x"
    self._f = None if self.path is None else open(self.path, mode, buffering=1)

  def write(self, row: dict) -> None:
    row = {k: _plain(v) for k, v in row.items()}
    # NaN is not JSON; keep the key so a reader sees the value was bad rather than missing.
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    if self._f is not None:
      self._f.write(json.dumps(row) + "\n")
    self.rows.append(row)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()


class Progress:
  """One live line on a terminal (rewritten in place); plain periodic lines otherwise."""

  def __init__(self, stream: TextIO | None = None, every: int = 10):
    self.stream = stream or sys.stdout
    self.every = max(1, every)
    self.live = self.stream.isatty()
    self._last_len = 0

  def update(self, step: int, total: int, text: str, force: bool = False) -> None:
    line = f"{step:>5}/{total} | {text}"
    if self.live:
      pad = max(0, self._last_len - len(line))
      self.stream.write("\r" + line + " " * pad)
      self.stream.flush()
      self._last_len = len(line)
      if force:
        self.newline()
    elif force or step % self.every == 0 or step == total:
      self.stream.write(line + "\n")
      self.stream.flush()

  def newline(self) -> None:
    if self.live and self._last_len:
      self.stream.write("\n")
      self.stream.flush()
      self._last_len = 0

  def say(self, text: str) -> None:
    self.newline()
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
         else f"{summary.get('sft/time_s', 0):.0f} s warm-up")
  progress.say(
      f"\nheld-out accuracy: {summary['val/accuracy_before_rl']:.3f} before RL -> "
      f"{summary['val/accuracy_after_rl']:.3f} after {summary['rl/steps']} RL steps "
      f"({summary['val/rl_gain']:+.3f})\n"
      f"time: {summary['total_time_s']:.0f} s total ({how}, {summary['rl/time_s']:.0f} s RL)\n"
      f"wrote {run_dir}/metrics.jsonl, curves.png, summary.json, config.json")


def write_chart(path: str, rows: list[dict], title: str) -> None:
  """Reward per RL step and held-out accuracy per evaluation, on one 0..1 axis."""
  rl = [r for r in rows if r.get("phase") == "rl"]
  reward = [(r["step"], r["reward"]) for r in rl if r.get("reward") is not None]
  # Validation rows are written when a pass finishes, under the step whose params it used.
  acc = sorted((r["step"], r["val/accuracy"]) for r in rows
               if r.get("phase") == "val" and r.get("val/accuracy") is not None)
  series = [
      plotting.Series("sampled reward", [s for s, _ in reward], [v for _, v in reward],
                      (70, 130, 200)),
      plotting.Series("val accuracy", [s for s, _ in acc], [v for _, v in acc],
                      (215, 90, 40)),
  ]
  plotting.line_chart_png(path, series, title=title, x_label="RL step", y_range=(0.0, 1.0))
