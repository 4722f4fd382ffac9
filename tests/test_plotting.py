"""Tests for the run chart (jaxrl.observe.curves, metrics.write_chart) and `python -m jaxrl.plot`.

Charts are read back from the PNG: a panel is "drawn" when its axes area holds saturated pixels
(the data lines; frame, grid and text are grey), so a panel that silently lost its data fails.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
from matplotlib import image as mpimg
from matplotlib.colors import to_rgb

from jaxrl.observe import metrics, curves as plotting

from jaxrl.cli import plot

TITLE = "jaxrl test: GRPO on add"


def _rows(n: int = 40, lag: int = 2, reward0: float = 0.2) -> list[dict]:
  """metrics.jsonl rows as a run writes them: warm-up, RL, validation passes written after the
  later RL rows (so out of step order), a summary."""
  rows = [{"phase": "sft", "step": s, "sft/loss": 2.0 / s} for s in range(1, 6)]
  val = [{"phase": "val", "step": 0, "val/accuracy": 0.3}]
  for s in range(1, n + 1):
    st = float(min(s - 1, lag))
    rows.append({"phase": "rl", "step": s, "reward": reward0 + 0.5 * s / n,
                 "completion_len": 5.0 + (s % 3), "entropy": 1.0 - 0.5 * s / n, "loss": 0.1,
                 "staleness/first_token/mean": st, "staleness/last_token/mean": st / 2,
                 "staleness/token_mean/mean": st * 0.75})
    if s % 10 == 0:
      val.append({"phase": "val", "step": s, "val/accuracy": 0.3 + 0.5 * s / n})
    if s % 10 == 3:  # a pass finishes a few steps after the step it measured
      rows.append(val.pop(0))
  rows += val
  rows.append({"phase": "summary", "val/accuracy_before_rl": 0.3})
  return rows


def _rgb(path) -> np.ndarray:
  return mpimg.imread(str(path))[..., :3]


def _panels(fig, height: int) -> list[tuple[slice, slice]]:
  """Each axes' pixel area (rows, cols) in the saved image, a few pixels inside its frame."""
  fig.draw_without_rendering()  # runs the layout that savefig runs
  out = []
  for ax in fig.axes:
    b = ax.get_window_extent()
    out.append((slice(height - int(b.y1) + 3, height - int(b.y0) - 3),
                slice(int(b.x0) + 3, int(b.x1) - 3)))
  return out


def _coloured(rgb: np.ndarray) -> int:
  return int(((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.25).sum())


def _inked(rgb: np.ndarray) -> int:
  return int((rgb.min(axis=-1) < 0.8).sum())


def _near(rgb: np.ndarray, color: str) -> int:
  return int((np.abs(rgb - np.array(to_rgb(color))).max(axis=-1) < 0.08).sum())


def test_run_chart_has_every_panel_drawn(tmp_path):
  rows = _rows()
  path = tmp_path / "curves.png"
  metrics.write_chart(str(path), rows, TITLE)
  rgb = _rgb(path)
  # 3 x 2 panels of 4.4 x 3.2 in plus 0.3 in for the title, at 100 dpi.
  assert rgb.shape == (670, 1320, 3)
  fig = plotting.draw({TITLE: rows}, title=TITLE)
  boxes = _panels(fig, rgb.shape[0])
  assert [ax.get_title() for ax in fig.axes] == [p.title for p in plotting.CURVES]
  for panel, (r, c) in zip(plotting.CURVES, boxes):
    assert _coloured(rgb[r, c]) > 100, panel.title
  # Outside the panels (the sixth cell of the grid) the image is background.
  assert _inked(rgb[400:, 920:]) == 0


def test_panels_without_data_say_so(tmp_path):
  # A run killed after two RL steps of a config that logs no entropy: no validation pass yet.
  rows = [{"phase": "sft", "step": 1, "sft/loss": 2.0},
          {"phase": "rl", "step": 1, "reward": 0.2, "completion_len": 4.0, "entropy": None},
          {"phase": "rl", "step": 2, "reward": 0.3, "completion_len": 5.0, "entropy": None}]
  path = tmp_path / "curves.png"
  metrics.write_chart(str(path), rows, TITLE)
  rgb = _rgb(path)
  fig = plotting.draw({TITLE: rows}, title=TITLE)
  drawn = {"sampled reward", "response length (tokens)"}
  for ax, (r, c) in zip(fig.axes, _panels(fig, rgb.shape[0])):
    texts = [t.get_text() for t in ax.texts]
    if ax.get_title() in drawn:
      assert _coloured(rgb[r, c]) > 20 and not texts, ax.get_title()
    else:  # grey "no data" text and nothing else
      assert _coloured(rgb[r, c]) == 0 and _inked(rgb[r, c]) > 50, ax.get_title()
      assert texts and texts[0].startswith("no data"), ax.get_title()
  # Nothing at all (a run that logged no step) still gives a chart.
  metrics.write_chart(str(tmp_path / "empty.png"), [], TITLE)
  assert _rgb(tmp_path / "empty.png").shape == (670, 1320, 3)


def test_lines_pick_phase_sort_steps_and_keep_gaps():
  rows = [{"phase": "val", "step": 20, "val/accuracy": 0.7},
          {"phase": "rl", "step": 2, "reward": None, "x": 1.0},
          {"phase": "val", "step": 0, "val/accuracy": 0.3, "x": 9.0},
          {"phase": "rl", "step": 1, "reward": 0.5, "x": 2.0, "tag": "a"},
          {"phase": "val", "step": 10, "val/accuracy": 0.5},
          {"phase": "sft", "step": 3, "sft/loss": 1.5, "x": 7.0},
          {"phase": "summary", "val/accuracy": 0.0}]
  got = plotting.lines(rows, ["val/accuracy", "reward", "x", "sft/loss", "tag", "absent"])
  assert list(got) == ["val/accuracy", "reward", "x", "sft/loss"]  # no numbers: no line
  acc = got["val/accuracy"]
  # Sorted by step (written 20, 0, 10); the summary row is not a point.
  assert (acc.phase, acc.steps, acc.values) == ("val", [0.0, 10.0, 20.0], [0.3, 0.5, 0.7])
  # null (a non-finite value when logged) stays a point, as NaN: a gap in the line.
  assert got["reward"].steps == [1.0, 2.0] and math.isnan(got["reward"].values[1])
  # A metric in several phases is read from the rl rows only (rl, then val, then sft).
  assert (got["x"].phase, got["x"].values) == ("rl", [2.0, 1.0])
  assert got["sft/loss"].phase == "sft"
  staleness = plotting.lines(_rows(), ["staleness/*/mean"])
  assert list(staleness) == [f"staleness/{k}/mean" for k in ("first_token", "last_token",
                                                              "token_mean")]
  assert not plotting.lines([{"phase": "rl", "step": 1, "reward": None}], ["reward"])[
      "reward"].has_data


def _run_dir(root, name, rows) -> str:
  d = root / name
  d.mkdir(parents=True)
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(d)


def test_plot_overlays_two_runs(tmp_path, capsys):
  a = _run_dir(tmp_path, "seed0", _rows(lag=0))
  b = _run_dir(tmp_path, "seed1", _rows(lag=2, reward0=0.1))
  out = tmp_path / "compare.png"
  assert plot.main([a, b, "-o", str(out)]) == 0
  assert capsys.readouterr().out == f"wrote {out}: 2 runs\n"
  rgb = _rgb(out)
  assert rgb.shape[:2] == (690, 1320)  # 0.5 in below the panels for the runs' legend
  # One colour per run, each drawn in the panels (far more pixels than a legend swatch).
  for color in plotting.COLORS[:2]:
    assert _near(rgb, color) > 1000, color
  # The legend names the runs by directory name.
  fig = plotting.draw({label: _rows() for label in plot.run_labels([a, b])})
  assert [t.get_text() for t in fig.legends[0].get_texts()] == ["seed0", "seed1"]

  # --keys: one panel per key, a name or a pattern; a key no run has is reported.
  out2 = tmp_path / "keys.png"
  assert plot.main([a, b, "-o", str(out2), "--keys", "loss", "staleness/*", "nope"]) == 0
  assert capsys.readouterr().out == f"wrote {out2}: 2 runs (no data for nope)\n"
  assert _rgb(out2).shape[:2] == (370, 1320)  # one row of 3 panels


def test_run_labels_tell_runs_apart(tmp_path):
  assert plot.run_labels(["x/a/seed0", "y/a/seed0", "z/seed1/", "z/seed1"]) == [
      "x/a/seed0", "y/a/seed0", "seed1", "seed1 (2)"]
  d = _run_dir(tmp_path, "run", [])
  assert plot.run_labels([d + "/metrics.jsonl"]) == ["run"]


def _error(capsys, argv) -> str:
  assert plot.main(argv) == 1
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err.count("\n") == 1, captured.err
  assert captured.err.startswith("jaxrl: ")
  return captured.err.strip()


def test_plot_errors_are_one_line(tmp_path, capsys):
  out = str(tmp_path / "o.png")
  missing = str(tmp_path / "nope")
  assert _error(capsys, [missing, "-o", out]) == f"jaxrl: {missing}: no such run directory"
  empty = tmp_path / "empty"
  empty.mkdir()
  assert f"{empty} has no metrics.jsonl" in _error(capsys, [str(empty), "-o", out])
  good = _run_dir(tmp_path, "good", _rows(5))
  bad = _run_dir(tmp_path, "bad", [])
  path = f"{bad}/metrics.jsonl"
  with open(path, "w") as f:
    f.write('{"phase": "rl", "step": 1, "reward": 0.5}\n{"phase": "rl", "st\n')
  assert _error(capsys, [good, bad, "-o", out]).startswith(
      f"jaxrl: {path} line 2: not a JSON object (")
  with open(path, "w") as f:
    f.write("\n[1, 2]\n")
  assert _error(capsys, [bad, "-o", out]) == (
      f"jaxrl: {path} line 2: not a JSON object (a list)")
  assert ".png" in _error(capsys, [good, "-o", str(tmp_path / "o.xyz")])
  no_dir = str(tmp_path / "no" / "o.png")
  assert _error(capsys, [good, "-o", no_dir]) == (
      f"jaxrl: cannot write {no_dir}: No such file or directory")
  assert not (tmp_path / "o.png").exists()


def test_plot_module_exits_with_one_line(tmp_path):
  missing = str(tmp_path / "nope")
  proc = subprocess.run([sys.executable, "-m", "jaxrl.plot", missing], capture_output=True,
                        text=True, cwd=tmp_path, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr == f"jaxrl: {missing}: no such run directory\n"
