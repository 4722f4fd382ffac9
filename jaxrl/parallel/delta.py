"""What changed between two params versions, as bytes: the payload of delta weight sync
(`rollout.sync = "delta"`, `jaxrl.parallel.transport`).

A version crosses to a rollout process as one byte string (its rows of the packed params, in the
wire dtype: bfloat16 when the samplers sample in it). Between two RL steps most bf16 values do not
change at all: an Adam step at lr 1e-6 moves a weight of magnitude |w| by about 1e-6, and bf16
keeps 8 significant bits, so a value changes only when the f32 master weight crosses a rounding
boundary (about 1e-6 / ulp(w) of them per step: 1-2% at the 0.5B shape, benchmarks/README.md).

`encode(base, new, itemsize)` cuts both into elements of `itemsize` bytes and, per chunk of
`CHUNK` elements, keeps only the elements that differ: their positions as 1-byte gaps (a gap over
255 is bridged by entries whose value changes nothing), and their XOR against the base (a 1-ulp
change of a bf16 value is a small number in its low byte), each zlib-compressed at level 1. A
chunk where that is not smaller than the chunk itself is sent whole. `decode(base, payload)`
rebuilds `new` bit for bit. Why this form rather than a zlib of the whole XOR: on real RL updates
at the Qwen2.5-0.5B shape it is 2.4-2.6x smaller and about 3x faster to make
(benchmarks/delta_sync.py; the numbers are in docs/training.md).

`checksum` (zlib.crc32) is what the receiver compares the rebuilt bytes with; a payload that is
damaged raises `ValueError` (or rebuilds bytes whose checksum does not match).

Host-side, numpy and the standard library only; no state (`encode` diffs its chunks on up to 8
threads of its own, joined before it returns).
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import zlib

import numpy as np

MAGIC = b"JXD1"
CHUNK = 1 << 22  # elements per chunk: bounds the temporaries (a few times 4 Mi entries)
LEVEL = 1  # zlib: the fastest level; higher ones gain little on sparse data (measured)
_HEAD = struct.Struct("<4sBQQB")  # magic, itemsize, total bytes, chunk elements, tail length
_PART = struct.Struct("<BII")  # chunk kind (0: sparse, 1: whole, 2: unchanged), two lengths
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def checksum(data) -> int:
  """crc32 of `data` (bytes, bytearray or memoryview): what a receiver checks."""
  return zlib.crc32(data) & 0xFFFFFFFF


def _elements(data, itemsize: int) -> np.ndarray:
  n = len(data) // itemsize
  return np.frombuffer(data, _UINT[itemsize], count=n)


def encode(base, new, itemsize: int = 2) -> bytes:
  """The delta that turns `base` into `new` (byte strings of one length; see the module
  docstring). `itemsize`: the bytes of one value (the wire dtype's), 1, 2, 4 or 8."""
  if len(base) != len(new):
    raise ValueError(f"delta.encode: the versions differ in length ({len(base)} and {len(new)} "
                     "bytes); send a full copy")
  if itemsize not in _UINT:
    raise ValueError(f"delta.encode: itemsize must be 1, 2, 4 or 8, got {itemsize}")
  a, b = _elements(base, itemsize), _elements(new, itemsize)
  tail = bytes(new[a.size * itemsize:])
  out = [_HEAD.pack(MAGIC, itemsize, len(new), CHUNK, len(tail)), tail]
  starts = range(0, a.size, CHUNK)
  workers = min(len(starts), os.cpu_count() or 1, 8)
  if workers <= 1:
    parts = [_chunk(a[at:at + CHUNK], b[at:at + CHUNK]) for at in starts]
  else:  # numpy's XOR and scans and zlib release the GIL: chunks on threads, kept in order
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-delta") as pool:
      parts = list(pool.map(lambda at: _chunk(a[at:at + CHUNK], b[at:at + CHUNK]), starts))
  for part in parts:
    out += part
  return b"".join(out)


def _chunk(a: np.ndarray, b: np.ndarray) -> list[bytes]:
  x = a ^ b
  idx = np.flatnonzero(x)
  if idx.size == 0:
    return [_PART.pack(2, 0, 0)]
  gaps = np.diff(idx, prepend=-1)  # >= 1; position = cumsum(gaps) - 1
  extra = (gaps - 1) // 255  # entries of gap 255 (value 0: no change) before each real one
  ends = np.cumsum(extra + 1) - 1
  g = np.full(int(ends[-1]) + 1, 255, np.uint8)
  g[ends] = gaps - extra * 255
  v = np.zeros(g.size, x.dtype)
  v[ends] = x[idx]
  gz, vz = zlib.compress(g.tobytes(), LEVEL), zlib.compress(v.tobytes(), LEVEL)
  if len(gz) + len(vz) >= b.nbytes:
    return [_PART.pack(1, b.nbytes, 0), b.tobytes()]
  return [_PART.pack(0, len(gz), len(vz)), gz, vz]


def decode(base, payload) -> bytearray:
  """`new` from `base` and `encode(base, new)`. Raises ValueError when the payload does not fit
  the base or is damaged (a damaged payload may also rebuild bytes `checksum` then rejects)."""
  view = memoryview(payload)
  try:
    magic, itemsize, total, chunk, tail_len = _HEAD.unpack_from(view, 0)
  except struct.error as e:
    raise ValueError(f"delta.decode: a payload of {len(view)} bytes is cut short") from e
  if magic != MAGIC or itemsize not in _UINT or total != len(base) or chunk < 1:
    raise ValueError(f"delta.decode: not a delta of this base ({len(base)} bytes): magic "
                     f"{bytes(magic)!r}, itemsize {itemsize}, total {total}, chunk {chunk}")
  out = bytearray(base)
  elems = np.frombuffer(out, _UINT[itemsize], count=len(out) // itemsize)
  at = _HEAD.size
  tail = view[at:at + tail_len]
  if len(tail) != tail_len or tail_len != len(out) - elems.size * itemsize:
    raise ValueError("delta.decode: the payload's tail does not fit the base")
  out[elems.size * itemsize:] = tail
  at += tail_len
  try:
    for start in range(0, elems.size, chunk):
      at = _apply(view, at, elems[start:start + chunk])
  except (struct.error, zlib.error) as e:
    raise ValueError(f"delta.decode: a damaged payload ({e})") from e
  if at != len(view):
    raise ValueError(f"delta.decode: {len(view) - at} bytes left over after the last chunk")
  return out


def _apply(view: memoryview, at: int, part: np.ndarray) -> int:
  """Applies one chunk's entry (at offset `at`) to `part` in place; returns the next offset."""
  kind, n1, n2 = _PART.unpack_from(view, at)
  at += _PART.size
  if kind == 2:
    return at
  if kind == 1:
    if n1 != part.nbytes:
      raise ValueError("delta.decode: a whole chunk of the wrong size")
    part[:] = np.frombuffer(view[at:at + n1], part.dtype)
    return at + n1
  if kind != 0:
    raise ValueError(f"delta.decode: unknown chunk kind {kind}")
  g = np.frombuffer(zlib.decompress(view[at:at + n1]), np.uint8)
  v = np.frombuffer(zlib.decompress(view[at + n1:at + n1 + n2]), part.dtype)
  pos = np.cumsum(g, dtype=np.int64) - 1
  if v.size != g.size or (pos.size and pos[-1] >= part.size):
    raise ValueError("delta.decode: a chunk's entries do not fit it")
  part[pos] ^= v
  return at + n1 + n2
