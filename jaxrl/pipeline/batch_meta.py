"""Row metadata of the data plane: `BatchMeta` (the host-side keys, groups, lengths, versions and
tags of one partition's rows) and `balance_rows` (which rows go to which data shard).

Everything the driver decides per row is a few scalars per row, computed in numpy on the host;
the rows' per-token arrays stay on device in a `data_plane.DataPlane`, addressed by the keys
minted here (`BatchMeta.mint`). See `data_plane` for the whole model.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Mapping

import numpy as np

PARTITIONS = ("train", "val")


def _frozen(x, dtype=None) -> np.ndarray:
  """A private read-only copy: metadata is shared between many BatchMeta objects (subset, concat
  and with_tags reuse columns), so nobody may mutate it in place."""
  a = np.array(x, dtype=dtype, copy=True)
  a.setflags(write=False)
  return a


def _json_scalar(x):
  """`x` as JSON can hold it: non-finite floats spelled as strings."""
  if isinstance(x, float) and not np.isfinite(x):
    return repr(x)  # "nan", "inf", "-inf": float() reads them back
  return x


@dataclasses.dataclass(frozen=True, eq=False)
class BatchMeta:
  """Host-side metadata of rows in one partition; the rows' arrays live in a DataPlane.

  Arrays are read-only copies, so every transform returns a new object and never changes its
  input. `eq=False`: two metas are the same batch only if they are the same object.
  """

  partition: str
  keys: tuple[str, ...]  # unique row keys, minted once at rollout
  group_ids: np.ndarray  # [n] int64, explicit group of each row
  lengths: np.ndarray  # [n] int32, tokens per row (e.g. completion length)
  versions: np.ndarray  # [n] int32, policy version that started each row
  tags: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)  # each [n]

  def __post_init__(self):
    if self.partition not in PARTITIONS:
      raise ValueError(f"unknown partition {self.partition!r}; expected one of {PARTITIONS}")
    keys = tuple(self.keys)
    for k in keys:
      if not isinstance(k, str):
        raise TypeError(f"row keys must be str, got {k!r} ({type(k).__name__})")
    if len(set(keys)) != len(keys):
      seen = set()
      dup = next(k for k in keys if k in seen or seen.add(k))
      raise ValueError(f"duplicate row key {dup!r} in BatchMeta of partition {self.partition!r}")
    n = len(keys)
    object.__setattr__(self, "keys", keys)
    for name, dtype in (("group_ids", np.int64), ("lengths", np.int32), ("versions", np.int32)):
      a = _frozen(getattr(self, name), dtype)
      if a.shape != (n,):
        raise ValueError(f"BatchMeta.{name} has shape {a.shape}, expected ({n},) (one per key)")
      object.__setattr__(self, name, a)
    tags = {}
    for name, value in dict(self.tags or {}).items():
      a = _frozen(value)
      if a.shape != (n,):
        raise ValueError(f"tag {name!r} has shape {a.shape}; tags must be 1:1 with the {n} "
                         f"keys (shape ({n},))")
      tags[name] = a
    object.__setattr__(self, "tags", tags)

  @classmethod
  def mint(cls, partition: str, prefix: str, group_ids, lengths, versions,
           tags: Mapping[str, np.ndarray] | None = None) -> BatchMeta:
    """New rows with keys f"{prefix}/{i}": the prefix must be unique per rollout batch (e.g. the
    batch id), which makes keys unique across the run without a global counter."""
    n = len(np.asarray(group_ids))
    return cls(partition, tuple(f"{prefix}/{i}" for i in range(n)), group_ids, lengths, versions,
               tags or {})

  def __len__(self) -> int:
    return len(self.keys)

  def to_json(self) -> dict:
    """A JSON-safe dict (checkpoints); `from_json` restores an equal meta, bit for bit: floats
    round-trip through `repr`, and non-finite values are spelled "nan" / "inf" / "-inf"."""
    return {"partition": self.partition, "keys": list(self.keys),
            "group_ids": self.group_ids.tolist(), "lengths": self.lengths.tolist(),
            "versions": self.versions.tolist(),
            "tags": {k: {"dtype": v.dtype.str, "values": [_json_scalar(x) for x in v.tolist()]}
                     for k, v in self.tags.items()}}

  @classmethod
  def from_json(cls, d: Mapping) -> BatchMeta:
    tags = {k: np.asarray([float(x) if isinstance(x, str) else x for x in t["values"]],
                          np.dtype(t["dtype"]))
            for k, t in d["tags"].items()}
    return cls(d["partition"], tuple(d["keys"]), np.asarray(d["group_ids"], np.int64),
               np.asarray(d["lengths"], np.int32), np.asarray(d["versions"], np.int32), tags)

  def _take(self, idx: np.ndarray) -> BatchMeta:
    return BatchMeta(self.partition, tuple(self.keys[i] for i in idx.tolist()),
                     self.group_ids[idx], self.lengths[idx], self.versions[idx],
                     {k: v[idx] for k, v in self.tags.items()})

  def _indices(self, indices) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.size == 0:
      return np.zeros(0, np.int64)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
      raise IndexError(f"row indices must be a 1-D integer array, got {idx.dtype} {idx.shape}")
    bad = idx[(idx < 0) | (idx >= len(self))]
    if bad.size:
      raise IndexError(f"row index {int(bad[0])} out of range for {len(self)} rows")
    return idx.astype(np.int64)

  def subset(self, indices) -> BatchMeta:
    """The rows at `indices`, in that order (a repeated index is a duplicate key: ValueError)."""
    return self._take(self._indices(indices))

  def slice(self, start: int | None, stop: int | None) -> BatchMeta:
    """Rows [start, stop) with Python slice semantics."""
    return self._take(np.arange(len(self))[start:stop])

  def drop(self, indices) -> BatchMeta | None:
    """The rows not in `indices`, in meta order; None when every row is dropped, so an empty
    batch cannot travel on silently."""
    keep = np.ones(len(self), bool)
    keep[self._indices(indices)] = False
    return self._take(np.flatnonzero(keep)) if keep.any() else None

  def concat(self, *others: BatchMeta) -> BatchMeta:
    """Rows of self then of each other meta. All must be of one partition and carry the same tag
    names (a tag on only some rows could not be 1:1 with the keys)."""
    metas = (self, *others)
    for m in others:
      if m.partition != self.partition:
        raise ValueError(f"cannot concat partition {m.partition!r} onto {self.partition!r}")
      for a, b in ((self, m), (m, self)):
        missing = sorted(set(a.tags) - set(b.tags))
        if missing:
          raise ValueError(f"cannot concat: tag {missing[0]!r} is missing on some metas "
                           f"(tags {sorted(self.tags)} vs {sorted(m.tags)})")
    cat = lambda name: np.concatenate([getattr(m, name) for m in metas])
    return BatchMeta(self.partition, tuple(itertools.chain.from_iterable(m.keys for m in metas)),
                     cat("group_ids"), cat("lengths"), cat("versions"),
                     {t: np.concatenate([m.tags[t] for m in metas]) for t in self.tags})

  def with_tags(self, **tags) -> BatchMeta:
    """A copy with tags added or replaced (each must have one value per row)."""
    return BatchMeta(self.partition, self.keys, self.group_ids, self.lengths, self.versions,
                     {**self.tags, **tags})

  def group_rows(self) -> list[np.ndarray]:
    """Row indices of each group: groups in order of first appearance, rows in meta order."""
    if not len(self):
      return []
    _, first, inverse = np.unique(self.group_ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # group rank by first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    rows = np.argsort(rank[inverse], kind="stable")
    bounds = np.cumsum(np.bincount(rank[inverse], minlength=len(order)))[:-1]
    return np.split(rows, bounds)


def balance_rows(lengths: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
  """Length-balanced, equal-count assignment of rows to `num_shards` data shards.

  Returns (perm, inverse): global position j holds row perm[j]; shard k holds positions
  [k*n/num_shards, (k+1)*n/num_shards). inverse[perm] == arange(n). Every shard gets exactly
  n/num_shards rows (the row sharding splits positions evenly, so counts cannot differ); rows go
  longest first onto the shard with the fewest tokens among shards with room, ties to the lower
  shard and the earlier row, so the result is deterministic; within a shard rows keep ascending
  original order. Sharding is metadata only: apply `perm` with `BatchMeta.subset` and undo it
  on per-row results with `inverse`.
  """
  lengths = np.asarray(lengths)
  n = lengths.shape[0] if lengths.ndim == 1 else -1
  if n < 0:
    raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
  if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) \
      or num_shards < 1:
    raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
  if n == 0:
    raise ValueError("balance_rows: no rows to balance")
  if n % num_shards:
    raise ValueError(f"balance_rows: {n} rows do not split evenly over {num_shards} shards")
  per = n // num_shards
  shard_of = np.empty(n, np.int64)
  # Heap of (tokens, shard) over shards with room: pops the fewest tokens, ties to the lower shard.
  heap = [(0, s) for s in range(num_shards)]
  counts = [0] * num_shards
  lens = lengths.astype(np.int64)
  tokens = lens.tolist()
  for r in np.argsort(-lens, kind="stable").tolist():  # longest first, ties by row
    load, s = heapq.heappop(heap)
    shard_of[r] = s
    counts[s] += 1
    if counts[s] < per:
      heapq.heappush(heap, (load + tokens[r], s))
  perm = np.argsort(shard_of, kind="stable")  # shard-major, ascending rows within a shard
  inverse = np.empty(n, np.int64)
  inverse[perm] = np.arange(n)
  return perm, inverse

