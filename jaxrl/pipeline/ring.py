"""Pure ring-buffer ops for the forced-lag pipeline: a pytree of arrays with a leading slot axis.

The host-side `LagGate` decides *which* slot a batch lives in (`slot_of(batch_id, depth)`); these
functions only move data, so they jit, donate and shard like any other array code. No threads, no
I/O, no globals.

Sharding: `init` of a sharded example gives ring leaves sharded the same way on the trailing axes
and replicated on the slot axis (every device holds its shard of every slot), so `push`/`pop` with
a traced slot index are local dynamic slices with no communication.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def slot_of(batch_id, depth: int):
  """The ring slot of batch `batch_id` in a ring of `depth` (= L+1) slots: `batch_id % depth`.

  Batches 0..L take slots 0..L; batch b+L+1 reuses the slot freed by batch b, which the gate only
  frees once the trainer has asked for batch b+1, so a slot is never overwritten while in use.
  """
  return batch_id % depth


def _slot_sharding(x, depth: int):
  """The sharding of a ring leaf built from `x`: x's NamedSharding with the slot axis unsharded."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(None, *spec))
  return None


def init(example, depth: int):
  """A ring of `depth` zeroed slots shaped like `example` (a pytree of arrays or shape structs).

  Each leaf gets shape `[depth, *leaf.shape]` and the leaf's dtype. A leaf that is a `jax.Array`
  with a `NamedSharding` keeps that sharding on its own axes (slot axis replicated); other leaves
  are placed on the default device.
  """
  if depth < 1:
    raise ValueError(f"ring depth must be >= 1 (it is lag + 1), got {depth}")

  def leaf(x):
    shape = (depth,) + tuple(x.shape if hasattr(x, "shape") else jnp.shape(x))
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    sharding = _slot_sharding(x, depth)
    if sharding is not None:
      # jit with out_shardings builds each device's shard in place instead of materialising the
      # whole ring on one device and then scattering it.
      return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    return jnp.zeros(shape, dtype)

  return jax.tree.map(leaf, example)


def _check_slot(slot, depth: int) -> None:
  # A traced slot cannot be checked here, and XLA clamps out-of-range dynamic indices silently, so
  # at least catch the host-side mistake.
  if isinstance(slot, numbers.Integral) and not 0 <= slot < depth:
    raise IndexError(f"ring slot {slot} out of range for a ring of depth {depth}")


def push(ring, slot, batch):
  """Returns a new ring with `batch` written at `slot`; `ring` itself is not modified.

  `batch` must have the ring's pytree structure, and each leaf the ring leaf's trailing shape and
  dtype (no silent casts: a dtype change would hide a producer bug). `slot` may be a Python int
  (range-checked) or a traced integer scalar (must be in [0, depth); XLA clamps otherwise).
  """
  depth = jax.tree.leaves(ring)[0].shape[0]
  _check_slot(slot, depth)

  def write(r, b):
    if tuple(r.shape[1:]) != tuple(jnp.shape(b)) or r.dtype != jnp.result_type(b):
      raise ValueError(f"batch leaf {jnp.shape(b)} {jnp.result_type(b)} does not fit ring slot "
                       f"{tuple(r.shape[1:])} {r.dtype}")
    return jax.lax.dynamic_update_index_in_dim(r, b, slot, axis=0)

  return jax.tree.map(write, ring, batch)


def pop(ring, slot):
  """Returns the batch stored at `slot` (a pytree like the ring's example). Pure: the slot keeps its
  contents until the next `push` overwrites it."""
  depth = jax.tree.leaves(ring)[0].shape[0]
  _check_slot(slot, depth)
  return jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, slot, axis=0, keepdims=False),
                      ring)
