"""Checkpoints of a run disaggregated across processes (`mesh.rollout_processes`).

Orbax saves and restores with every process of a run taking part, and each process must hold a
shard of every array it writes. The rollout processes hold none of the train state, so the
train side saves it as arrays over a mesh of both sides, `union_mesh`: (side, data, fsdp,
tensor), the state sharded by its own specs and replicated over 'side'. Its first rows are the
train mesh's devices, its last row rollout devices (a device of each rollout process at least),
each holding a zero placeholder of its shard's shape, freed after the save. Orbax writes the
first replica only (replica-parallel writing off), so the files are the train state's, and each
rollout process runs the same save with its placeholders, in order: the train side sends it
each operation (`ckpt/<k>/<n>`). Restores go the same way.

With as many rollout devices as the train mesh has, the train mesh is the first row as it is
(no copy). With fewer, its axes are folded (`config.mirror_folds`): a fold (fd, ff, ft) lays
the train devices out as fd * ff * ft rows of a (data / fd, fsdp / ff, tensor / ft) mesh, and
the state is first copied, on the train devices, into that layout (each device holding fd * ff
* ft times the shard it trains with, for the save), then mirrored on a row of that many
rollout devices. The files are the same either way.
"""

from __future__ import annotations

import itertools
import logging
import pickle

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import mirror_folds
from jaxrl.parallel import bridge as bridge_lib


def union_mesh(train_mesh, rollout_groups):
  """(side, data, fsdp, tensor): the train mesh (folded into rows where the rollout devices are
  fewer, see above), then a row of rollout devices taken from each rollout process in turn
  (`rollout_groups`: each one's devices)."""
  shape = train_mesh.devices.shape
  turns = [d for row in itertools.zip_longest(*rollout_groups) for d in row if d is not None]
  folds = mirror_folds(shape, len(turns), len(rollout_groups))
  if folds is None:
    raise ValueError(f"{len(rollout_groups)} rollout processes with {len(turns)} devices cannot "
                     f"mirror a train mesh of shape {shape}")
  small = tuple(n // f for n, f in zip(shape, folds))
  # Device (i, j, k) of the train mesh: row (i % fd, j % ff, k % ft) of the folds, position
  # (i // fd, j // ff, k // ft) in the folded mesh (neighbours fold together).
  grid = train_mesh.devices.reshape(small[0], folds[0], small[1], folds[1], small[2], folds[2])
  rows = grid.transpose(1, 3, 5, 0, 2, 4).reshape(-1, *small)
  side = np.asarray(turns[:int(np.prod(small))], dtype=object).reshape(small)
  return Mesh(np.concatenate([rows, side[None]]), ("side", *train_mesh.axis_names))


def use_first_replica_writes() -> None:
  """Orbax writes each array's first replica only (not split over replicas), so placeholders
  are never written (see above). Set on every process before the first checkpoint."""
  # Orbax warns that the handler it replaces is overridden: that is the point here.
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
  finally:
    absl.setLevel(level)


def _spec_of(x):
  sh = getattr(x, "sharding", None)
  if isinstance(sh, NamedSharding):
    return tuple(sh.spec)
  return tuple(PartitionSpec())


def _describe(tree) -> tuple[object, list]:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(tuple(x.shape), np.dtype(x.dtype).str, _spec_of(x)) for x in leaves]


class MirroredCheckpointer:
  """The train side's `Checkpointer` when the rollouts run on processes of their own: the same
  interface; saves and restores go over `union_mesh`, and each is sent to the rollout process
  first (`serve_checkpoints` runs it there, on each of the `rollout_processes`)."""

  def __init__(self, inner, channel: bridge_lib.Channel, union, main: bool,
               rollout_processes: int = 1):
    self.inner, self.channel, self.union, self.main = inner, channel, union, main
    self.K = rollout_processes
    self.directory = inner.directory
    self.n = 0

  def _tell(self, op: dict) -> None:
    if self.main:
      data = pickle.dumps(op)
      for k in range(self.K):
        self.channel.put_bytes(f"ckpt/{k}/{self.n}", data)
    self.n += 1

  @property
  def _train_rows(self):
    """The union mesh's train rows (the train mesh, folded where it must be) as a mesh."""
    return Mesh(self.union.devices[:-1], self.union.axis_names)

  def _folded(self) -> bool:
    return self.union.devices.shape[0] > 2

  def _lift(self, x):
    spec = PartitionSpec(*_spec_of(x))
    if self._folded():  # a copy into the folded layout, on the train devices
      x = jax.device_put(x, NamedSharding(self._train_rows, spec))
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(self.union, spec), [s.data for s in x.addressable_shards])

  def save(self, step: int, state, host: dict, *, force: bool = False,
           replace: bool = False) -> bool:
    treedef, leaves = _describe(state)
    self._tell({"op": "save", "step": int(step), "treedef": treedef, "leaves": leaves,
                "host": host, "force": force, "replace": replace})
    return self.inner.save(step, jax.tree.map(self._lift, state), host, force=force,
                           replace=replace)

  def restore(self, step: int | None, target):
    treedef, leaves = _describe(target)
    self._tell({"op": "restore", "step": step, "treedef": treedef, "leaves": leaves})
    lifted = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(self.union, PartitionSpec(*_spec_of(x)))),
        target)
    state, host = self.inner.restore(step, lifted)

    def lower(x, like):
      mine = {s.device: s.data for s in x.addressable_shards}
      on = like.sharding
      if self._folded():  # the folded layout first, then copied into the train mesh's
        on = NamedSharding(self._train_rows, PartitionSpec(*_spec_of(like)))
      order = on.addressable_devices_indices_map(tuple(x.shape))
      got = jax.make_array_from_single_device_arrays(x.shape, on, [mine[d] for d in order])
      return jax.device_put(got, like.sharding) if self._folded() else got

    return jax.tree.map(lower, state, target), host

  def close(self) -> None:
    self._tell({"op": "close"})
    self.inner.close()

  def __getattr__(self, name):  # wait, check, all_steps, latest_step, read_host: this side's
    return getattr(self.inner, name)


def serve_checkpoints(ckpt, channel: bridge_lib.Channel, union, should_stop,
                      rank: int = 0) -> None:
  """Rollout process `rank`'s part of every checkpoint operation the train side sends, in order,
  until it closes the checkpointer (or `should_stop()` with no operation pending)."""
  mine = [d for d in union.devices[-1].flat if d.process_index == jax.process_index()]

  def placeholders(leaves, treedef, abstract: bool):
    out = []
    for shape, dtype, spec in leaves:
      on = NamedSharding(union, PartitionSpec(*spec))
      if abstract:
        out.append(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=on))
        continue
      block = on.shard_shape(tuple(shape))
      out.append(jax.make_array_from_single_device_arrays(
          tuple(shape), on, [jax.device_put(np.zeros(block, np.dtype(dtype)), d) for d in mine]))
    return jax.tree.unflatten(treedef, out)

  n = 0
  while True:
    try:
      op = pickle.loads(channel.take_bytes(f"ckpt/{rank}/{n}", should_stop))
    except bridge_lib.ChannelClosed:
      return
    n += 1
    if op["op"] == "close":
      ckpt.close()
      return
    tree = placeholders(op["leaves"], op["treedef"], abstract=op["op"] != "save")
    if op["op"] == "save":
      ckpt.save(op["step"], tree, op["host"], force=op["force"], replace=op["replace"])
    else:  # restore: this side only takes part; a failure is the train side's to report
      try:
        ckpt.restore(op["step"], tree)
      except Exception:  # noqa: BLE001
        pass
