"""Digests of a checkpoint's arrays: silent damage to their bytes is found on restore.

A checkpoint's array files can be damaged after they were written (a bad disk, a torn copy
between buckets, a stale NFS cache) in a way that still decodes: the restore then succeeds and
the run trains on wrong values. So every save writes, as a third Orbax item (`digest`, a JSON
file `<step>/digest/metadata`), one CRC-32 (`zlib.crc32`, standard library) per array, and every
restore recomputes them from the restored values and compares.

- Canonical: the CRC of an array is taken over its global value's bytes in C order (typed PRNG
  keys: their key data), so a checkpoint written on 1 device verifies restored on 8, and the
  path naming an array (`train/params/layers_3/attn/q_proj/kernel`) is its key path in the tree.
- Off the training thread: the save hands host copies of the arrays (see
  `Checkpointer.save`) to a thread pool; the `digest` item's commit waits for the digests, so
  Orbax renames the step to its final name only once the digests are written. A process killed
  before that leaves a tmp directory, never a finished step without digests.
- Required once written: the step's Orbax metadata (`_CHECKPOINT_METADATA`, committed with the
  step) records `custom_metadata.jaxrl_digest`; a finished step that has it but whose digest
  file is gone is damaged, not old. A step without it predates digests (or was saved by arrays
  spanning several processes, whose global bytes no process holds): it restores unverified,
  and the restore says so in one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import zlib

import jax
import numpy as np
import orbax.checkpoint as ocp

ITEM = "digest"
ALGORITHM = "crc32"
MARK = "jaxrl_digest"  # the key in the step's custom metadata saying digests were written
_PIECE = 1 << 26  # bytes hashed per zlib call: no temporary copy of a whole array


def array_path(path) -> str:
  """`train/params/layers_3/attn/q_proj/kernel`: a leaf's key path, '/'-joined."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _bytes_of(x) -> np.ndarray:
  """The global value of `x` (host or device array) as a flat uint8 array in C order."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def crc(x) -> int:
  """CRC-32 of `x`'s global value (see the module docstring), hashed in pieces."""
  flat = _bytes_of(x)
  value = 0
  for start in range(0, flat.size, _PIECE):
    value = zlib.crc32(flat[start:start + _PIECE], value)  # releases the GIL: pieces in parallel
  return value


def _leaves(tree) -> list[tuple[str, object]]:
  return [(array_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if hasattr(x, "shape")]


def compute(tree, pool: concurrent.futures.Executor, after=None) -> dict:
  """`{"algorithm": "crc32", "arrays": {path: crc}}` of every array of `tree`, hashed by
  `pool`'s threads (zlib releases the GIL, so arrays are hashed in parallel), once `after` (a
  threading.Event; None: at once) is set."""
  if after is not None:
    after.wait()
  leaves = _leaves(tree)
  crcs = list(pool.map(lambda kv: crc(kv[1]), leaves))
  return {"algorithm": ALGORITHM, "arrays": {k: c for (k, _), c in zip(leaves, crcs)}}


def mismatch(saved: dict, tree, pool: concurrent.futures.Executor, prefix: str = "") -> str | None:
  """Why restored `tree` (its paths under `prefix`) is not what was saved, or None: the first
  array (in tree order) whose CRC differs from the saved digest, or one the digest lacks."""
  if saved.get("algorithm") != ALGORITHM:
    return f"its digest file names algorithm {saved.get('algorithm')!r}, not {ALGORITHM!r}"
  arrays = saved.get("arrays", {})
  leaves = [(prefix + k, x) for k, x in _leaves(tree)]
  crcs = pool.map(lambda kv: crc(kv[1]), leaves)
  for (path, _), got in zip(leaves, crcs):
    want = arrays.get(path)
    if want is None:
      return f"array {path} has no digest"
    if got != want:
      return (f"array {path} does not match its digest (crc32 {got:08x}, saved {want:08x}): "
              "its bytes were damaged after the save")
  return None


def verifiable(tree) -> bool:
  """Whether this process holds the global value of every array (one process, any number of
  devices); arrays spanning several processes are not hashed here."""
  return all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree))


def required(step_dir: str) -> bool | None:
  """Whether finished step `step_dir` was saved with digests (its Orbax metadata says so);
  None when that metadata cannot be read (`step_problem` reports it)."""
  try:
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "rb") as f:
      meta = json.loads(f.read().decode("utf-8"))
  except (OSError, ValueError):
    return None
  custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
  return isinstance(custom, dict) and custom.get(MARK) == ALGORITHM


def file_of(step_dir: str) -> str:
  return os.path.join(step_dir, ITEM, "metadata")


def read(step_dir: str) -> dict:
  """The digest file of step `step_dir` (raises OSError / ValueError when unreadable)."""
  with open(file_of(step_dir), "rb") as f:
    got = json.loads(f.read().decode("utf-8"))
  if not isinstance(got, dict) or not isinstance(got.get("arrays"), dict):
    raise ValueError("not a digest object")
  return got


class DigestHandler(ocp.handlers.JsonCheckpointHandler):
  """The `digest` item: its commit waits for the digests being computed, then writes them as
  JSON (process 0 only), inside the step's tmp directory, before Orbax finalizes the step."""

  async def _write(self, pending: concurrent.futures.Future, directory) -> None:
    digests = await asyncio.wrap_future(pending)
    if jax.process_index() == (self._primary_host or 0):
      (directory / self._filename).write_text(json.dumps(digests))

  async def async_save(self, directory, item=None, args=None):
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write(args.pending, directory), name="jaxrl_digest_save")]

  def save(self, directory, item=None, args=None):
    directory.joinpath(self._filename).write_text(json.dumps(args.pending.result()))


@ocp.args.register_with_handler(DigestHandler, for_save=True)
@dataclasses.dataclass
class DigestSave(ocp.args.CheckpointArgs):
  """The digests of a save, still being computed (a Future of `compute`'s dict)."""

  pending: concurrent.futures.Future


@ocp.args.register_with_handler(DigestHandler, for_restore=True)
@dataclasses.dataclass
class DigestRestore(ocp.args.CheckpointArgs):
  """Orbax asks for one; restores read the digest file directly (`read`)."""

  item: bytes | None = None
