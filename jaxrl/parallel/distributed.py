"""Several processes, one program: start-up and host copies of global arrays.

Every process runs the same `python -m jaxrl.train` with the same config; `join` connects them
(`jax.distributed.initialize`, gloo on CPU), after which `jax.devices()` lists every process's
devices and the mesh spans them all. Every process then launches the same computations in the
same order (the multi-controller rule), so anything that decides what to compute (prompts, seeds,
rewards, dynamic-sampling decisions) is computed identically on every process from replicated
inputs; only process 0 writes files and prints.

How the processes find each other, first match wins:
  1. explicit `distributed.*` keys (`num_processes > 1`, `coordinator_address`, `process_id`);
  2. with `distributed.auto`, what `detect` reads from the environment a launcher set up:
     torchrun-style variables, then SLURM (an `srun` step), then a multi-host TPU VM;
  3. otherwise a single process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.parallel import peers
from jaxrl.parallel.sharding import param_shardings


class EnvError(ValueError):
  """A launcher's environment variable is malformed or inconsistent; the message names it."""


@dataclasses.dataclass(frozen=True)
class Detected:
  """The processes a launcher started, as its environment variables describe them.

  `coordinator_address` is None when JAX's own cluster detection picks it (SLURM: the step's
  first node; TPU: worker 0). `num_processes` and `process_id` are read from the same variables
  JAX reads (for the start-up line and checks; after joining, `jax.process_count()` is the
  truth). `local_device_ids` restricts this process to those devices of its host (torchrun-style
  launches with several processes per host: one GPU each); None = all of them.
  """
  kind: str  # "torchrun" | "slurm" | "tpu"
  coordinator_address: str | None
  num_processes: int
  process_id: int
  local_device_ids: tuple[int, ...] | None = None
  source: str = ""  # the variables it was read from, for the start-up line and errors


# JAX's names for its own cluster detection methods (jax/_src/clusters): the SLURM one, and the
# TPU one that reads TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES rather than the metadata server.
_JAX_METHODS = {"slurm": "slurm", "tpu": "gketpu"}


def _int(env: Mapping[str, str], name: str, lo: int, hi: int | None = None,
         hi_name: str = "") -> int:
  """`env[name]` as an int in [lo, hi); EnvError naming the variable and its value."""
  text = env[name]
  try:
    value = int(text.strip())
  except ValueError:
    raise EnvError(f"{name}={text!r} is not an integer") from None
  if value < lo:
    raise EnvError(f"{name}={text!r} must be >= {lo}")
  if hi is not None and value >= hi:
    raise EnvError(f"{name}={text!r} must be < {hi_name or hi}")
  return value


def _require(env: Mapping[str, str], kind: str, names: tuple[str, ...]) -> None:
  for name in names:
    if not env.get(name, "").strip():
      raise EnvError(f"{name} is not set, but the other variables describe a multi-process "
                     f"{kind} launch")


def _coordinator_port(env: Mapping[str, str]) -> int | None:
  """JAX_COORDINATOR_PORT, JAX's override of the coordinator port it picks; None if unset."""
  if "JAX_COORDINATOR_PORT" not in env:
    return None
  return _int(env, "JAX_COORDINATOR_PORT", 1, 65536)


def _torchrun(env: Mapping[str, str]) -> Detected | None:
  n = _int(env, "WORLD_SIZE", 1)
  if n == 1:
    return None
  _require(env, "torchrun-style", ("RANK", "MASTER_ADDR", "MASTER_PORT"))
  rank = _int(env, "RANK", 0, n, f"WORLD_SIZE={n}")
  addr = env["MASTER_ADDR"].strip()
  port = _int(env, "MASTER_PORT", 1, 65536)
  override = _coordinator_port(env)
  if override is not None:
    port = override
  elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    # Started by torchrun itself: its agent on the first node already listens on MASTER_PORT
    # (the store the workers' process group would use), so JAX's coordinator takes the next one.
    port = port + 1 if port < 65535 else port - 1
  if ":" in addr and not addr.startswith("["):
    addr = f"[{addr}]"  # an IPv6 address
  local = None
  local_n = _int(env, "LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in env else 1
  if local_n > 1:
    _require(env, "torchrun-style", ("LOCAL_RANK",))
    local_rank = _int(env, "LOCAL_RANK", 0, local_n, f"LOCAL_WORLD_SIZE={local_n}")
    # One device each for several processes on one host (torchrun's one process per GPU),
    # unless JAX_LOCAL_DEVICE_IDS says otherwise (jax.distributed.initialize reads it then).
    if not env.get("JAX_LOCAL_DEVICE_IDS"):
      local = (local_rank,)
  return Detected("torchrun", f"{addr}:{port}", n, rank, local,
                  "torchrun-style env vars (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)")


def _slurm(env: Mapping[str, str]) -> Detected | None:
  count = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
  if count not in env:
    return None
  n = _int(env, count, 1)
  if n == 1:
    return None
  if "SLURM_STEP_NODELIST" not in env:
    # The batch script (or an salloc shell) itself: one process, whatever the allocation holds.
    raise EnvError(
        f"{count}={env[count]!r} but SLURM_STEP_NODELIST is not set: this process was not "
        f"started by srun, so the job's other {n - 1} tasks are not running jaxrl; start it "
        "with srun, one task per process")
  # What JAX's SLURM detection reads (jax/_src/clusters/slurm_cluster.py); it picks the
  # coordinator itself: the step's first node, port SLURM_JOB_ID % 4096 + 61440.
  _require(env, "SLURM", ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"))
  n = _int(env, "SLURM_NTASKS", 1)
  _int(env, "SLURM_LOCALID", 0)
  if _coordinator_port(env) is None:
    _int(env, "SLURM_JOB_ID", 0)  # JAX derives the port from it
  pid = _int(env, "SLURM_PROCID", 0, n, f"SLURM_NTASKS={n}")
  return Detected("slurm", None, n, pid, None,
                  "SLURM (SLURM_NTASKS, SLURM_PROCID, SLURM_STEP_NODELIST)")


def _tpu(env: Mapping[str, str]) -> Detected | None:
  # JAX reads TPU_PROCESS_ADDRESSES first, then TPU_WORKER_HOSTNAMES: one entry per process of
  # the slice. MEGASCALE_* describe several slices; JAX falls back to the TPU VM metadata server
  # for those, which this function never queries.
  hosts_var = next((v for v in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES") if v in env),
                   None)
  if hosts_var is None:
    return None
  hosts = env[hosts_var].split(",")
  if not all(h.strip() for h in hosts):
    raise EnvError(f"{hosts_var}={env[hosts_var]!r} has an empty entry")
  slices = _int(env, "MEGASCALE_NUM_SLICES", 1) if env.get("MEGASCALE_NUM_SLICES") else 1
  if len(hosts) * slices == 1:
    return None
  worker = 0
  if len(hosts) > 1:
    _require(env, "TPU", ("TPU_WORKER_ID",))
    worker = _int(env, "TPU_WORKER_ID", 0, len(hosts), f"the {len(hosts)} hosts in {hosts_var}")
  slice_id = 0
  if env.get("MEGASCALE_SLICE_ID"):
    slice_id = _int(env, "MEGASCALE_SLICE_ID", 0, slices, f"MEGASCALE_NUM_SLICES={slices}")
  _coordinator_port(env)
  return Detected("tpu", None, len(hosts) * slices, worker + slice_id * len(hosts), None,
                  f"multi-host TPU VM ({hosts_var}, TPU_WORKER_ID)")


def detect(env: Mapping[str, str]) -> Detected | None:
  """The processes a launcher started, from its environment variables; None for one process.

  Pure and fast: reads only `env` (never a metadata server). Sources, first match wins:

  - torchrun-style: `WORLD_SIZE` > 1 with `RANK`, `MASTER_ADDR`, `MASTER_PORT`. The coordinator
    is `MASTER_ADDR:MASTER_PORT`, except under torchrun itself (`TORCHELASTIC_USE_AGENT_STORE`
    = True), whose agent already listens on `MASTER_PORT`: then the port after it.
    `JAX_COORDINATOR_PORT` overrides the port. With several processes per host
    (`LOCAL_WORLD_SIZE` > 1) each process uses its host's device `LOCAL_RANK` only. Checked
    first: a torchrun started by `srun` sets both, and its workers are the processes.
  - SLURM: an `srun` step (`SLURM_STEP_NODELIST` set) of `SLURM_NTASKS` (or `SLURM_NPROCS`) > 1
    tasks, this one `SLURM_PROCID`. JAX's own SLURM detection picks the coordinator (the
    step's first node).
  - TPU VM: `TPU_WORKER_HOSTNAMES` (or `TPU_PROCESS_ADDRESSES`) listing more than one host,
    this one `TPU_WORKER_ID` (times `MEGASCALE_NUM_SLICES` slices, this one
    `MEGASCALE_SLICE_ID`, when set). JAX's TPU detection picks the coordinator (worker 0).

  Raises:
    EnvError: (a ValueError) naming the variable and its value, when a source is present but
      its variables are malformed or inconsistent (a non-integer count, `RANK >= WORLD_SIZE`, a
      missing `MASTER_PORT`, several SLURM tasks outside an `srun` step, ...).
  """
  if "WORLD_SIZE" in env:
    return _torchrun(env)  # the launcher closest to this process decides, also for 1 process
  if "SLURM_JOB_ID" in env:
    found = _slurm(env)
    if found is not None:
      return found
  return _tpu(env)


def _heartbeat(peer_timeout_s: float | None) -> dict:
  """JAX's own heartbeat timeout: `peer_timeout_s` plus a margin (`peers.JAX_MARGIN_S`), so the
  run's `PeerWatch` names a lost process before JAX's runtime ends this one; JAX's default when
  None."""
  if peer_timeout_s is None:
    return {}
  return {"heartbeat_timeout_seconds": int(peer_timeout_s) + peers.JAX_MARGIN_S}


def recover_lost_processes() -> None:
  """Lets the other processes of the JAX job go on when one is lost (`jax_enable_recoverability`,
  set before joining; without it JAX's coordination service ends every process when one is
  lost, whatever the run does: docs/failures.md). Set on every process of a run disaggregated
  across processes, and on no other run. JAX's shutdown barrier then holds none of the
  processes, so process 0, which runs the coordination service, waits for the others itself
  (`peers.PeerWatch`, `hold_exit`)."""
  jax.config.update("jax_enable_recoverability", True)


def own_devices_only() -> None:
  """A rollout process of a run that goes on without it (`Topology.failover`): every program it
  runs spans its own devices alone, so on CPU it runs them without cross-process collectives
  (gloo). Set before its devices are made. With gloo, the same command started again for that
  process (a rejoin) fails at its first program: the rendezvous keys its earlier start wrote in
  the coordination service's store for the same devices are still there (docs/failures.md)."""
  jax.config.update("jax_cpu_collectives_implementation", None)


def store_barrier(name: str, timeout_s: float = 300.0) -> None:
  """Every process waits here for every other, through the coordination service (no program,
  so a process without cross-process collectives, `own_devices_only`, takes part)."""
  peers.coordination_client().wait_at_barrier(name, int(timeout_s * 1000))


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               timeout_s: int = 300, peer_timeout_s: float | None = None) -> None:
  """Joins the processes of a run; a no-op for a single process."""
  if num_processes == 1:
    return
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=int(timeout_s),
                             **_heartbeat(peer_timeout_s))


def initialize_detected(found: Detected, timeout_s: int = 300,
                        peer_timeout_s: float | None = None) -> None:
  """Joins the processes `detect` found."""
  beat = _heartbeat(peer_timeout_s)
  try:
    if found.kind == "torchrun":
      # Everything is given; "deactivate" keeps JAX from reading another cluster's variables
      # (e.g. SLURM_LOCALID under an srun that started torchrun).
      jax.distributed.initialize(
          coordinator_address=found.coordinator_address, num_processes=found.num_processes,
          process_id=found.process_id,
          local_device_ids=list(found.local_device_ids) if found.local_device_ids else None,
          cluster_detection_method="deactivate", initialization_timeout=int(timeout_s), **beat)
    else:
      jax.distributed.initialize(cluster_detection_method=_JAX_METHODS[found.kind],
                                 initialization_timeout=int(timeout_s), **beat)
  except Exception as e:
    where = f", coordinator {found.coordinator_address}" if found.coordinator_address else ""
    e.add_note(f"jaxrl: joining the processes found from {found.source} "
               f"({found.num_processes} processes, this one {found.process_id}{where}); set "
               "--config.distributed.auto=false to run a single process, or the "
               "distributed.* keys to join explicitly")
    raise


def join(coordinator_address: str, num_processes: int, process_id: int, timeout_s: int = 300,
         *, auto: bool = False, env: Mapping[str, str] | None = None,
         peer_timeout_s: float | None = None, recoverable: bool = False,
         rollout_processes: tuple[int, ...] = ()) -> str | None:
  """Joins the processes of a run; returns how (for the start-up line), None for one process.

  Explicit settings (`num_processes > 1`) win. Otherwise, with `auto` and no
  `coordinator_address`, `detect(env)` decides. `peer_timeout_s`: how long a silent process is
  waited for (`jaxrl.parallel.peers`; JAX's heartbeat timeout is set a margin above it).
  `recoverable` (a run with `mesh.rollout_processes`): `recover_lost_processes` first; and
  where process 0 trains, a process of `rollout_processes` runs its programs on its own devices
  alone (`own_devices_only`), so it can be started again.

  Raises:
    EnvError: from `detect`, naming the malformed environment variable (nothing is joined).
  """
  if num_processes > 1:
    if recoverable:
      recover_lost_processes()
    initialize(coordinator_address, num_processes, process_id, timeout_s, peer_timeout_s)
    _own_devices_if(recoverable, process_id, rollout_processes)
    return f"distributed.* keys (coordinator {coordinator_address})"
  if not auto or coordinator_address or env is None:
    return None
  found = detect(env)
  if found is None:
    return None
  if recoverable:
    recover_lost_processes()
  initialize_detected(found, timeout_s, peer_timeout_s)
  _own_devices_if(recoverable, found.process_id, rollout_processes)
  where = f"; coordinator {found.coordinator_address}" if found.coordinator_address else ""
  return f"{found.source}{where}"


def _own_devices_if(recoverable: bool, process_id: int, rollout_processes) -> None:
  if recoverable and 0 not in rollout_processes and process_id in rollout_processes:
    own_devices_only()


# The processes that run the training loop together (None: all of them) and the one of them that
# writes files and prints. Disaggregated across processes (`mesh.rollout_processes`) the rollout
# processes run a loop of their own (`jaxrl.pipeline.remote`): the trainers' collectives must not
# wait for them, and the first trainer writes.
_GROUP: tuple[int, ...] | None = None
_WRITER = 0


def set_group(processes: tuple[int, ...] | None) -> None:
  """Makes `processes` (None: all) the ones `any_process`, `allgather_json` and `is_main` speak
  for; the first of them writes. Called once, before the run starts, on every process."""
  global _GROUP, _WRITER
  _GROUP = None if processes is None else tuple(sorted(processes))
  _WRITER = 0 if _GROUP is None else _GROUP[0]


def group() -> tuple[int, ...]:
  """The processes of this run's training loop (`set_group`), in order."""
  return tuple(range(jax.process_count())) if _GROUP is None else _GROUP


def is_main() -> bool:
  """True on the process that writes files and prints (process 0, or the first trainer when
  the rollouts run on processes of their own)."""
  return jax.process_index() == _WRITER


def fetch(tree):
  """Host (numpy) copies of a pytree of arrays, whole, on every process that holds a part.

  Arrays this process can read entirely (fully addressable, or replicated on every device) are
  copied directly; anything else is gathered over its own devices' processes (one program on
  the array's mesh), so every such process must call this with the same arrays at the same point
  of the program.
  """

  def leaf(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    sh = x.sharding
    if isinstance(sh, NamedSharding):
      whole = _replicate(sh.mesh)(x)
      return np.asarray(whole.addressable_shards[0].data)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(leaf, tree)


@functools.lru_cache(maxsize=16)
def _replicate(mesh: Mesh):
  return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _group_allgather(row: np.ndarray) -> np.ndarray:
  """Every group process's `row` (same shape and dtype everywhere), stacked in process order: one
  program over one device of each group process."""
  procs = group()
  if procs == tuple(range(jax.process_count())):
    return np.asarray(multihost_utils.process_allgather(row)).reshape(len(procs), *row.shape)
  if len(procs) == 1:
    return row[None]
  firsts = []
  for q in procs:
    firsts.append(min((d for d in jax.devices() if d.process_index == q), key=lambda d: d.id))
  mesh = Mesh(np.asarray(firsts, dtype=object), ("p",))
  mine = firsts[procs.index(jax.process_index())]
  x = jax.make_array_from_single_device_arrays(
      (len(procs), *row.shape), NamedSharding(mesh, PartitionSpec("p")),
      [jax.device_put(row[None], mine)])
  return np.asarray(_replicate(mesh)(x).addressable_shards[0].data)


# --- colocated rollouts on several processes ----------------------------------------------------
#
# A rollout thread may launch only programs on its own process's devices: its timing then cannot
# reorder the programs every process must launch in one order (those are the trainer thread's).
# These helpers are the trainer thread's side of that contract: a process-local rollout mesh,
# params published to it as a local copy, and host metadata gathered from every process.


def _process_devices(mesh: Mesh, process: int, tensor: int) -> np.ndarray:
  """Process `process`'s devices of `mesh`, in mesh order, shaped (n / tensor, 1, tensor)."""
  devs = [d for d in mesh.devices.flat if d.process_index == process]
  if len(devs) % tensor:
    raise ValueError(f"mesh.rollout_tensor={tensor} must divide the {len(devs)} devices of "
                     f"process {process}")
  return np.asarray(devs, dtype=object).reshape(len(devs) // tensor, 1, tensor)


def local_mesh(mesh: Mesh, tensor: int = 1) -> Mesh:
  """The rollout mesh of this process: its own devices of `mesh`, rows over 'data' (one shard per
  device, or per `tensor` devices), params split over 'tensor' (`mesh.rollout_tensor`: a model too
  big for one device generates tensor-parallel over the host's devices) and replicated over
  'data' ('fsdp' of size 1). Programs on it never involve another process."""
  return Mesh(_process_devices(mesh, jax.process_index(), tensor), mesh.axis_names)


def every_local_mesh(mesh: Mesh, tensor: int = 1, processes: int | None = None) -> Mesh:
  """Every process's `local_mesh`, stacked along 'data' in process order: one global mesh whose
  rows are the processes' rollout meshes, which `publish_local` copies params onto. `processes`:
  how many (None: `jax.process_count()`; a plan compiling for another slice's hosts names its
  own, `jaxrl.aot`)."""
  n = jax.process_count() if processes is None else processes
  return Mesh(np.concatenate([_process_devices(mesh, q, tensor) for q in range(n)]),
              mesh.axis_names)


@functools.lru_cache(maxsize=32)
def _place(shardings):
  # jnp.copy, not an identity: jit forwards an unchanged input to its output, and the published
  # copy must never be a buffer the train step donates.
  return jax.jit(lambda leaves: [jnp.copy(x) for x in leaves], out_shardings=list(shardings))


def publish_local(params, mesh: Mesh, local: Mesh):
  """A copy of `params` (on the global `mesh`) on the process-local rollout mesh `local`
  (`local_mesh`), laid out there by the parameter rules: replicated, or split over its 'tensor'
  axis.

  One global program, which every process must launch at the same point: a jitted copy onto
  `every_local_mesh` (params replicated over its 'data' axis, so each process's rows of it hold
  whole copies, tensor-split where `local` has a 'tensor' axis: each device receives only the
  part it keeps). Each process then wraps its own devices' buffers of that copy as arrays of
  `local` (no transfer)."""
  stacked = every_local_mesh(mesh, local.shape["tensor"])
  leaves, treedef = jax.tree.flatten(params)
  shardings = tuple(jax.tree.leaves(param_shardings(params, stacked)))
  full = _place(shardings)(leaves)
  order = list(local.devices.flat)

  def leaf(x):
    by_device = {s.device: s.data for s in x.addressable_shards}
    on = NamedSharding(local, x.sharding.spec)
    return jax.make_array_from_single_device_arrays(x.shape, on, [by_device[d] for d in order])

  return jax.tree.unflatten(treedef, [leaf(x) for x in full])


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process of the training loop (`group`): one small
  collective when there are several (each of them must call it at the same point of the
  program), the flag itself for one. How a signal that reached one process (a preempted host)
  becomes every process's decision at the same step."""
  if len(group()) == 1:
    return bool(flag)
  return bool(_group_allgather(np.asarray([int(bool(flag))], np.int32)).any())


def allgather_json(value) -> list:
  """Every training-loop process's `value` (`group`; JSON-able; floats round-trip exactly, NaN
  included), in process order. Two small collectives: each of them must call it at the same
  point of the program."""
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = _group_allgather(np.asarray([data.size], np.int64)).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  got = _group_allgather(padded).reshape(len(sizes), -1)
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(got, sizes.tolist())]
