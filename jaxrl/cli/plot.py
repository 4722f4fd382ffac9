"""python -m jaxrl.plot RUN_DIR [RUN_DIR ...] [-o out.png] [--keys KEY ...]
   python -m jaxrl.plot --run RUN_DIR [--run RUN_DIR ...] [-o out.png] [--keys KEY ...]

Draws the metrics.jsonl of one or more run directories on one chart, one colour per run and the
legend by run directory name: seeds or configs side by side. Without --keys the panels are those
of a run's own curves.png (`curves.CURVES`); each --keys entry is one panel, a metric name or an
fnmatch pattern (`'staleness/*'`). Errors the user can fix (a missing directory or file, a
malformed line, an unwritable output) end as one line `jaxrl: <message>` and exit status 1;
`--debug` or `JAXRL_DEBUG=1` shows the traceback. Run directories are given by position or, as
in the other commands, each with `--run`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from jaxrl.cli import common
from jaxrl.core.errors import UserError

METRICS_FILE = "metrics.jsonl"
DEFAULT_OUT = "plot.png"


class MetricsFileError(UserError, ValueError):
  """A metrics.jsonl line that is not a JSON object: the message names the file and line."""


def metrics_path(run: str) -> str:
  """`run`'s metrics.jsonl (`run` is a run directory or the file itself)."""
  if os.path.isfile(run):
    return run
  if not os.path.isdir(run):
    raise UserError(f"{run}: no such run directory")
  path = os.path.join(run, METRICS_FILE)
  if not os.path.isfile(path):
    raise UserError(f"{run} has no {METRICS_FILE} (not a run directory, or a run that has not "
                    "logged a step yet)")
  return path


def read_metrics(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file; blank lines are skipped."""
  rows = []
  with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is reported like bad JSON
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError as e:  # json.JSONDecodeError, or bytes that are not UTF-8 text
        raise MetricsFileError(f"{path} line {n}: not a JSON object "
                               f"({getattr(e, 'msg', e)})") from None
      if not isinstance(row, dict):
        raise MetricsFileError(f"{path} line {n}: not a JSON object (a {type(row).__name__})")
      rows.append(row)
  return rows


def run_labels(runs: Sequence[str]) -> list[str]:
  """Each run's legend label: its directory name, or as many trailing path parts as tell it
  apart from the others (seed0/out and seed1/out); a run given twice gets ' (2)'."""
  parts = []
  for run in runs:
    path = os.path.abspath(run)
    if os.path.isfile(path):
      path = os.path.dirname(path)
    parts.append(path.strip(os.sep).split(os.sep))
  labels = []
  for i, p in enumerate(parts):
    depth = 1
    while depth < len(p) and any(q[-depth:] == p[-depth:] for j, q in enumerate(parts)
                                  if j != i and q != p):
      depth += 1
    labels.append("/".join(p[-depth:]))
  seen: dict[str, int] = {}
  for i, label in enumerate(labels):
    seen[label] = seen.get(label, 0) + 1
    if seen[label] > 1:
      labels[i] = f"{label} ({seen[label]})"
  return labels


def plot(runs: Sequence[str], out: str = DEFAULT_OUT, keys: Sequence[str] | None = None,
         title: str | None = None) -> list[str]:
  """Writes the chart of `runs` to `out`; returns the keys no run had data for."""
  from jaxrl.observe import curves  # matplotlib: only once the arguments parsed

  ext = os.path.splitext(out)[1].lstrip(".").lower()
  formats = curves.supported_formats()
  if ext not in formats:
    raise UserError(f"-o {out}: name a file ending in one of "
                    f"{', '.join('.' + f for f in sorted(formats))}")
  data = {label: read_metrics(metrics_path(run)) for run, label in zip(runs, run_labels(runs))}
  panels = [curves.panel_for(k) for k in keys] if keys else list(curves.CURVES)
  if title is None and len(runs) == 1:
    title = next(iter(data))
  try:
    curves.write_curves(out, data, panels, title)
  except OSError as e:
    raise UserError(f"cannot write {out}: {e.strerror or e}") from None
  return [k for p in panels for k in p.keys
          if not any(line.has_data for rows in data.values()
                     for line in curves.lines(rows, (k,)).values())]


def main(argv: Sequence[str] | None = None) -> int:
  parser = common.ArgumentParser(
      prog="python -m jaxrl.plot",
      description="Overlay the metrics.jsonl of run directories on one chart (legend: run "
                  "directory names).")
  parser.add_argument("runs", nargs="*", metavar="RUN_DIR",
                      help="run directories (or their metrics.jsonl files)")
  parser.add_argument("--run", action="append", default=[], metavar="RUN_DIR",
                      help="a run directory (repeat for several); the same as giving it by "
                           "position")
  parser.add_argument("-o", "--out", default=DEFAULT_OUT,
                      help=f"file to write; its extension picks the format (default {DEFAULT_OUT})")
  parser.add_argument("--keys", nargs="+", metavar="KEY",
                      help="one panel per metric name or pattern ('staleness/*'), instead of "
                           "reward, held-out accuracy, response length, entropy and staleness")
  parser.add_argument("--title", default=None,
                      help="figure title (default: the run's name when there is one run)")
  args = parser.parse_args(argv)
  runs = [*args.runs, *args.run]
  if not runs:
    parser.error("give at least one run directory (RUN_DIR or --run RUN_DIR)")
  try:
    missing = plot(runs, args.out, args.keys, args.title)
  except Exception as e:
    message = None if common.debug_requested(args.debug) else (
        common.user_message(e) or (f"jaxrl: {common.os_error_text(e)}"
                                   if isinstance(e, OSError) else None))
    if message is None:
      raise
    print(message, file=sys.stderr)
    return 1
  note = f" (no data for {', '.join(missing)})" if missing else ""
  print(f"wrote {args.out}: {len(runs)} run{'s' if len(runs) > 1 else ''}{note}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
