"""The data plane: a partitioned, keyed row store between rollout and training.

Model. A *partition* ("train", "val") is a data-flow scope. A *row* (one sample) is addressed by
a *key* minted once at rollout (`BatchMeta.mint`) and reused for every later read and write. A
*field* is a column: tokens, mask, rollout log-probs, advantages written later, ... Every read
names its fields; reading an unknown field or key, or a field never written for a key, raises,
so a stage that forgot to produce its output fails loudly instead of training on stale data.
Stage completion is field production: writing `advantages` under existing keys adds a column.

Why metadata on the host and arrays on device. Everything the driver decides per row (group
ids, lengths, policy versions, rewards; which groups to filter, how to balance shards) is a few
scalars per row and is cheap to compute in numpy, so it lives in `BatchMeta` (`batch_meta`). The
bulk per-token arrays never come back to the host: they stay on device as row-sharded
`jax.Array`s, and a read is either the stored array itself or one jitted gather on device.

Placement. Rows are split over the mesh axes ('data', 'fsdp') (`parallel.batch_sharding`); the
row count of every put is a multiple of data x fsdp so every shard holds the same number of
rows. Each put is one *block* (field -> array); the index maps (partition, field, key) ->
(block, row). A read whose keys are one whole block in placement order returns the stored array
(no copy); any other read concatenates the involved blocks and takes the rows in one jitted
function whose cache is keyed by shapes only, so a repeated pattern never recompiles. A block
is released when none of its rows is live, so device memory returns to its baseline once the
step's rows are discarded and the caller drops its results.

Multi-process. The index is host state replicated by construction: every process runs the same
put/get/discard calls with the same metadata (the driver code is SPMD), only array contents are
process-local. Host arrays are assembled with `jax.make_array_from_process_local_data`, each
process contributing the rows its devices address; the gather index is built with
`jax.make_array_from_callback` on a replicated sharding, which needs no cross-process check.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl import parallel
from jaxrl.pipeline.batch_meta import PARTITIONS, BatchMeta


@dataclasses.dataclass(eq=False)
class _Block:
  """The arrays of one put, and how many of its rows are still indexed."""

  partition: str
  arrays: dict[str, jax.Array]
  locs: list[int]  # packed location of each row, the int objects the index shares
  live: int

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in self.arrays.values())


# The index stores a row's location as one int, (block id << _ROW_BITS) | row: a discard or a
# gather turns a field's locations into a numpy array in one C-level pass (np.fromiter), and the
# fast-path check compares the shared int objects of one block by identity.
_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


def _gather_rows(blocks, indices):
  """Per field: concatenate its blocks along rows, then take the requested rows."""
  out = []
  for arrays, idx in zip(blocks, indices):
    cat = arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=0)
    out.append(cat.at[idx].get(mode="promise_in_bounds"))
  return tuple(out)


class DataPlane:
  """Partitioned keyed row store: metadata on the host, per-row arrays on device.

  Thread-safe: one lock guards the index (a rollout thread puts while the trainer thread gets
  and discards); device transfers and the gather run outside it. Blocks referenced by a read in
  flight stay alive through the reader's own references even if another thread discards them.
  """

  def __init__(self, mesh: Mesh, partitions: Sequence[str] = PARTITIONS):
    partitions = tuple(partitions)
    unknown = [p for p in partitions if p not in PARTITIONS]
    if unknown or not partitions:
      raise ValueError(f"partitions must be a non-empty subset of {PARTITIONS}, got {partitions}")
    self.mesh = mesh
    self.partitions = partitions
    self._row_sharding = parallel.batch_sharding(mesh)
    self._replicated = NamedSharding(mesh, P())
    self._lock = threading.Lock()
    self._next_block = itertools.count()
    self._blocks: dict[int, _Block] = {}
    # partition -> field -> key -> packed (block id, row); partition -> live keys (an ordered set).
    self._loc: dict[str, dict[str, dict[str, tuple[int, int]]]] = {p: {} for p in partitions}
    self._keys: dict[str, dict[str, None]] = {p: {} for p in partitions}
    self._local_rows_cache: dict[int, tuple[slice, ...]] = {}
    # The jitted gather behind every `get` of rows that are not one whole stored block: one
    # program per pattern of block shapes (tests count its compiles through this name).
    self.gather_rows = jax.jit(_gather_rows, out_shardings=self._row_sharding)
    self._gather_calls = 0

  def num_row_shards(self) -> int:
    return int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])

  # -- placement -----------------------------------------------------------------------------

  def _local_rows(self, n: int) -> tuple[slice, ...]:
    """The global row ranges this process's devices address, ascending and merged: exactly the
    layout `make_array_from_process_local_data` expects of local data (shards by row start)."""
    if n not in self._local_rows_cache:
      starts = sorted({(idx[0].start or 0, n if idx[0].stop is None else idx[0].stop)
                       for idx in self._row_sharding.addressable_devices_indices_map((n,))
                       .values()})
      merged: list[list[int]] = []
      for a, b in starts:
        if merged and merged[-1][1] == a:
          merged[-1][1] = b
        else:
          merged.append([a, b])
      self._local_rows_cache[n] = tuple(slice(a, b) for a, b in merged)
    return self._local_rows_cache[n]

  def _place(self, arrays: dict, n: int, rows: str) -> dict[str, jax.Array]:
    """Validated arrays -> row-sharded device arrays (host arrays in one batched transfer)."""
    out, host, shapes = {}, {}, {}
    local = self._local_rows(n)
    for f, a in arrays.items():
      if isinstance(a, jax.Array):
        same = a.sharding.is_equivalent_to(self._row_sharding, a.ndim)
        out[f] = a if same else jax.device_put(a, self._row_sharding)
      else:
        if rows == "global" and not (len(local) == 1 and local[0] == slice(0, n)):
          a = a[local[0]] if len(local) == 1 else np.concatenate([a[s] for s in local])
        host[f], shapes[f] = a, (n,) + a.shape[1:]
    if host:
      out.update(jax.make_array_from_process_local_data(self._row_sharding, host, shapes))
    return {f: out[f] for f in arrays}

  def put(self, meta: BatchMeta, arrays: Mapping[str, object], *, rows: str = "global"
          ) -> BatchMeta:
    """Stores `arrays` (leading axis = rows, aligned with `meta`) as one block.

    rows="global": every array holds all len(meta) rows (numpy or jax.Array); rows="local":
    numpy arrays holding only the rows this process's devices address, in global order (on one
    process that is all rows). New fields may be added under existing keys; overwriting a field
    of a key raises. Everything is validated before anything is placed. Returns `meta`.
    """
    part, n = meta.partition, len(meta)
    if rows not in ("global", "local"):
      raise ValueError(f"rows must be 'global' or 'local', got {rows!r}")
    self._check_partition(part)
    if not arrays:
      raise ValueError("put needs at least one field")
    if n == 0:
      raise ValueError("put of an empty BatchMeta: nothing to store")
    if n % self.num_row_shards():
      raise ValueError(f"put of {n} rows: the row count must be a multiple of the "
                       f"{self.num_row_shards()} row shards (mesh data x fsdp)")
    local_n = sum(s.stop - s.start for s in self._local_rows(n))
    checked = {}
    for f, a in arrays.items():
      if not isinstance(f, str):
        raise TypeError(f"field names must be str, got {f!r}")
      if rows == "local" and isinstance(a, jax.Array):
        raise TypeError(f"field {f!r}: rows='local' takes numpy arrays of this process's rows, "
                        "got a jax.Array (pass global jax.Arrays with rows='global')")
      if not isinstance(a, jax.Array):
        a = np.asarray(a)
      want = n if rows == "global" else local_n
      if a.ndim == 0 or a.shape[0] != want:
        raise ValueError(f"field {f!r} has shape {tuple(a.shape)}, expected {want} "
                         f"{'rows' if rows == 'global' else 'local rows'} for a BatchMeta of "
                         f"{n} rows (leading axis = rows)")
      checked[f] = a
    with self._lock:
      self._check_free(part, meta.keys, checked)
    placed = self._place(checked, n, rows)  # device transfers outside the lock
    with self._lock:
      self._check_free(part, meta.keys, checked)  # another thread may have put meanwhile
      bid = next(self._next_block)
      locs = list(range(bid << _ROW_BITS, (bid << _ROW_BITS) + n))
      self._blocks[bid] = _Block(part, placed, locs, n)
      index = self._loc[part]
      for f in placed:
        index.setdefault(f, {}).update(zip(meta.keys, locs))
      self._keys[part].update(dict.fromkeys(meta.keys))
    return meta

  def _check_partition(self, partition: str) -> None:
    if partition not in self._loc:
      raise KeyError(f"unknown partition {partition!r}; this data plane has {self.partitions}")

  def _check_free(self, part: str, keys: tuple[str, ...], arrays: Mapping) -> None:
    index = self._loc[part]
    for f in arrays:
      written = index.get(f)
      if written and any(map(written.__contains__, keys)):
        taken = [k for k in keys if k in written]
        raise ValueError(f"put would overwrite field {f!r} of key {taken[0]!r} in partition "
                         f"{part!r} ({len(taken)} of {len(keys)} keys already have it); "
                         "keys are written once per field — discard them first")

  # -- reads ---------------------------------------------------------------------------------

  def _resolve(self, meta_or_keys, partition: str | None) -> tuple[str, list[str]]:
    if isinstance(meta_or_keys, BatchMeta):
      if partition is not None and partition != meta_or_keys.partition:
        raise ValueError(f"partition={partition!r} contradicts the BatchMeta's partition "
                         f"{meta_or_keys.partition!r}")
      partition, keys = meta_or_keys.partition, list(meta_or_keys.keys)
    else:
      if partition is None:
        raise ValueError("a plain list of keys needs partition=...")
      if isinstance(meta_or_keys, str):
        raise TypeError("pass a list of keys, not one key string")
      keys = list(meta_or_keys)
    self._check_partition(partition)
    return partition, keys

  def _missing_keys(self, part: str, keys: list[str]) -> None:
    live = self._keys[part]
    if not all(map(live.__contains__, keys)):
      missing = [k for k in keys if k not in live]
      raise KeyError(f"key {missing[0]!r} is not in partition {part!r} ({len(missing)} of "
                     f"{len(keys)} requested keys are missing: never put, or discarded)")

  def get(self, meta_or_keys, fields: Sequence[str], *, partition: str | None = None
          ) -> dict[str, jax.Array]:
    """{field: array} with rows in exactly the order of the given keys, row-sharded.

    `fields` is required: a read never means "all fields". A field whose keys are one whole
    block in placement order returns the stored array itself; other fields are gathered on
    device by one jitted call. A plain list of keys needs `partition=`. Never donate a result
    to a jitted function: it may be the stored array, which later reads would find deleted.
    """
    if isinstance(fields, str):
      fields = (fields,)
    fields = tuple(dict.fromkeys(fields))
    if not fields:
      raise ValueError("get needs a non-empty list of fields (never reads all fields)")
    part, keys = self._resolve(meta_or_keys, partition)
    if not keys:
      raise ValueError("get of no keys")
    if len(keys) % self.num_row_shards():
      raise ValueError(f"get of {len(keys)} rows: the row count must be a multiple of the "
                       f"{self.num_row_shards()} row shards (mesh data x fsdp)")
    out: dict[str, jax.Array] = {}
    todo: list[tuple[str, list[tuple[int, int]]]] = []
    blocks: dict[int, dict[str, jax.Array]] = {}
    with self._lock:
      index = self._loc[part]
      for f in fields:
        if f not in index:
          raise KeyError(f"unknown field {f!r} in partition {part!r}; stored fields: "
                         f"{sorted(index)}")
      self._missing_keys(part, keys)
      for f in fields:
        written = index[f]
        try:
          locs = list(map(written.__getitem__, keys))
        except KeyError:
          never = [k for k in keys if k not in written]
          raise KeyError(f"field {f!r} was never written for key {never[0]!r} in partition "
                         f"{part!r} ({len(never)} of {len(keys)} keys lack it)") from None
        block = self._blocks[locs[0] >> _ROW_BITS]
        if len(locs) == len(block.locs) and locs == block.locs:
          out[f] = block.arrays[f]  # fast path: the stored array, no copy
        else:
          todo.append((f, locs))
          for bid in {loc >> _ROW_BITS for loc in locs}:
            blocks.setdefault(bid, self._blocks[bid].arrays)
    if todo:
      out.update(self._gather_fields(todo, blocks))
    return {f: out[f] for f in fields}

  def _gather_fields(self, todo, blocks) -> dict[str, jax.Array]:
    """One jitted call for every field that is not a whole stored block (outside the lock)."""
    args, idx_args, prev = [], [], None
    for f, locs in todo:
      loc = np.fromiter(locs, np.int64, len(locs))
      bids, pos = np.unique(loc >> _ROW_BITS, return_inverse=True)
      arrays = tuple(blocks[int(b)][f] for b in bids)
      offsets = np.cumsum([0] + [a.shape[0] for a in arrays[:-1]])
      idx = (offsets[pos] + (loc & _ROW_MASK)).astype(np.int32)
      if prev is not None and np.array_equal(prev[0], bids) and np.array_equal(prev[1], idx):
        dev_idx = prev[2]  # same rows of the same blocks as the previous field: share the index
      else:
        dev_idx = jax.make_array_from_callback(idx.shape, self._replicated,
                                               lambda i, idx=idx: idx[i])
        prev = (bids, idx, dev_idx)
      args.append(arrays)
      idx_args.append(dev_idx)
    with self._lock:
      self._gather_calls += 1
    result = self.gather_rows(tuple(args), tuple(idx_args))
    return {f: r for (f, _), r in zip(todo, result)}

  # -- release -------------------------------------------------------------------------------

  def _remove(self, part: str, keys: list[str]) -> int:
    """Unindexes `keys` (all present, caller holds the lock); frees blocks with no live row.

    A put indexes every field of its block for every row, and a key leaves all fields at once,
    so a block loses (index entries popped from it) / (its field count) live rows.
    """
    popped = []
    index = self._loc[part]
    for f in list(index):
      written = index[f]
      loc = np.fromiter(map(written.pop, keys, itertools.repeat(-1)), np.int64, len(keys))
      popped.append(loc[loc >= 0] >> _ROW_BITS)
      if not written:
        del index[f]
    live = self._keys[part]
    for k in keys:
      del live[k]
    bids, entries = np.unique(np.concatenate(popped or [np.zeros(0, np.int64)]),
                              return_counts=True)
    for bid, count in zip(bids.tolist(), entries.tolist()):
      block = self._blocks[bid]
      block.live -= count // len(block.arrays)
      if block.live == 0:
        del self._blocks[bid]  # the store's last reference to the block's arrays
    return len(keys)

  def discard(self, meta_or_keys, *, partition: str | None = None) -> int:
    """Frees these rows now (every field); returns how many. All keys are checked first: an
    unknown key raises and nothing is removed."""
    part, keys = self._resolve(meta_or_keys, partition)
    if len(set(keys)) != len(keys):
      raise ValueError("discard: duplicate keys")
    with self._lock:
      self._missing_keys(part, keys)
      return self._remove(part, keys)

  def clear(self, partition: str | None = None) -> int:
    """Frees every row of `partition` (of all partitions if None); returns how many."""
    parts = self.partitions if partition is None else (partition,)
    for p in parts:
      self._check_partition(p)
    with self._lock:
      return sum(self._remove(p, list(self._keys[p])) for p in parts)

  def stats(self) -> dict[str, int]:
    """Live rows, blocks and device bytes (global array sizes) per partition, and `gather_calls`:
    the `get` calls so far that had to gather rows (whole blocks in placement order are returned
    as stored, without one)."""
    with self._lock:
      out = {"gather_calls": self._gather_calls}
      for p in self.partitions:
        blocks = [b for b in self._blocks.values() if b.partition == p]
        out[f"{p}/rows"] = len(self._keys[p])
        out[f"{p}/blocks"] = len(blocks)
        out[f"{p}/bytes"] = sum(b.nbytes for b in blocks)
      return out
