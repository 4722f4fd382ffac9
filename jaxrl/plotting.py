"""PNG line charts drawn with numpy and the standard library only.

Used for the end-of-run charts of reward and validation accuracy, so a run leaves a picture of
itself without the package depending on a plotting library (matplotlib, PIL) that a training
install (TPU VM, slim container) would otherwise have to carry for one image.

`line_chart_png` writes an 8-bit RGB PNG: white background, framed plot, "nice" round ticks with
numeric labels on both axes, light grid, title, x label and a legend with each name in its
series' colour. Text uses the small bitmap font embedded below. `read_png` decodes exactly the
PNGs `write_png` produces (8-bit RGB, filter 0, one or more IDAT chunks), for tests and checks.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# libpng's default IDAT size; it also means read_png's multi-chunk path is exercised by ordinary
# charts rather than only by hand-made files.
_IDAT_CHUNK_BYTES = 8192

_Rgb = tuple[int, int, int]
_INK = (30, 30, 30)  # text, frame and ticks
_GRID = (232, 232, 232)

# 5x7 bitmap font, one hex byte per row (bit 4 = leftmost column). Glyphs with descenders
# (g j p q y ,) have 9 rows; the text cell is 9 rows tall so they hang below the baseline
# instead of being squashed into the x-height.
_GLYPHS: dict[str, str] = {
    " ": "00000000000000",
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f",
    "3": "1f02040201110e", "4": "02060a121f0202", "5": "1f101e0101110e",
    "6": "0608101e11110e", "7": "1f010204080808", "8": "0e11110e11110e",
    "9": "0e11110f01020c",
    "A": "0e11111f111111", "B": "1e11111e11111e", "C": "0e11101010110e",
    "D": "1c12111111121c", "E": "1f10101e10101f", "F": "1f10101e101010",
    "G": "0e11101711110f", "H": "1111111f111111", "I": "0e04040404040e",
    "J": "0702020202120c", "K": "11121418141211", "L": "1010101010101f",
    "M": "111b1515111111", "N": "11111915131111", "O": "0e11111111110e",
    "P": "1e11111e101010", "Q": "0e11111115120d", "R": "1e11111e141211",
    "S": "0f10100e01011e", "T": "1f040404040404", "U": "1111111111110e",
    "V": "11111111110a04", "W": "1111111515150a", "X": "11110a040a1111",
    "Y": "1111110a040404", "Z": "1f01020408101f",
    "a": "00000e010f110f", "b": "1010161911111e", "c": "00000e1010110e",
    "d": "01010d1311110f", "e": "00000e111f100e", "f": "0609081c080808",
    "g": "00000f1111110f010e", "h": "10101619111111", "i": "04000c0404040e",
    "j": "02000602020202120c", "k": "10101214181412",
    "l": "0c04040404040e", "m": "00001a15151111", "n": "00001619111111",
    "o": "00000e1111110e", "p": "00001e1111111e1010", "q": "00000f1111110f0101",
    "r": "00001619101010", "s": "00000e100e011e", "t": "08081c08080906",
    "u": "0000111111130d", "v": "00001111110a04", "w": "0000111115150a",
    "x": "0000110a040a11", "y": "0000111111110f010e",
    "z": "00001f0204081f",
    ".": "00000000000c0c", "-": "0000001f000000", "+": "0004041f040400",
    "/": "00010204081000", "_": "0000000000001f", ":": "000c0c000c0c00",
    "(": "02040808080402", ")": "08040202020408", "%": "18190204081303",
    "=": "00001f001f0000", ",": "00000000000c0408",
}
_UNKNOWN_GLYPH = "1f11111111111f"  # a box, so missing characters are visible rather than dropped
_CELL_H = 9  # rows per text cell, including the 2 descender rows
_CAP_H = 7
_ADVANCE = 6  # 5 columns of glyph + 1 of spacing


def _decode_glyph(hex_rows: str) -> np.ndarray:
  rows = np.frombuffer(bytes.fromhex(hex_rows), dtype=np.uint8)
  bits = np.unpackbits(rows[:, None], axis=1)[:, 3:].astype(bool)
  out = np.zeros((_CELL_H, 5), dtype=bool)
  out[: len(rows)] = bits
  return out


# The 5 x 9 bitmap font (True = ink) by character, and the box drawn for any other character.
FONT: dict[str, np.ndarray] = {ch: _decode_glyph(h) for ch, h in _GLYPHS.items()}
BOX_GLYPH = _decode_glyph(_UNKNOWN_GLYPH)


@dataclasses.dataclass(frozen=True)
class Series:
  """One line of a chart. `x` and `y` have equal length; NaN or inf in either breaks the line."""

  name: str  # shown in the legend, in `color`
  x: Sequence[float]
  y: Sequence[float]
  color: tuple[int, int, int]  # RGB, 0..255

  def __post_init__(self):
    if len(self.x) != len(self.y):
      raise ValueError(f"series {self.name!r}: len(x)={len(self.x)} != len(y)={len(self.y)}")
    if len(self.color) != 3 or not all(0 <= int(c) <= 255 for c in self.color):
      raise ValueError(f"series {self.name!r}: color must be 3 ints in 0..255, got {self.color}")


# ---------------------------------------------------------------------------------------------
# PNG encoding / decoding


def _chunk(kind: bytes, body: bytes) -> bytes:
  return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def write_png(path: str, image: np.ndarray) -> None:
  """Writes an [H, W, 3] uint8 array as an 8-bit RGB PNG (filter 0 on every row)."""
  image = np.asarray(image)
  if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
    raise ValueError(f"expected [H, W, 3] uint8, got {image.shape} {image.dtype}")
  h, w, _ = image.shape
  raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # column 0 is each row's filter byte (0: none)
  raw[:, 1:] = image.reshape(h, 3 * w)
  data = zlib.compress(raw.tobytes(), 6)
  parts = [_PNG_SIGNATURE, _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))]
  parts += [
      _chunk(b"IDAT", data[i : i + _IDAT_CHUNK_BYTES])
      for i in range(0, max(len(data), 1), _IDAT_CHUNK_BYTES)
  ]
  parts.append(_chunk(b"IEND", b""))
  with open(path, "wb") as f:
    f.write(b"".join(parts))


def read_png(path: str) -> np.ndarray:
  """Decodes a PNG written by `write_png` into [H, W, 3] uint8.

  Only 8-bit RGB, non-interlaced, filter type 0 is supported; anything else raises ValueError
  (this is a test helper, not a general decoder). Chunk CRCs are checked.
  """
  with open(path, "rb") as f:
    data = f.read()
  if data[:8] != _PNG_SIGNATURE:
    raise ValueError(f"{path}: not a PNG (bad signature)")
  pos, header, idat = 8, None, []
  while True:
    if pos + 12 > len(data):
      raise ValueError(f"{path}: truncated before IEND")
    (length,) = struct.unpack(">I", data[pos : pos + 4])
    kind = data[pos + 4 : pos + 8]
    body = data[pos + 8 : pos + 8 + length]
    if pos + 12 + length > len(data):
      raise ValueError(f"{path}: truncated {kind!r} chunk")
    (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
    if zlib.crc32(kind + body) != crc:
      raise ValueError(f"{path}: bad CRC in {kind!r} chunk")
    pos += 12 + length
    if kind == b"IHDR":
      header = struct.unpack(">IIBBBBB", body)
    elif kind == b"IDAT":
      idat.append(body)
    elif kind == b"IEND":
      break
  if header is None:
    raise ValueError(f"{path}: no IHDR chunk")
  w, h, depth, color_type, _, _, interlace = header
  if (depth, color_type, interlace) != (8, 2, 0):
    raise ValueError(f"{path}: only 8-bit RGB non-interlaced is supported, got {header}")
  raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
  if raw.size != h * (1 + 3 * w):
    raise ValueError(f"{path}: image data has {raw.size} bytes, expected {h * (1 + 3 * w)}")
  raw = raw.reshape(h, 1 + 3 * w)
  if raw[:, 0].any():
    raise ValueError(f"{path}: only filter type 0 is supported")
  return raw[:, 1:].reshape(h, w, 3).copy()


# ---------------------------------------------------------------------------------------------
# Text


def text_mask(text: str, scale: int = 1) -> np.ndarray:
  """Boolean [9 * scale, width] bitmap of `text`; row 6 * scale is the last row above baseline."""
  if not text:
    return np.zeros((_CELL_H * scale, 0), dtype=bool)
  glyphs = [np.pad(FONT.get(ch, BOX_GLYPH), ((0, 0), (0, 1))) for ch in text]
  mask = np.concatenate(glyphs, axis=1)[:, :-1]
  if scale > 1:
    mask = mask.repeat(scale, axis=0).repeat(scale, axis=1)
  return mask


def _text_width(text: str, scale: int = 1) -> int:
  return max(0, _ADVANCE * len(text) - 1) * scale


def _blit(img: np.ndarray, mask: np.ndarray, top: int, left: int, color: _Rgb) -> None:
  """Paints `mask` at (top, left), silently clipped to the image."""
  h, w = img.shape[:2]
  r0, c0 = max(top, 0), max(left, 0)
  r1, c1 = min(top + mask.shape[0], h), min(left + mask.shape[1], w)
  if r1 <= r0 or c1 <= c0:
    return
  sub = mask[r0 - top : r1 - top, c0 - left : c1 - left]
  img[r0:r1, c0:c1][sub] = color


def _draw_text(
    img: np.ndarray, text: str, top: int, x: int, color: _Rgb, scale: int = 1, align: str = "left"
) -> None:
  """Draws `text` with its cell's top row at `top`; `x` is its left, centre or right edge."""
  width = _text_width(text, scale)
  left = {"left": x, "center": x - width // 2, "right": x - width}[align]
  _blit(img, text_mask(text, scale), top, left, color)


# ---------------------------------------------------------------------------------------------
# Axes


def nice_ticks(lo: float, hi: float, target: int, expand: bool) -> tuple[float, float, np.ndarray]:
  """Round tick values (1, 2 or 5 x 10^k apart) for [lo, hi], about `target` of them.

  With `expand` the range grows to the enclosing ticks (auto ranges end on a labelled value);
  without it (a forced range) ticks stay inside [lo, hi]. Returns (lo, hi, ticks).
  """
  span = hi - lo
  if not math.isfinite(span) or span <= 0:
    raise ValueError(f"cannot place ticks on [{lo}, {hi}]")
  base = 10.0 ** math.floor(math.log10(span / max(target, 1)))
  best = None
  for step in (m * base * f for f in (0.1, 1.0, 10.0) for m in (1, 2, 5)):
    # The epsilon keeps lo/step that is an integer up to rounding from adding a tick.
    if expand:
      k0, k1 = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    else:
      k0, k1 = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    n = k1 - k0 + 1
    if n < 2:
      continue
    # Besides the tick count, penalise the empty axis an expanded range adds (0..119 shown as
    # 0..150 wastes a fifth of the plot). Steps ascend, so `<=` sends ties to the larger step.
    waste = (k1 - k0) * step / span - 1 if expand else 0.0
    score = abs(n - target) + 4 * waste
    if best is None or score <= best[0]:
      best = (score, k0, k1, step)
  if best is None:
    return lo, hi, np.array([lo, hi])
  _, k0, k1, step = best
  ticks = np.arange(k0, k1 + 1) * step
  if expand:
    lo, hi = k0 * step, k1 * step
  return lo, hi, ticks


def tick_labels(ticks: np.ndarray) -> list[str]:
  """Axis labels for `ticks`: as few digits as their spacing needs, scientific when large."""
  step = float(np.min(np.diff(ticks))) if len(ticks) > 1 else 1.0
  big = float(np.max(np.abs(ticks)))
  if step <= 0:
    step = 1.0
  if big >= 1e6 or step < 1e-4:
    digits = max(1, math.ceil(math.log10(big / step)) + 1) if big > 0 else 1
    labels = [f"{v:.{digits}g}" for v in ticks]
  else:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    labels = [f"{v:.{decimals}f}" for v in ticks]
  return [s[1:] if s.startswith("-") and float(s) == 0 else s for s in labels]


def _padded_range(values: list[np.ndarray]) -> tuple[float, float]:
  finite = [v[np.isfinite(v)] for v in values]
  finite = [v for v in finite if v.size]
  if not finite:
    return 0.0, 1.0
  lo = float(min(v.min() for v in finite))
  hi = float(max(v.max() for v in finite))
  if hi - lo <= 1e-12 * max(1.0, abs(lo)):
    pad = 0.1 * abs(lo) if lo != 0 else 1.0  # constant data: give it a range to sit in
    lo, hi = lo - pad, hi + pad
  return lo, hi


# ---------------------------------------------------------------------------------------------
# Lines


def _clip_segments(
    x0: np.ndarray, y0: np.ndarray, x1: np.ndarray, y1: np.ndarray,
    xmin: float, xmax: float, ymin: float, ymax: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Liang-Barsky clipping of many segments at once; returns the kept, clipped endpoints."""
  dx, dy = x1 - x0, y1 - y0
  t0, t1 = np.zeros_like(x0), np.ones_like(x0)
  keep = np.ones(x0.shape, dtype=bool)
  for p, q in ((-dx, x0 - xmin), (dx, xmax - x0), (-dy, y0 - ymin), (dy, ymax - y0)):
    keep &= ~((p == 0) & (q < 0))
    with np.errstate(divide="ignore", invalid="ignore"):
      r = q / p
    t0 = np.where(p < 0, np.maximum(t0, r), t0)
    t1 = np.where(p > 0, np.minimum(t1, r), t1)
  keep &= t0 <= t1
  x0, y0, dx, dy, t0, t1 = (a[keep] for a in (x0, y0, dx, dy, t0, t1))
  return x0 + t0 * dx, y0 + t0 * dy, x0 + t1 * dx, y0 + t1 * dy


def _stamp(
    img: np.ndarray, rows: np.ndarray, cols: np.ndarray,
    offsets: tuple[np.ndarray, np.ndarray], color: _Rgb, clip: tuple[int, int, int, int],
) -> None:
  """Paints `offsets` around each (row, col), keeping only pixels inside `clip` (r0, r1, c0, c1)."""
  r0, r1, c0, c1 = clip
  rr = (rows[:, None] + offsets[0][None, :]).ravel()
  cc = (cols[:, None] + offsets[1][None, :]).ravel()
  inside = (rr >= r0) & (rr <= r1) & (cc >= c0) & (cc <= c1)
  img[rr[inside], cc[inside]] = color


_THICK2 = (np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]))
_DOT3 = (np.repeat(np.arange(-1, 2), 3), np.tile(np.arange(-1, 2), 3))


def _draw_polyline(
    img: np.ndarray, px: np.ndarray, py: np.ndarray, color: _Rgb, clip: tuple[int, int, int, int]
) -> None:
  """2 px line through pixel-space points; non-finite points break it, lone points get a dot."""
  ok = np.isfinite(px) & np.isfinite(py)
  if not ok.any():
    return
  r0, r1, c0, c1 = clip
  seg = ok[:-1] & ok[1:]
  lone = ok.copy()
  lone[:-1] &= ~seg
  lone[1:] &= ~seg
  if lone.any():
    rows, cols = np.round(py[lone]).astype(np.int64), np.round(px[lone]).astype(np.int64)
    _stamp(img, rows, cols, _DOT3, color, clip)
  if not seg.any():
    return
  x0, y0, x1, y1 = _clip_segments(
      px[:-1][seg], py[:-1][seg], px[1:][seg], py[1:][seg], c0, c1 + 0.5, r0, r1 + 0.5
  )
  if x0.size == 0:
    return
  dx, dy = x1 - x0, y1 - y0
  # One sample per pixel along the major axis: dense enough to leave no holes.
  n = np.ceil(np.maximum(np.abs(dx), np.abs(dy))).astype(np.int64) + 1
  starts = np.repeat(np.cumsum(n) - n, n)
  t = (np.arange(int(n.sum())) - starts) / np.repeat(np.maximum(n - 1, 1), n)
  sx = np.repeat(x0, n) + t * np.repeat(dx, n)
  sy = np.repeat(y0, n) + t * np.repeat(dy, n)
  # The 2x2 stamp covers [p - 0.5, p + 1.5) around floor(p - 0.5), i.e. is centred on p.
  rows = np.floor(sy - 0.5).astype(np.int64)
  cols = np.floor(sx - 0.5).astype(np.int64)
  _stamp(img, rows, cols, _THICK2, color, clip)


# ---------------------------------------------------------------------------------------------
# Chart


def line_chart_png(
    path: str,
    series: list[Series],
    *,
    title: str = "",
    x_label: str = "step",
    width: int = 800,
    height: int = 450,
    y_range: tuple[float, float] | None = None,
) -> None:
  """Writes a line chart of `series` to `path` as a PNG.

  Series may have different x values and lengths; empty series appear in the legend only.
  NaN/inf points break a line. Without `y_range` the y axis spans the data, widened to round
  tick values (and padded if the data is constant); with it, the axis is exactly `y_range` and
  anything outside is clipped at the frame. Raises ValueError if the image is too small to hold
  the labels.
  """
  series = list(series)
  xs = [np.asarray(s.x, dtype=np.float64).ravel() for s in series]
  ys = [np.asarray(s.y, dtype=np.float64).ravel() for s in series]
  drawn = [np.isfinite(x) & np.isfinite(y) for x, y in zip(xs, ys)]

  x_lo, x_hi = _padded_range([x[m] for x, m in zip(xs, drawn)])
  if y_range is None:
    y_lo, y_hi = _padded_range([y[m] for y, m in zip(ys, drawn)])
    y_lo, y_hi, y_ticks = nice_ticks(y_lo, y_hi, 5, expand=True)
  else:
    y_lo, y_hi = float(y_range[0]), float(y_range[1])
    if not (math.isfinite(y_lo) and math.isfinite(y_hi) and y_hi > y_lo):
      raise ValueError(f"y_range must be finite with lo < hi, got {y_range}")
    _, _, y_ticks = nice_ticks(y_lo, y_hi, 5, expand=False)
  y_labels = tick_labels(y_ticks)

  pad, tick_len, inset = 10, 4, 4  # inset keeps lines at the range ends off the frame
  img = np.full((height, width, 3), 255, dtype=np.uint8)

  # Vertical layout, top down: title, legend rows, plot, x tick labels, x label.
  top = pad
  title_scale = 2 if _text_width(title, 2) <= width - 2 * pad else 1
  title_top = top
  if title:
    top += _CELL_H * title_scale + 6
  legend_items = []  # (row, left, series)
  left_margin = pad + max(_text_width(s) for s in y_labels) + 3 + tick_len
  legend_x, legend_row = left_margin, 0
  for s in series:
    item_w = 16 + 4 + _text_width(s.name)
    if legend_x + item_w > width - pad and legend_x > left_margin:
      legend_x, legend_row = left_margin, legend_row + 1
    legend_items.append((legend_row, legend_x, s))
    legend_x += item_w + 16
  legend_top = top
  if series:
    top += (legend_row + 1) * (_CELL_H + 5) + 3
  frame_top = top
  frame_bottom = height - 1 - (pad + tick_len + 3 + _CELL_H)
  if x_label:
    frame_bottom -= _CELL_H + 5
  frame_left = left_margin

  # The x ticks depend on the plot width, which depends on the right margin the last x label
  # needs; a provisional margin settles it because labels are only a few characters wide.
  plot_w_guess = width - pad - 24 - frame_left - 2 * inset
  for target in (5, 4, 3, 2):
    x_lo_n, x_hi_n, x_ticks = nice_ticks(x_lo, x_hi, target, expand=True)
    x_labels = tick_labels(x_ticks)
    spacing = plot_w_guess * (x_ticks[1] - x_ticks[0]) / (x_hi_n - x_lo_n)
    if max(_text_width(s) for s in x_labels) + 10 <= spacing:
      break
  x_lo, x_hi = x_lo_n, x_hi_n
  frame_right = width - 1 - max(pad, _text_width(x_labels[-1]) // 2 + 4 - inset)

  if frame_right - frame_left < 4 * inset + 20 or frame_bottom - frame_top < 4 * inset + 20:
    raise ValueError(f"{width}x{height} is too small for a chart with these labels")

  data_l, data_r = frame_left + inset, frame_right - inset
  data_t, data_b = frame_top + inset, frame_bottom - inset

  def to_cols(x: np.ndarray) -> np.ndarray:
    return data_l + (x - x_lo) / (x_hi - x_lo) * (data_r - data_l)

  def to_rows(y: np.ndarray) -> np.ndarray:
    return data_b - (y - y_lo) / (y_hi - y_lo) * (data_b - data_t)

  x_tick_cols = np.round(to_cols(x_ticks)).astype(int)
  y_tick_rows = np.round(to_rows(y_ticks)).astype(int)

  inner = (slice(frame_top + 1, frame_bottom), slice(frame_left + 1, frame_right))
  for c in x_tick_cols:
    img[inner[0], c] = _GRID
  for r in y_tick_rows:
    img[r, inner[1]] = _GRID

  clip = (frame_top + 1, frame_bottom - 1, frame_left + 1, frame_right - 1)
  for s, x, y in zip(series, xs, ys):
    with np.errstate(over="ignore", invalid="ignore"):
      # Absurd values would otherwise overflow to inf and be dropped instead of clipped.
      px = np.clip(to_cols(x), -1e9, 1e9)
      py = np.clip(to_rows(y), -1e9, 1e9)
    px[~np.isfinite(x)] = np.nan
    py[~np.isfinite(y)] = np.nan
    _draw_polyline(img, px, py, tuple(int(c) for c in s.color), clip)

  img[frame_top, frame_left : frame_right + 1] = _INK
  img[frame_bottom, frame_left : frame_right + 1] = _INK
  img[frame_top : frame_bottom + 1, frame_left] = _INK
  img[frame_top : frame_bottom + 1, frame_right] = _INK
  for c, label in zip(x_tick_cols, x_labels):
    img[frame_bottom + 1 : frame_bottom + 1 + tick_len, c] = _INK
    _draw_text(img, label, frame_bottom + tick_len + 3, c, _INK, align="center")
  for r, label in zip(y_tick_rows, y_labels):
    img[r, frame_left - tick_len : frame_left] = _INK
    _draw_text(img, label, r - _CAP_H // 2, frame_left - tick_len - 3, _INK, align="right")

  centre = (frame_left + frame_right) // 2
  if title:
    _draw_text(img, title, title_top, centre, _INK, scale=title_scale, align="center")
  if x_label:
    label_top = frame_bottom + tick_len + 3 + _CELL_H + 5
    _draw_text(img, x_label, label_top, centre, _INK, align="center")
  for row, left, s in legend_items:
    color = tuple(int(c) for c in s.color)
    text_top = legend_top + row * (_CELL_H + 5)
    img[text_top + 3 : text_top + 5, left : left + 16] = color
    _draw_text(img, s.name, text_top, left + 20, color)

  write_png(path, img)
