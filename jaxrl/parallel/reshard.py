"""Moves a param tree onto other devices and shardings without gathering any leaf whole.

Disaggregated runs train on one mesh and sample on a disjoint one; after every train step the
params are published from the train shardings (e.g. FSDP over devices 0-3) to the rollout
shardings (e.g. tensor parallel over devices 4-7). `jax.device_put(x, dst)` does that with a
per-shard copy only when every destination device's shard index is already held by the source
device in the same position; otherwise, for a multi-device source, it takes the whole array to
the host (`x._value`, cached on the source array from then on) and scatters it again. `reshard`
never holds a whole leaf on one device or on the host (unless the destination itself replicates
it). Per leaf (`leaf_path` says which):

1. "copy": same sharding (`is_equivalent_to`): a per-shard copy (`device_put`, `may_alias=False`).
2. "collective": the source's device count equals the destination mesh's size and the
   destination splits the leaf into disjoint shards (no replicated dims). The leaf is first
   resharded on the SOURCE devices into the destination's layout, i.e. the destination's mesh
   shape, axis names and spec over the source devices (one cached, compiled identity with
   `out_shardings`: an all-to-all among the source devices), then `device_put` onto the
   destination: device i of the intermediate holds the index device i of the destination holds,
   so JAX copies shard by shard, device to device. Cost per source device: its source shard + one
   destination shard + the all-to-all's temporaries (XLA CPU: 1.75 destination shards over 4
   devices, 2 for a 2-D reshuffle); per destination device: its shard, copied once. The compiled
   temporaries are checked: a leaf-sized one means XLA replicates the leaf first ("involuntary
   full rematerialization"), and the leaf takes 3.
3. "pieces": everything else (different device counts, replicated destination dims, other
   sharding types). Each distinct destination shard is assembled on its first device from the
   pieces of the source shards that overlap it: a piece is sliced on its source device (a
   one-device program; no slice if the whole source shard is the piece), copied to the
   destination device and written into place (donated buffer); replicas of that shard are then
   copied from it, device to device. Cost: per source device its shard + one piece in flight; per
   destination device its shards + one piece; one small compile per (shard shape, piece shape,
   device); one transfer per piece, so slower than 2 for large evenly split leaves. A jitted
   `dynamic_slice` of the whole sharded leaf is not used: XLA all-gathers the operand when the
   slice runs along a sharded dimension (the whole leaf on every source device), and a
   replicated destination through 2 would hold it twice (temporaries + output) per source device.

Leaves are done one at a time and each is waited for (`block_until_ready`) before the next
starts, so at most one leaf's intermediate is alive: publishing is bounded in memory, not
pipelined across leaves. Single process only for now.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding

Index = tuple[tuple[int, int], ...]  # per-dimension [start, stop) of a shard


def reshard(tree, shardings, observe: Callable[[str], None] | None = None):
  """New arrays holding `tree`'s values with `shardings` (a pytree of `Sharding`s, usually
  `NamedSharding`, with `tree`'s structure); `tree` is left intact.

  Every output is a fresh buffer, even for a leaf already sharded as requested, so the result may
  be published while the source is donated to the next train step. Non-`jax.Array` leaves (numpy,
  scalars) are put with `jax.device_put`. `observe(stage)`, if given, is called after each step
  of each leaf, with the leaf's arrays of that moment alive: "intermediate" (case 2: the
  destination layout on the source devices), "piece" (case 3: one piece copied to its
  destination device) and "final" (the leaf's result ready, before its intermediates are
  dropped), e.g. to sample `device_bytes()`.

  Raises NotImplementedError with several processes and a leaf or destination that is not fully
  addressable (cross-process resharding is not implemented yet).
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  dst_leaves = treedef.flatten_up_to(shardings)
  note = observe or (lambda stage: None)
  if jax.process_count() > 1:
    for x, dst in zip(leaves, dst_leaves):
      if not (getattr(x, "is_fully_addressable", True) and dst.is_fully_addressable):
        raise NotImplementedError(
            "jaxrl.parallel.reshard handles one process only: a leaf or destination sharding is "
            f"not fully addressable with {jax.process_count()} processes")
  return treedef.unflatten([_reshard_leaf(x, dst, note) for x, dst in zip(leaves, dst_leaves)])


def device_bytes() -> dict:
  """Live bytes per device: every addressable shard of `jax.live_arrays()`, each buffer once.

  This is jaxrl's own accounting of what is allocated where (the CPU backend's `memory_stats()`
  is None). It does not see temporaries inside a running XLA program.
  """
  out: dict = {d: 0 for d in jax.local_devices()}
  seen = set()
  for arr in jax.live_arrays():
    if arr.is_deleted():
      continue
    for shard in arr.addressable_shards:
      data = shard.data
      key = (shard.device, data.unsafe_buffer_pointer())
      if key not in seen:
        seen.add(key)
        out[shard.device] = out.get(shard.device, 0) + data.nbytes
  return out


def intermediate_sharding(src: Sharding, dst: NamedSharding) -> NamedSharding:
  """The destination's layout on the source's devices: `dst`'s mesh shape, axis names and spec
  over `src`'s devices (in `src`'s mesh order, so a source already laid out like `dst` needs no
  collective). Position i of its device list holds the shard index position i of `dst`'s does.
  """
  if isinstance(src, NamedSharding):
    devices = list(src.mesh.devices.flat)
  else:
    devices = sorted(src.device_set, key=lambda d: d.id)
  mesh = Mesh(np.asarray(devices, dtype=object).reshape(dst.mesh.devices.shape),
              dst.mesh.axis_names)
  return NamedSharding(mesh, dst.spec, memory_kind=dst.memory_kind)


def leaf_path(x, dst: Sharding) -> tuple[str, int | None]:
  """How `reshard` moves one leaf (a `jax.Array`, or a `jax.ShapeDtypeStruct` with a sharding)
  to `dst`: ("copy", None), ("collective", temp bytes per device of the compiled intermediate
  reshard, None if the backend does not say) or ("pieces", None). Compiles the collective (once;
  `reshard` reuses it)."""
  src = x.sharding
  if src.is_equivalent_to(dst, len(x.shape)):
    return "copy", None
  if not (isinstance(dst, NamedSharding) and src.num_devices == dst.mesh.size):
    return "pieces", None
  shape = tuple(x.shape)
  if np.prod(dst.shard_shape(shape)) * dst.num_devices != np.prod(shape):
    # Some dims replicated: every source device would hold (in temporaries) and send a whole
    # destination shard; pieces send each source shard once per distinct destination shard.
    return "pieces", None
  inter = intermediate_sharding(src, dst)
  if src.is_equivalent_to(inter, len(shape)):
    return "collective", 0
  weak = bool(getattr(x, "weak_type", False))
  temp = collective_temp_bytes(src, inter, shape, np.dtype(x.dtype), weak)
  if temp is not None and temp >= np.prod(shape) * np.dtype(x.dtype).itemsize:
    # A leaf-sized temporary: XLA could not do it as an all-to-all and replicates the leaf first
    # ("involuntary full rematerialization"), the whole leaf on every source device.
    return "pieces", None
  return "collective", temp


@functools.lru_cache(maxsize=1024)
def _compiled_identity(src: Sharding, inter: NamedSharding, shape: tuple[int, ...], dtype,
                       weak_type: bool = False):
  arg = jax.ShapeDtypeStruct(shape, dtype, sharding=src, weak_type=weak_type)
  return jax.jit(lambda x: x, out_shardings=inter).lower(arg).compile()


def collective_temp_bytes(src, inter, shape, dtype, weak_type) -> int | None:
  """Temp bytes XLA plans for the collective `src -> inter` of one leaf (None: not reported)."""
  stats = _compiled_identity(src, inter, shape, dtype, weak_type).memory_analysis()
  return None if stats is None else int(stats.temp_size_in_bytes)


@functools.lru_cache(maxsize=4096)
def _lined_up(inter: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]) -> bool:
  a = inter.devices_indices_map(shape).values()
  b = dst.devices_indices_map(shape).values()
  return [_index(i, shape) for i in a] == [_index(i, shape) for i in b]


def _reshard_leaf(x, dst: Sharding, note: Callable[[str], None]):
  if not isinstance(x, jax.Array):
    out = jax.device_put(x, dst)
    note("final")
    return out
  path, _ = leaf_path(x, dst)
  if path == "copy":
    out = jax.device_put(x, dst, may_alias=False).block_until_ready()
    note("final")
    return out
  if path == "pieces":
    return _assemble(x, dst, note)
  shape = tuple(x.shape)
  inter = intermediate_sharding(x.sharding, dst)
  if not _lined_up(inter, dst, shape):
    raise AssertionError(f"intermediate {inter} does not line up with {dst} for {shape}")
  if x.sharding.is_equivalent_to(inter, x.ndim):
    mid = x  # already in the destination's layout, on other devices
  else:
    mid = _compiled_identity(x.sharding, inter, shape, np.dtype(x.dtype),
                             bool(x.weak_type))(x).block_until_ready()
    note("intermediate")
  # Same mesh shape, axis names and spec, device i <-> device i: JAX copies shard by shard (and
  # must copy, not alias, the source's own buffers where the meshes share a device).
  out = jax.device_put(mid, dst, may_alias=False if mid is x else None).block_until_ready()
  note("final")
  return out


# --- case 3: piecewise, one-device programs only -----------------------------------------------


def _index(idx: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
  return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(idx, shape))


@functools.partial(jax.jit, static_argnums=2)
def _slice(x: jax.Array, starts, sizes: tuple[int, ...]) -> jax.Array:
  return jax.lax.dynamic_slice(x, starts, sizes)


@functools.partial(jax.jit, donate_argnums=0)
def _place(buf: jax.Array, piece: jax.Array, starts) -> jax.Array:
  return jax.lax.dynamic_update_slice(buf, piece, starts)


def _assemble(x: jax.Array, dst: Sharding, note: Callable[[str], None]) -> jax.Array:
  shape = x.shape
  # One source buffer per distinct source index (a replicated source is read once).
  sources: dict[Index, jax.Device] = {}
  for dev, idx in x.sharding.devices_indices_map(shape).items():
    if dev.process_index == jax.process_index():
      sources.setdefault(_index(idx, shape), dev)
  by_device = {s.device: s for s in x.addressable_shards}
  done: dict[Index, jax.Array] = {}  # destination index -> its first assembled buffer
  bufs = []
  for dev, idx in dst.devices_indices_map(shape).items():
    if dev not in dst.addressable_devices:
      continue
    box = _index(idx, shape)
    if box in done:  # replicated destination: copy the assembled shard device to device
      bufs.append(jax.device_put(done[box], dev).block_until_ready())
      continue
    buf = None
    size = tuple(b - a for a, b in box)
    for sbox, sdev in sources.items():
      lo = tuple(max(a, c) for (a, _), (c, _) in zip(box, sbox))
      hi = tuple(min(b, d) for (_, b), (_, d) in zip(box, sbox))
      if any(h <= l for l, h in zip(lo, hi)):
        continue
      piece_size = tuple(h - l for l, h in zip(lo, hi))
      data = by_device[sdev].data
      if piece_size == data.shape:
        piece = data
      else:
        piece = _slice(data, tuple(l - c for l, (c, _) in zip(lo, sbox)), piece_size)
      del data
      # A copy even onto the source's own device: the result must not share the source's buffer.
      moved = jax.device_put(piece, dev, may_alias=False).block_until_ready()
      note("piece")
      del piece
      if piece_size == size:
        buf = moved
      else:
        if buf is None:
          buf = jnp.zeros(size, x.dtype, device=dev)
        buf = _place(buf, moved, tuple(l - a for l, (a, _) in zip(lo, box))).block_until_ready()
      del moved
    if buf is None:  # a zero-size shard: nothing to copy
      buf = jnp.zeros(size, x.dtype, device=dev)
    done[box] = buf
    bufs.append(buf)
  out = jax.make_array_from_single_device_arrays(shape, dst, bufs)
  note("final")
  return out
