"""Which devices and processes train and which generate, from a `MeshShape` (any object with
`rollout_processes`, `data`, `fsdp`, `tensor` and `train_devices`): the device arithmetic of a run
disaggregated across processes, the same on every process. The run's `Topology`
(`jaxrl.run.topology`) is built on it."""

from __future__ import annotations

import jax

from jaxrl.parallel.sharding import make_mesh


def sides(mesh_shape) -> tuple[list, list]:
  """(train devices, rollout devices) of a run disaggregated across processes."""
  procs = set(mesh_shape.rollout_processes)
  devices = jax.devices()
  return ([d for d in devices if d.process_index not in procs],
          [d for d in devices if d.process_index in procs])


def rollout_groups(mesh_shape) -> list[list]:
  """Each rollout process's devices, in process order (the order of a batch's parts)."""
  rollout = sides(mesh_shape)[1]
  return [[d for d in rollout if d.process_index == q]
          for q in sorted(mesh_shape.rollout_processes)]


def rollout_rank(mesh_shape, process: int | None = None) -> int:
  """`process`'s place among the rollout processes (this process's by default)."""
  process = jax.process_index() if process is None else process
  return sorted(mesh_shape.rollout_processes).index(process)


def train_mesh(mesh_shape):
  """The train mesh of a run disaggregated across processes (the same on both sides)."""
  return make_mesh(mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor,
                            sides(mesh_shape)[0][:mesh_shape.train_devices])


def train_processes(mesh_shape) -> tuple[int, ...]:
  """The processes that train (every process not named in `mesh.rollout_processes`)."""
  procs = set(mesh_shape.rollout_processes)
  return tuple(q for q in range(jax.process_count()) if q not in procs)
