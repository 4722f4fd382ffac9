"""The device mesh a run config asks for, resolved against the devices it will have.

`resolve_mesh_shape` turns the `mesh.*` keys into a `MeshShape`: the train mesh's axes (one may
be -1, the rest of the devices), and, disaggregated, which devices or whole processes generate
instead (`mesh.rollout`, `mesh.train`, `mesh.rollout_processes`). A split that cannot be laid
out is a problem line, as every other config problem (`jaxrl.config.validation`). No jax is
imported here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from jaxrl.config.schema import MESH_AXES, PREFIX, process_list


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """The resolved train mesh, and the rollout mesh's devices when disaggregated.

  `rollout_devices == 0`: colocated, rollouts are generated on the train mesh (on several
  processes: on each process's own devices, `rollout_tensor` its 'tensor' axis). Otherwise the
  first `train_devices` devices hold the train mesh (its first `size` of them) and the next
  `rollout_devices` a rollout mesh of shape (rollout_devices / rollout_tensor, 1,
  rollout_tensor).
  """
  data: int
  fsdp: int
  tensor: int
  train_devices: int = 0
  rollout_devices: int = 0
  rollout_tensor: int = 1
  # Disaggregated across processes (`mesh.rollout_processes`): the processes whose devices only
  # generate (the rollout mesh, on their own devices); the train mesh is the other processes'.
  rollout_processes: tuple[int, ...] = ()

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def disaggregated(self) -> bool:
    return self.rollout_devices > 0

  @property
  def rollout_shape(self) -> tuple[int, int, int]:
    """The rollout mesh's shape: across processes (`rollout_processes`), each rollout process's
    own mesh over its devices."""
    n = self.rollout_devices // max(1, len(self.rollout_processes))
    return (n // self.rollout_tensor, 1, self.rollout_tensor)


def _device_count(key: str, value: float, num_devices: int, problems: list[str]) -> int | None:
  """`mesh.rollout` / `mesh.train` as a device count (a fraction is of all devices)."""
  n = int(round(value * num_devices)) if value < 1 else int(value)
  if n < 1:
    problems.append(f"{PREFIX}{key}: {value!r} of {num_devices} devices is no device")
    return None
  return n


def _resolve_split(good: dict[str, Any], num_devices: int, problems: list[str],
                   num_processes: int = 1) -> tuple[int, int] | None:
  """(train devices, rollout devices); rollout 0 = colocated. None when the split is bad.

  Colocated on several processes, `mesh.rollout_tensor` is the 'tensor' axis of each process's
  own rollout mesh (`jaxrl.parallel.distributed.local_mesh`): it must divide a process's
  devices."""
  rollout, train, rt = good["mesh.rollout"], good["mesh.train"], good["mesh.rollout_tensor"]
  if rollout == 0:
    if train:
      problems.append(f"{PREFIX}mesh.train: only with {PREFIX}mesh.rollout > 0 (disaggregated "
                      f"rollout and train devices), got {train!r}")
      return None
    if rt != 1 and num_processes == 1:
      problems.append(f"{PREFIX}mesh.rollout_tensor: only with {PREFIX}mesh.rollout > 0 or "
                      "several processes (each generating on its own devices); colocated on "
                      f"one process rollouts use the train mesh, got {rt}")
      return None
    local = num_devices // num_processes
    if rt != 1 and local % rt:
      problems.append(f"{PREFIX}mesh.rollout_tensor: must divide each process's {local} "
                      "devices (its own rollout mesh is (devices / rollout_tensor, 1, "
                      f"rollout_tensor)), got {rt}")
      return None
    return num_devices, 0
  n_r = _device_count("mesh.rollout", rollout, num_devices, problems)
  n_t = num_devices - (n_r or 0) if train == 0 else \
      _device_count("mesh.train", train, num_devices, problems)
  if n_r is None or n_t is None:
    return None
  if n_t < 1 or n_r + n_t > num_devices:
    problems.append(
        f"{PREFIX}mesh.rollout: {n_r} rollout + {n_t} train devices need {n_r + n_t} disjoint "
        f"devices, but {num_devices} are available")
    return None
  if n_r % rt:
    problems.append(f"{PREFIX}mesh.rollout_tensor: must divide the {n_r} rollout devices, got "
                    f"{rt}")
    return None
  return n_t, n_r


def _resolve_process_split(good: dict[str, Any], num_devices: int, num_processes: int,
                           problems: list[str]) -> MeshShape | None:
  """The meshes of `mesh.rollout_processes`: those processes' devices generate, the others'
  train (the train mesh's axes resolved over them). None (problems named) when they cannot."""
  key = f"{PREFIX}mesh.rollout_processes"
  ids = process_list(good["mesh.rollout_processes"])
  bad = []
  if num_processes == 1:
    bad.append(f"{key}: names processes that only generate, but the run has one process; join "
               "several (distributed.*) or set it to ''")
  elif any(i >= num_processes for i in ids):
    bad.append(f"{key}: process indices must be < the {num_processes} processes, got "
               f"{good['mesh.rollout_processes']!r}")
  elif len(ids) >= num_processes:
    bad.append(f"{key}: at least one process must train, got all {num_processes}")
  for other in ("mesh.rollout", "mesh.train"):
    if good[other]:
      bad.append(f"{PREFIX}{other}: must be 0 with {key} (whole processes decide the split), "
                 f"got {good[other]!r}")
  resume, run_dir = good.get("resume"), good.get("run_dir")
  if resume not in (None, "auto", "none") and run_dir:
    # Both sides take part in the restore of their own run's checkpoints (`pipeline.remote`).
    own = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    path = os.path.abspath(resume)
    if path not in (os.path.abspath(run_dir), own) and os.path.dirname(path) != own:
      bad.append(f"{PREFIX}resume: with {key} a run resumes from its own checkpoints only "
                 f"({own}), got {resume!r}")
  per = num_devices // num_processes
  if not bad and per % good["mesh.rollout_tensor"]:
    bad.append(f"{PREFIX}mesh.rollout_tensor: must divide the rollout process's {per} devices, "
               f"got {good['mesh.rollout_tensor']}")
  elif not bad and "rollout.num_prompts" in good and "rollout.group_size" in good:
    # Each rollout process makes an equal run of whole groups of every batch.
    prompts, k = good["rollout.num_prompts"], len(ids)
    rows = prompts // k * good["rollout.group_size"]
    shards = per // good["mesh.rollout_tensor"]
    if prompts % k:
      bad.append(f"{PREFIX}rollout.num_prompts: must split evenly over the {k} rollout "
                 f"processes (whole groups each), got {prompts}")
    elif rows % shards:
      each = " each" if k > 1 else ""
      bad.append(f"{PREFIX}rollout.num_prompts: the {rows} rows (rollout.num_prompts * "
                 f"rollout.group_size{' / ' + str(k) if k > 1 else ''}) a rollout process "
                 f"makes of a batch must split evenly over its {shards} row shards{each}")
  problems.extend(bad)
  if bad:
    return None
  n_r = len(ids) * per
  mesh = _resolve_mesh({a: good[f"mesh.{a}"] for a in MESH_AXES}, num_devices - n_r, problems,
                       " train")
  if mesh is None:
    return None
  if mirror_folds((mesh.data, mesh.fsdp, mesh.tensor), n_r, len(ids)) is None:
    # Checkpoints mirror the train mesh, folded, on rollout devices, at least one of each rollout
    # process (pipeline.remote.union_mesh).
    problems.append(f"{key}: no checkpoint layout: the train mesh ({mesh.data}x{mesh.fsdp}x"
                    f"{mesh.tensor}) folded to a size in [{len(ids)}, {n_r}] (at least one "
                    f"device per rollout process, at most the rollout processes' {n_r} devices) "
                    "by dividing its axes: each checkpoint lays the train state over both sides")
    return None
  return dataclasses.replace(mesh, train_devices=num_devices - n_r, rollout_devices=n_r,
                             rollout_tensor=good["mesh.rollout_tensor"], rollout_processes=ids)


def mirror_folds(shape: tuple[int, int, int], rollout_devices: int,
                 rollout_processes: int) -> tuple[int, int, int] | None:
  """How a checkpoint disaggregated across processes folds the train mesh (`shape`: data, fsdp,
  tensor) so that its rollout devices can mirror it (`jaxrl.pipeline.remote.union_mesh`): a
  factor of each axis, the folded mesh (each axis divided by its factor) as large as possible
  but at most `rollout_devices` and at least `rollout_processes` devices (one of each). (1, 1, 1)
  when the rollout devices are as many as the train mesh's; None when no fold fits. Folds 'data'
  first, then 'fsdp', then 'tensor'."""
  def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]

  best, size = None, 0
  for ft in divisors(shape[2]):
    for ff in divisors(shape[1]):
      for fd in divisors(shape[0]):
        m = shape[0] // fd * (shape[1] // ff) * (shape[2] // ft)
        if rollout_processes <= m <= rollout_devices and m > size:
          best, size = (fd, ff, ft), m
  return best


def _resolve_mesh(axes: dict[str, int], num_devices: int, problems: list[str],
                  what: str = "") -> MeshShape | None:
  """The mesh of `axes` (at most one of them -1: the devices left) over `num_devices` devices,
  named in problems as `what` devices (" train" when disaggregated); None when it cannot be."""
  wild = [a for a in MESH_AXES if axes[a] == -1]
  shape = ", ".join(f"{a}={axes[a]}" for a in MESH_AXES)
  if len(wild) > 1:
    problems.append(f"{PREFIX}mesh: at most one axis may be -1, got ({shape})")
    return None
  if wild:
    rest = math.prod(axes[a] for a in MESH_AXES if a != wild[0])
    if num_devices % rest:
      problems.append(
          f"{PREFIX}mesh.{wild[0]}: -1 cannot be resolved: {num_devices}{what} devices are not "
          f"divisible by the product of the other axes ({shape}, product {rest})")
      return None
    axes = {**axes, wild[0]: num_devices // rest}
  mesh = MeshShape(**axes)
  if num_devices % mesh.size:
    problems.append(
        f"{PREFIX}mesh: shape (data={mesh.data}, fsdp={mesh.fsdp}, tensor={mesh.tensor}) "
        f"uses {mesh.size} devices, which does not divide the {num_devices}"
        f"{what + ' devices' if what else ''} available")
    return None
  return mesh



def resolve_mesh_shape(good: dict[str, Any], num_devices: int, num_processes: int,
                       problems: list[str]) -> MeshShape | None:
  """The mesh of the well-typed, in-range keys `good` on `num_devices` devices of
  `num_processes` processes; None (problems named) when it cannot be laid out, or when a
  `mesh.*` key was already refused (its own problem line says so)."""
  axes = [f"mesh.{a}" for a in MESH_AXES]
  if not all(k in good for k in (*axes, "mesh.rollout", "mesh.train", "mesh.rollout_tensor")):
    return None
  if "mesh.rollout_processes" in good and good["mesh.rollout_processes"].strip():
    return _resolve_process_split(good, num_devices, num_processes, problems)
  split = _resolve_split(good, num_devices, problems, num_processes)
  if split is None:
    return None
  n_t, n_r = split
  mesh = _resolve_mesh({a: good[f"mesh.{a}"] for a in MESH_AXES}, n_t, problems,
                       " train" if n_r else "")
  if mesh is not None and n_r:
    mesh = dataclasses.replace(mesh, train_devices=n_t, rollout_devices=n_r,
                               rollout_tensor=good["mesh.rollout_tensor"])
  elif mesh is not None:  # several processes: each one's own rollout mesh
    mesh = dataclasses.replace(mesh, rollout_tensor=good["mesh.rollout_tensor"])
  return mesh
