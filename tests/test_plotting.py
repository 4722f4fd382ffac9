"""Tests for jaxrl.plotting: PNG validity, chart geometry, NaN gaps and text placement."""

from __future__ import annotations

import struct
import time
import zlib

import numpy as np
import pytest

from jaxrl import plotting
from jaxrl.plotting import Series, line_chart_png, read_png, write_png

BLUE = (0, 0, 255)
RED = (255, 0, 0)
GREEN = (0, 160, 0)
W, H = 400, 300


def _chunks(data: bytes) -> list[tuple[bytes, bytes, int]]:
  """(kind, body, stored crc) for every chunk, parsed independently of the module under test."""
  out, pos = [], 8
  while pos < len(data):
    (length,) = struct.unpack(">I", data[pos : pos + 4])
    kind = data[pos + 4 : pos + 8]
    body = data[pos + 8 : pos + 8 + length]
    (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
    out.append((kind, body, crc))
    pos += 12 + length
  assert pos == len(data), "trailing bytes after the last chunk"
  return out


def _chart(tmp_path, series, name="c.png", **kw) -> np.ndarray:
  path = str(tmp_path / name)
  kw.setdefault("width", W)
  kw.setdefault("height", H)
  line_chart_png(path, series, **kw)
  return read_png(path)


def _mask(img: np.ndarray, color) -> np.ndarray:
  return np.all(img == np.array(color, dtype=np.uint8), axis=-1)


def _dark(img: np.ndarray) -> np.ndarray:
  return img.max(axis=-1) < 100


def _frame_rows(img: np.ndarray) -> tuple[int, int]:
  """Top and bottom rows of the plot frame: the only rows that are mostly dark."""
  rows = np.flatnonzero(_dark(img).mean(axis=1) > 0.5)
  assert len(rows) >= 2, "no frame found"
  return int(rows[0]), int(rows[-1])


def _frame_cols(img: np.ndarray) -> tuple[int, int]:
  cols = np.flatnonzero(_dark(img).mean(axis=0) > 0.5)
  assert len(cols) >= 2, "no frame found"
  return int(cols[0]), int(cols[-1])


def _groups(indices: np.ndarray, min_gap: int) -> int:
  """Number of runs in sorted `indices` separated by more than `min_gap`."""
  return 0 if indices.size == 0 else 1 + int(np.sum(np.diff(indices) > min_gap))


def test_png_structure_and_crcs(tmp_path):
  path = str(tmp_path / "c.png")
  x = np.arange(50)
  line_chart_png(path, [Series("a", x, np.sin(x / 5), BLUE)], title="t", width=321, height=207)
  data = open(path, "rb").read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  chunks = _chunks(data)
  for kind, body, crc in chunks:
    assert zlib.crc32(kind + body) == crc, kind
  kinds = [k for k, _, _ in chunks]
  assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
  w, h, depth, color_type, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
  assert (w, h) == (321, 207)
  assert (depth, color_type, comp, filt, interlace) == (8, 2, 0, 0, 0)
  raw = zlib.decompress(b"".join(b for k, b, _ in chunks if k == b"IDAT"))
  assert len(raw) == h * (1 + 3 * w)
  assert all(raw[r * (1 + 3 * w)] == 0 for r in range(h)), "every row must use filter type 0"


def test_write_read_round_trip_multiple_idat(tmp_path):
  # Noise does not compress, so this image needs several IDAT chunks.
  img = np.random.default_rng(0).integers(0, 256, size=(70, 90, 3), dtype=np.uint8)
  path = str(tmp_path / "noise.png")
  write_png(path, img)
  assert sum(k == b"IDAT" for k, _, _ in _chunks(open(path, "rb").read())) > 1
  np.testing.assert_array_equal(read_png(path), img)


def test_read_png_rejects_corrupt_crc(tmp_path):
  path = tmp_path / "c.png"
  write_png(str(path), np.zeros((4, 5, 3), np.uint8))
  data = bytearray(path.read_bytes())
  data[20] ^= 0xFF  # inside the IHDR body
  path.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="CRC"):
    read_png(str(path))


def test_round_trip_shape_background_and_colours(tmp_path):
  x = np.arange(100)
  img = _chart(
      tmp_path,
      [Series("up", x, x * 0.5, BLUE), Series("down", x[::10], 50 - x[::10] * 0.5, RED)],
      title="reward",
  )
  assert img.shape == (H, W, 3) and img.dtype == np.uint8
  assert _mask(img, (255, 255, 255)).mean() > 0.8
  assert _mask(img, BLUE).sum() > 200
  assert _mask(img, RED).sum() > 200


@pytest.mark.parametrize("slope", [1.0, -1.0])
def test_line_geometry_follows_data(tmp_path, slope):
  x = np.arange(200)
  img = _chart(tmp_path, [Series("s", x, slope * x, BLUE)])
  top, bottom = _frame_rows(img)
  rows, cols = np.nonzero(_mask(img, BLUE)[top + 1 : bottom])  # inside the frame: no legend
  assert rows.size > 100
  # Image rows grow downward, so a rising series has row decreasing with column.
  corr = np.corrcoef(cols, rows)[0, 1]
  assert corr < -0.99 if slope > 0 else corr > 0.99
  third = (cols.max() - cols.min()) / 3
  left, right = rows[cols < cols.min() + third], rows[cols > cols.max() - third]
  assert (left.mean() > right.mean()) == (slope > 0)
  # The line spans (almost) the full height of the frame: the range fits the data.
  assert rows.max() - rows.min() > 0.8 * (bottom - top)


def test_tick_labels_on_both_axes(tmp_path):
  x = np.arange(300)
  img = _chart(tmp_path, [Series("s", x, np.sqrt(x), BLUE)], x_label="")
  top, bottom = _frame_rows(img)
  left, right = _frame_cols(img)
  # y labels: dark text left of the tick marks, one row group per tick (about 5).
  y_text_rows = np.flatnonzero(_dark(img[top - 5 : bottom + 5, : left - 5]).any(axis=1))
  assert 4 <= _groups(y_text_rows, min_gap=2) <= 8
  # x labels: below the tick marks, one column group per tick (0..300 -> 4 to 7 labels).
  x_text_cols = np.flatnonzero(_dark(img[bottom + 5 :, left - 20 :]).any(axis=0))
  assert 4 <= _groups(x_text_cols, min_gap=8) <= 8
  # Tick marks stick out of the frame on both axes.
  assert _dark(img[top:bottom, left - 3]).sum() >= 4
  assert _dark(img[bottom + 3, left:right]).sum() >= 4


def test_nan_breaks_the_line(tmp_path):
  x = np.arange(101, dtype=float)
  y = x.copy()
  y[50] = np.nan
  img = _chart(tmp_path, [Series("s", x, y, BLUE)])
  top, bottom = _frame_rows(img)
  cols = np.flatnonzero(_mask(img, BLUE)[top + 1 : bottom].any(axis=0))
  gaps = np.diff(cols)
  i = int(np.argmax(gaps))
  assert gaps[i] > 5, "no gap where the NaN is"
  gap_centre = (cols[i] + cols[i + 1]) / 2
  assert abs(gap_centre - (cols[0] + cols[-1]) / 2) < 0.05 * (cols[-1] - cols[0])
  assert np.sum(gaps > 1) == 1, "only the NaN should leave a gap"
  # Without the NaN the same line is continuous.
  full = _chart(tmp_path, [Series("s", x, x, BLUE)], name="full.png")
  top, bottom = _frame_rows(full)
  assert np.all(np.diff(np.flatnonzero(_mask(full, BLUE)[top + 1 : bottom].any(axis=0))) == 1)


def test_y_range_is_honoured_and_clips(tmp_path):
  x = np.arange(24)
  # Lone points (NaN neighbours) outside the range: far off, and just above/below the frame.
  lone_y = np.select([x % 8 == 0, x % 8 == 2, x % 8 == 4, x % 8 == 6], [7.0, 1.05, -0.05, -3.0],
                     np.nan)
  series = [
      Series("half", x, np.full(24, 0.5), BLUE),
      Series("off", x, np.full(24, 7.0), RED),
      Series("lone", x, lone_y, GREEN),
  ]
  img = _chart(tmp_path, series, y_range=(0.0, 1.0))
  top, bottom = _frame_rows(img)
  rows = np.nonzero(_mask(img, BLUE)[top + 1 : bottom])[0] + top + 1
  assert abs(rows.mean() - (top + bottom) / 2) <= 2
  assert not _mask(img, RED)[top + 1 : bottom].any(), "out-of-range series must be clipped"
  assert _mask(img, RED)[:top].any(), "but still listed in the legend"
  # The lone points leave no pixel anywhere: only the legend entry is green.
  legend_only = _chart(tmp_path, [*series[:2], Series("lone", [], [], GREEN)], name="l.png",
                       y_range=(0.0, 1.0))
  assert _mask(img, GREEN).sum() == _mask(legend_only, GREEN).sum() > 0


def test_series_with_different_x_grids_share_the_axis(tmp_path):
  dense = np.arange(300)
  sparse = np.arange(0, 300, 10)
  img = _chart(
      tmp_path,
      [Series("d", dense, dense / 300, BLUE), Series("s", sparse, sparse / 300, RED)],
      y_range=(0, 1),
  )
  top, bottom = _frame_rows(img)
  inside_b = np.nonzero(_mask(img, BLUE)[top + 1 : bottom])
  inside_r = np.nonzero(_mask(img, RED)[top + 1 : bottom])
  # Same y = x / 300 line, so the (later-drawn) red one covers the blue one's track.
  assert inside_r[1].min() - inside_b[1].min() <= 3
  assert abs(inside_r[1].max() - 290 / 299 * (inside_b[1].max() - inside_b[1].min())
             - inside_b[1].min()) <= 4


@pytest.mark.parametrize(
    "series",
    [
        [Series("const", np.arange(10), np.full(10, 3.0), BLUE)],
        [Series("zero", np.arange(10), np.zeros(10), BLUE)],
        [Series("empty", [], [], BLUE)],
        [Series("empty", [], [], BLUE), Series("one point", [5], [2.0], RED)],
        [Series("all nan", np.arange(5), np.full(5, np.nan), BLUE)],
        [Series("inf", [0, 1, 2, 3], [1.0, np.inf, 2.0, 1e300], BLUE)],
        [],
    ],
    ids=["const", "zero", "empty", "empty+single", "all-nan", "inf-and-huge", "no-series"],
)
def test_degenerate_inputs_give_valid_png(tmp_path, series):
  img = _chart(tmp_path, series, title="degenerate")
  assert img.shape == (H, W, 3)
  _frame_rows(img)
  for s in series:  # every series is at least in the legend
    assert _mask(img, s.color).any()


def test_single_point_is_visible_inside_frame(tmp_path):
  img = _chart(tmp_path, [Series("p", [5], [2.0], RED)])
  top, bottom = _frame_rows(img)
  assert _mask(img, RED)[top + 1 : bottom].sum() >= 9


def test_title_area_has_text_only_with_title(tmp_path):
  s = [Series("s", np.arange(10), np.arange(10), BLUE)]
  with_title = _chart(tmp_path, s, title="Reward 123", name="a.png")
  without = _chart(tmp_path, s, title="", name="b.png")
  band = slice(0, 24)  # the title's rows when there is one
  assert _dark(with_title[band]).sum() > 50
  assert not _dark(without[band]).any()
  # Title text is centred horizontally.
  cols = np.flatnonzero(_dark(with_title[band]).any(axis=0))
  assert abs((cols[0] + cols[-1]) / 2 - W / 2) < 0.1 * W


def test_x_label_is_drawn_below_frame(tmp_path):
  s = [Series("s", np.arange(10), np.arange(10), BLUE)]
  labelled = _chart(tmp_path, s, x_label="step", name="a.png")
  bare = _chart(tmp_path, s, x_label="", name="b.png")
  assert _dark(labelled[_frame_rows(labelled)[1] + 1 :]).sum() > _dark(
      bare[_frame_rows(bare)[1] + 1 :]
  ).sum()


def test_font_covers_required_characters():
  required = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .-+/_:()%=,"
  missing = [c for c in required if c not in plotting.FONT]
  assert not missing
  glyphs = [plotting.FONT[c].tobytes() for c in required if c != " "]
  assert len(set(glyphs)) == len(glyphs), "two characters share a glyph"
  assert not plotting.text_mask(" ").any()
  np.testing.assert_array_equal(plotting.text_mask("\u00e9"), plotting.BOX_GLYPH)
  assert plotting.text_mask("ab", scale=2).shape == (18, 22)


@pytest.mark.parametrize(
    "lo,hi,expand,want",
    [
        (0, 299, True, [0, 100, 200, 300]),
        (0, 1, False, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (-47, 10, True, [-60, -40, -20, 0, 20]),
        (0.11, 0.19, False, [0.12, 0.14, 0.16, 0.18]),
    ],
)
def test_nice_ticks(lo, hi, expand, want):
  _, _, ticks = plotting.nice_ticks(lo, hi, 5, expand)
  np.testing.assert_allclose(ticks, want, atol=1e-12)


def test_tick_labels_are_round():
  assert plotting.tick_labels(np.array([0, 0.2, 0.4])) == ["0.0", "0.2", "0.4"]
  assert plotting.tick_labels(np.array([-20.0, -1e-17, 20.0])) == ["-20", "0", "20"]
  assert plotting.tick_labels(np.array([0, 2e6, 4e6])) == ["0", "2e+06", "4e+06"]


def test_bad_inputs_raise(tmp_path):
  with pytest.raises(ValueError):
    Series("a", [1, 2], [1], BLUE)
  with pytest.raises(ValueError):
    Series("a", [1], [1], (0, 0, 256))
  with pytest.raises(ValueError):
    line_chart_png(str(tmp_path / "a.png"), [], y_range=(1.0, 1.0))
  with pytest.raises(ValueError):
    line_chart_png(str(tmp_path / "a.png"), [], width=40, height=30)


def test_fast_for_two_series_of_1000_points(tmp_path):
  rng = np.random.default_rng(0)
  x = np.arange(1000)
  series = [
      Series("walk", x, np.cumsum(rng.normal(size=1000)), BLUE),
      Series("noise", x, rng.normal(size=1000), RED),
  ]
  path = str(tmp_path / "fast.png")
  line_chart_png(path, series)  # warm up imports/caches
  start = time.perf_counter()
  line_chart_png(path, series, title="speed", width=800, height=450)
  assert time.perf_counter() - start < 0.2
