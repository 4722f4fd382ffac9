"""Charts of metrics rows (as written to `metrics.jsonl`), drawn with matplotlib.

`draw` lays out one panel per `Panel` and overlays any number of runs; `write_curves` saves it
(PNG by default; the file name's extension picks the format). The figure is a bare
`matplotlib.figure.Figure` saved through Agg: no pyplot, no display and no global backend
state, so a run draws its chart from any thread on a headless machine.

Where a panel's values come from: a metric is read from the `rl` rows that have it, else the `val`
rows (written when a validation pass finishes, so they can come out of step order: they are
sorted by `step`), else the `sft` rows. A `null` value (non-finite when logged) is a gap in the
line. A panel none of whose runs has data says so in place of a plot.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from matplotlib.figure import Figure

# Phases searched for a metric, in order; the x axis of each is its own step count.
PHASES = ("rl", "val", "sft")
_X_LABELS = {"rl": "RL step", "val": "RL step", "sft": "warm-up step"}
_NOT_METRICS = ("phase", "step")
# Line colours, in order: one per run (several runs) or per metric (one run).
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")
_STYLES = ("-", "--", ":", "-.")
# Up to this many points a line also gets markers: validation passes are a handful of points.
_MARKER_MAX_POINTS = 30


@dataclasses.dataclass(frozen=True)
class Panel:
  """One axes. `keys` are metric names or fnmatch patterns (`staleness/*/mean`); every metric
  they match is a line. `ylim` fixes the y range (accuracy is 0..1 whatever a run reached)."""
  title: str
  keys: tuple[str, ...]
  ylim: tuple[float, float] | None = None


# `<run_dir>/curves.png` and `python -m jaxrl.plot` without --keys.
CURVES = (
    Panel("sampled reward", ("reward",)),
    Panel("held-out accuracy", ("val/accuracy",), (-0.03, 1.03)),
    Panel("response length (tokens)", ("completion_len",)),
    Panel("entropy", ("entropy",)),
    Panel("staleness (policy versions)", ("staleness/*/mean",)),
)


def panel_for(key: str) -> Panel:
  """The `CURVES` panel that shows exactly `key`, else a panel titled by the key."""
  for p in CURVES:
    if p.keys == (key,):
      return p
  return Panel(key, (key,))


@dataclasses.dataclass(frozen=True)
class Line:
  phase: str
  steps: list[float]
  values: list[float]  # NaN where the row's value was null

  @property
  def has_data(self) -> bool:
    return any(math.isfinite(v) for v in self.values)


def _number(v) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def lines(rows: Sequence[dict], keys: Sequence[str]) -> dict[str, Line]:
  """{metric name: Line} for every metric that `keys` name or match, in the order of `keys`
  (matches of one pattern sorted by name)."""
  names: list[str] = []
  for key in keys:
    if any(c in key for c in "*?["):
      found = sorted({k for r in rows for k in r if k not in _NOT_METRICS
                      and fnmatch.fnmatchcase(k, key)})
    else:
      found = [key]
    names += [n for n in found if n not in names]
  out = {}
  for name in names:
    for phase in PHASES:
      points = [(r["step"], r[name]) for r in rows if r.get("phase") == phase and name in r
                and _number(r.get("step")) and (r[name] is None or _number(r[name]))]
      if points:
        points.sort(key=lambda p: p[0])
        out[name] = Line(phase, [float(s) for s, _ in points],
                         [math.nan if v is None else float(v) for _, v in points])
        break
  return out


def _short_names(names: Sequence[str]) -> list[str]:
  """Names without the '/'-separated parts they all share at the start and the end:
  staleness/first_token/mean, staleness/last_token/mean -> first_token, last_token."""
  parts = [n.split("/") for n in names]
  if len(parts) < 2 or len({len(p) for p in parts}) != 1:
    return list(names)
  keep = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
  return ["/".join(p[i] for i in keep) for p in parts]


def draw(runs: Mapping[str, Sequence[dict]], panels: Sequence[Panel] = CURVES,
         title: str | None = None) -> Figure:
  """A figure with one panel per entry of `panels` (3 to a row), each overlaying the runs of
  `runs` ({legend label: metrics rows}). One run: a colour per metric. Several: a colour per run
  (figure legend) and a line style per metric (panel legend)."""
  n = len(panels)
  ncols = min(3, n)
  nrows = math.ceil(n / ncols)
  multi = len(runs) > 1
  width, height = 4.4 * ncols, 3.2 * nrows + (0.5 if multi else 0.3)
  # Fixed margins in inches rather than layout="constrained", which measured ~0.4 s of a
  # ~0.8 s save of the run chart on the 2-core CPU (paid at the end of every run).
  bottom_in = 0.55 + (0.45 if multi else 0.0)
  top_in = 0.55 if title else 0.3
  # matplotlib is imported when a chart is drawn: it takes most of a second to import, which a
  # run pays only at its end (and a process that never draws, e.g. process 1 of a pod, never).
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D
  from matplotlib.ticker import MaxNLocator

  fig = Figure(figsize=(width, height), dpi=100)
  fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, bottom=bottom_in / height,
                      top=1 - top_in / height, wspace=0.32, hspace=0.5)
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  for ax in axes[n:]:
    ax.remove()
  for ax, panel in zip(axes, panels):
    ax.set_title(panel.title, fontsize=11)
    names: list[str] = []
    x_labels: list[str] = []
    for r, rows in enumerate(runs.values()):
      for name, line in lines(rows, panel.keys).items():
        if not line.has_data:
          continue
        if name not in names:
          names.append(name)
        k = names.index(name)
        if _X_LABELS[line.phase] not in x_labels:
          x_labels.append(_X_LABELS[line.phase])
        ax.plot(line.steps, line.values, color=COLORS[(r if multi else k) % len(COLORS)],
                linestyle=_STYLES[k % len(_STYLES)] if multi else "-", linewidth=1.4,
                marker="o" if len(line.steps) <= _MARKER_MAX_POINTS else None, markersize=3)
    if not names:
      ax.text(0.5, 0.5, "no data\n(" + ", ".join(panel.keys) + ")", ha="center", va="center",
              transform=ax.transAxes, color="0.35", fontsize=10)
      ax.set_xticks([])
      ax.set_yticks([])
      continue
    ax.set_xlabel(" / ".join(x_labels))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 1.5
    ax.grid(True, alpha=0.3)
    if panel.ylim is not None:
      ax.set_ylim(*panel.ylim)
    if len(names) > 1:
      handles = [Line2D([], [], color="0.3" if multi else COLORS[k % len(COLORS)],
                        linestyle=_STYLES[k % len(_STYLES)] if multi else "-")
                 for k in range(len(names))]
      ax.legend(handles, _short_names(names), fontsize=8)
  if multi:
    handles = [Line2D([], [], color=COLORS[r % len(COLORS)], linewidth=2)
               for r in range(len(runs))]
    fig.legend(handles, list(runs), loc="lower center", ncols=min(len(runs), 4), fontsize=9,
               frameon=False)
  if title:
    fig.suptitle(title)
  return fig


def write_curves(path: str, runs: Mapping[str, Sequence[dict]],
                 panels: Sequence[Panel] = CURVES, title: str | None = None) -> None:
  """Draws `runs` (see `draw`) into `path`, in the format its extension names."""
  draw(runs, panels, title).savefig(path)


def supported_formats() -> dict[str, str]:
  """{file extension: description} of the formats `write_curves` can write."""
  from matplotlib.figure import Figure  # imported when asked (see `draw`)

  return Figure().canvas.get_supported_filetypes()
