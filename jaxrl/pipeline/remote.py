"""Disaggregated across processes (`mesh.rollout_processes`): rollout processes that only
generate, train processes that only train.

Each rollout process runs `serve`, not the training loop: a receiver thread joins every params
version the train side publishes (`jaxrl.parallel.bridge.ParamsBridge`, the one program every
process launches, in version order), and its main thread makes batches 0, 1, 2, ... with the
forced-lag version of each, `params_version(b, L)`, on its own devices, exactly as the
one-process `RolloutProducer` does (the same prompt stream, request ids, group ids, dynamic
sampling), then sends each batch's rows to the train side. With K rollout processes, process k
makes the k-th run of P / K whole groups of every batch (`rollout_share`). It never waits for a
train step it does not need: it starts batch b as soon as version b - L is published. With
partial rollouts a batch switches, between decode dispatches, to the newest version joined.

The train side runs the usual training loop with a `Receiver` in place of the producer: its
rollout worker thread reserves a ring slot for batch b and waits for its K parts, and the
trainer thread puts the rows in the data plane when it pulls the batch (`globalize`).
Everything else (the lag ring, staleness, metrics, evaluation on the train mesh, checkpoints) is
the one-process loop's.

Messages (`jaxrl.parallel.bridge.Channel`, the coordination service): `start` (train -> rollout:
the first batch to make, the last one, the producer state to resume from), `publish/<v>` (the
train side launched version v's publish), `rows/<b>/<k>/<q>` (rollout process k's part of batch
b for train process q), `ckpt/<k>/<n>` (checkpoint operation n, for rollout process k), `stop`
(a signal reached a rollout process: the train side checkpoints and stops), `done` (the train
side finished: the rollout processes return).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time

import jax
import numpy as np

from jaxrl.observe import metrics as metrics_lib
from jaxrl.models import lora as lora_lib
from jaxrl.parallel import bridge as bridge_lib
from jaxrl.pipeline.handoff import ParamsHandoff
from jaxrl.pipeline.producer import (LocalRows, ProcessShare, RingItem, RolloutProducer, combine,
                                     part_json)
from jaxrl.pipeline.worker import params_version
from jaxrl.rollout.precision import rollout_dtype


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


def rollout_share(parts, mesh_shape) -> ProcessShare | None:
  """What this rollout process makes of every batch: with K rollout processes, the k-th run of
  P / K whole groups (the rows a one-process run gives them, the same keys: `RolloutProducer`
  with a `ProcessShare`); None with one rollout process, which makes whole batches exactly as one
  process does."""
  k, K = rollout_rank(mesh_shape), len(mesh_shape.rollout_processes)
  if K == 1:
    return None
  P, G = parts.cfg.rollout.num_prompts, parts.cfg.rollout.group_size
  each = P // K
  # Its `publish` (a colocated process's copy from the train mesh) is never called here: the
  # params arrive through `Versions`, so its train mesh is given as the rollout mesh.
  return ProcessShare(k, k * each, each, parts.data.num_row_shards(),
                      tuple(q * each * G for q in range(K)), parts.rollout_mesh,
                      parts.rollout_mesh, rollout_dtype(parts.cfg))


_RUNS = [0]  # runs disaggregated across processes begun by this process


def new_run() -> None:
  """Starts a run's messages afresh: every process calls it at the start of each run (in the same
  order), so a later run in the same processes never reads an earlier one's keys."""
  _RUNS[0] += 1


def run_channel() -> bridge_lib.Channel:
  """The current run's channel (`new_run`)."""
  return bridge_lib.Channel(prefix=f"{bridge_lib.PREFIX}run{_RUNS[0]}/")


def train_mesh(mesh_shape):
  """The train mesh of a run disaggregated across processes (the same on both sides)."""
  from jaxrl import parallel

  return parallel.make_mesh(mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor,
                            sides(mesh_shape)[0][:mesh_shape.train_devices])


def train_processes(mesh_shape) -> tuple[int, ...]:
  procs = set(mesh_shape.rollout_processes)
  return tuple(q for q in range(jax.process_count()) if q not in procs)


def wire_dtype(cfg, template):
  """The dtype params travel in: the samplers' (`rollout.dtype`) where it is narrower than the
  trainer's, else the trainer's (a wider one is cast on arrival)."""
  trainer = jax.tree.leaves(template)[0].dtype
  d = rollout_dtype(cfg)
  if d is not None and np.dtype(d).itemsize < np.dtype(trainer).itemsize:
    return np.dtype(d)
  return np.dtype(trainer)


class Versions:
  """How each params version crosses to the rollout processes (both sides build the same one from
  the run's `parts` and the base model's `params`, or arrays of their shapes).

  Without LoRA, the whole params through one `ParamsBridge` (wire dtype `wire_dtype`, arriving
  in the samplers' dtype). With LoRA (`model.lora`), as colocated (`lora.AdapterSync`): the
  frozen base crosses once with the adapters (and again only if the train state's base is
  another object, e.g. after a restore), the adapters alone every other version, in the
  trainer's dtype, and each rollout process merges them into the base's weights there, in the
  samplers' dtype. Each version is one exchange (a bridge for the whole LoRA params, one for the
  adapters). `send` (train side) returns what it sent, which the rollout side passes to
  `receive`.
  """

  def __init__(self, parts, mesh_shape, params):
    from jaxrl import parallel

    cfg = parts.cfg
    train, groups = sides(mesh_shape)[0], rollout_groups(mesh_shape)
    self.K = len(groups)  # rollout processes
    lora = lora_lib.with_lora(parts.model_cfg, cfg.model.lora)
    self.lora = lora if lora.lora_rank else None
    self.dtype = rollout_dtype(cfg)
    self._inflight = None  # the last exchange launched (train side)
    if self.lora is None:
      self.whole = bridge_lib.ParamsBridge(train, groups, params, wire_dtype(cfg, params),
                                           self.dtype)
      self.shardings = {"whole": parts.rollout_shardings}
      return
    full = lora_lib.join(params, lora_lib.abstract_adapters(self.lora))
    adapters = lora_lib.split(full)[0]
    self.base = bridge_lib.ParamsBridge(train, groups, full, jax.tree.leaves(full)[0].dtype)
    self.adapters = bridge_lib.ParamsBridge(train, groups, adapters,
                                            jax.tree.leaves(adapters)[0].dtype)
    mesh = parts.rollout_mesh
    self.shardings = {"base": parallel.param_shardings(full, mesh),
                      "adapters": parallel.param_shardings(adapters, mesh)}
    self._sent: list | None = None  # the base leaves last sent (train side)
    self._base = self._rest = None  # the base and its unadapted weights there (rollout side)

  @property
  def bytes_per_version(self) -> int:
    """What crosses for each version (with LoRA: the adapters; the base crosses once)."""
    return (self.whole if self.lora is None else self.adapters).wire_bytes

  @property
  def base_bytes(self) -> int:
    return 0 if self.lora is None else self.base.wire_bytes

  def send(self, params) -> str:
    """The train side's part of publishing `params` (the train state's, with their adapters
    where LoRA): 'whole', 'base' (the base with the adapters) or 'adapters'."""
    # One exchange in flight at a time (`ParamsBridge.send`): the previous version's has
    # finished once the rollout processes joined it, which they do as soon as they are told.
    if self._inflight is not None:
      jax.block_until_ready(self._inflight)
    if self.lora is None:
      self._inflight = self.whole.send(params)
      return "whole"
    adapters, base = lora_lib.split(params)
    leaves = jax.tree.leaves(base)
    if self._sent is None or len(leaves) != len(self._sent) or any(
        a is not b for a, b in zip(leaves, self._sent)):
      self._inflight = self.base.send(params)
      self._sent = leaves
      return "base"
    self._inflight = self.adapters.send(adapters)
    return "adapters"

  def receive(self, kind: str):
    """A rollout process's part of publishing a version `send` sent as `kind`: the samplers'
    params on its rollout mesh."""
    if self.lora is None:
      return self.whole.receive(self.shardings["whole"])
    if kind == "base":
      adapters, self._base = lora_lib.split(self.base.receive(self.shardings["base"]))
      self._rest = lora_lib.unadapted(self.lora, self._base, self.dtype)
    else:
      adapters = self.adapters.receive(self.shardings["adapters"])
    return lora_lib.merge(self.lora, lora_lib.join(self._base, adapters), self.dtype,
                          self._rest)


def horizon(steps: int, lag: int) -> int:
  """The last batch a run of `steps` steps makes: the ring holds up to L batches past the last
  one trained on, as one process's worker makes them."""
  return steps - 1 + lag


class Receiver:
  """The train side's producer (see the module docstring): `produce` waits for batch b's parts
  (one per rollout process) and joins them, `globalize` puts the rows in the data plane;
  `encode`/`target`/`decode` are the one-process producer's (checkpoints hold the same ring), and
  `state_dict` is the rollout processes' producer state after the newest batch received (what
  they resume from: the same on each, since each draws the same prompt stream)."""

  def __init__(self, parts, channel: bridge_lib.Channel, rollout_processes: int = 1):
    self.parts, self.channel, self.K = parts, channel, rollout_processes
    self.codec = RolloutProducer(parts, None)
    self.remote_state: dict | None = None
    self.should_stop = lambda: False

  def produce(self, batch_id: int, params, version: int) -> RingItem:
    del params
    heads, arrays = [], []
    for k in range(self.K):
      got, head = bridge_lib.unpack(self.channel.take_bytes(
          f"rows/{batch_id}/{k}/{jax.process_index()}", self.should_stop))
      if head["submit_version"] != version:
        raise RuntimeError(f"batch {batch_id} was generated with params version "
                           f"{head['submit_version']}, expected {version} (rollout process "
                           f"{head['process']})")
      heads.append(head)
      arrays.append(got)
    meta, info, counts, took = combine(heads)
    self.remote_state = heads[0]["producer"]
    # The rows the rollout processes' draws skipped so far (`data/skipped/<reason>`).
    self.parts.source.skipped.update(heads[0]["skipped"])
    info["pipeline/generated_from"] = min(h["started_at"] for h in heads)
    info["pipeline/generated_to"] = max(h["finished_at"] for h in heads)
    joined = {f: np.concatenate([a[f] for a in arrays]) for f in arrays[0]}
    return RingItem(meta, version, took, info, counts, local=LocalRows(joined, {}, {}))

  def globalize(self, item: RingItem) -> RingItem:
    """The rows in the data plane, in this train mesh's length-balanced order (the rollout
    process placed them over its own row shards)."""
    if item.local is None:
      return item
    perm = self.codec.placement(item.meta, self.parts.data.num_row_shards())
    meta = self.parts.data.put(item.meta.subset(perm),
                               {k: v[perm] for k, v in item.local.arrays.items()})
    return RingItem(meta, item.submit_version, item.sample_time_s, item.info)

  def state_dict(self) -> dict:
    if self.remote_state is None:
      return self.codec.state_dict()
    return dict(self.remote_state)

  def load_state_dict(self, host: dict) -> None:
    self.remote_state = {"rng": host["rng"], "next_group": host["next_group"]}

  def encode(self, item):
    return self.codec.encode(item)

  def target(self, host):
    return self.codec.target(host)

  def decode(self, arrays, host):
    return self.codec.decode(arrays, host)


class Sender:
  """The train side's publishing: sends every version the rollout processes will ask for
  (`first`..`last`, set by `start`; `versions`: how, a `Versions`), then tells them."""

  def __init__(self, versions: Versions, channel: bridge_lib.Channel, main: bool):
    self.versions, self.channel, self.main = versions, channel, main
    self.first, self.last = 0, -1

  def start(self, first_batch: int, last_batch: int, lag: int, producer: dict | None) -> None:
    """Tells the rollout process which batches to make (and from which producer state)."""
    self.first = params_version(first_batch, lag)
    self.last = params_version(last_batch, lag) if last_batch >= first_batch else -1
    if self.main:
      self.channel.set("start", json.dumps({"first_batch": first_batch, "last_batch": last_batch,
                                            "producer": producer}))

  def __call__(self, version: int, params) -> None:
    if self.first <= version <= self.last:
      kind = self.versions.send(params)
      if self.main:
        self.channel.set(f"publish/{version}", kind)
    return None

  def done(self) -> None:
    if self.main:
      self.channel.set("done", "1")


def serve(parts, params, mesh_shape, progress: metrics_lib.Progress, stop=None, *,
          ckpt=None, union=None) -> dict:
  """The rollout process's whole run (module docstring); returns a summary of what it made.
  `params`: the starting params or their shapes (the template of every version it receives).
  `ckpt` (a `Checkpointer` on the run's checkpoint directory) and `union` (`union_mesh`): the
  checkpoints it takes part in (`serve_checkpoints`, on a thread of its own) until the train side
  closes them."""
  stop = stop or (lambda: False)
  channel = run_channel()
  versions = Versions(parts, mesh_shape, params)
  ended = threading.Event()
  failure: list[BaseException] = []
  told_stop = False

  def should_stop() -> bool:
    nonlocal told_stop
    if stop() and not told_stop:  # a signal here: the train side decides when to stop
      channel.set("stop", "1")
      told_stop = True
    return ended.is_set() or bool(failure) or channel.has("done")

  saver = None
  quit_saving = threading.Event()
  if ckpt is not None:
    saver = threading.Thread(target=serve_checkpoints, name="checkpoint-mirror",
                             args=(ckpt, channel, union, quit_saving.is_set,
                                   rollout_rank(mesh_shape)), daemon=True)
    saver.start()
  try:
    made = _generate(parts, mesh_shape, progress, channel, versions, should_stop, failure,
                     ended)
  except BaseException:
    quit_saving.set()
    raise
  while saver is not None and saver.is_alive():  # until the train side closes its checkpoints
    saver.join(0.5)
  return made


def _generate(parts, mesh_shape, progress, channel, versions: Versions, should_stop, failure,
              ended) -> dict:
  """`serve`'s batches: a receiver thread joins each params version, this one generates."""
  r = parts.cfg.rollout
  start = json.loads(channel.wait("start", should_stop))
  first, last = start["first_batch"], start["last_batch"]
  # Partial rollouts: a batch starts on its forced-lag version and switches, between decode
  # dispatches, to the newest one the receiver thread has joined.
  handoff = ParamsHandoff()
  producer = RolloutProducer(parts, parts.train_loop(handoff.latest if r.partial_rollouts
                                                     else None),
                             rollout_share(parts, mesh_shape))
  rank = rollout_rank(mesh_shape)
  if start["producer"] is not None:
    producer.load_state_dict(start["producer"])
  wanted = range(params_version(first, r.lag), params_version(last, r.lag) + 1) \
      if last >= first else range(0)

  def receive() -> None:  # the only thread that launches the program spanning both sides
    try:
      for v in wanted:
        kind = channel.wait(f"publish/{v}", should_stop)
        handoff.publish(v, versions.receive(kind))
    except bridge_lib.ChannelClosed:
      pass
    except BaseException as e:  # noqa: BLE001  (reported by the main thread)
      failure.append(e)

  receiver = threading.Thread(target=receive, name="params-receiver", daemon=True)
  receiver.start()
  fields = producer.fields
  made = 0
  trainers = train_processes(mesh_shape)
  me = jax.process_index()
  progress.say(f"rollout process {me}: making batches {first}..{last} for "
               f"train processes {list(trainers)} (lag {r.lag})")
  try:
    for b in range(first, last + 1):
      v = params_version(b, r.lag)
      while True:
        if failure:
          raise failure[0]
        try:
          p = handoff.get(v, timeout=0.2)
          break
        except TimeoutError:
          if failure:  # e.g. the publish failed because the train side is gone
            raise failure[0] from None
          if should_stop():
            return {"rollout/batches": made, "rollout/stopped": True}
      handoff.prune_below(v)
      started = time.time()
      item = producer.produce(b, p, v)
      if item.local is None:  # one rollout process: the whole batch, in its data plane
        arrays = {k: np.asarray(x) for k, x in parts.data.get(item.meta, fields).items()}
        parts.data.discard(item.meta)
        item = dataclasses.replace(item, local=LocalRows(arrays, {}, item.counts))
      head = {**part_json(item), "submit_version": item.submit_version, "process": me,
              "producer": producer.state_dict(), "skipped": dict(parts.source.skipped),
              "started_at": started, "finished_at": time.time()}
      data = bridge_lib.pack({k: item.local.arrays[k] for k in fields}, head)
      for q in trainers:
        channel.put_bytes(f"rows/{b}/{rank}/{q}", data)
      made += 1
    while not should_stop():
      time.sleep(0.2)
  finally:
    ended.set()
    receiver.join(timeout=30)
  return {"rollout/batches": made, "rollout/stopped": False}


# --- checkpoints --------------------------------------------------------------------------------
#
# Orbax saves and restores with every process of a run taking part, and each process must hold a
# shard of every array it writes. The rollout processes hold none of the train state, so the
# train side saves it as arrays over a mesh of both sides, `union_mesh`: (side, data, fsdp,
# tensor), the state sharded by its own specs and replicated over 'side'. Its first rows are the
# train mesh's devices, its last row rollout devices (a device of each rollout process at least),
# each holding a zero placeholder of its shard's shape, freed after the save. Orbax writes the
# first replica only (replica-parallel writing off), so the files are the train state's, and each
# rollout process runs the same save with its placeholders, in order: the train side sends it
# each operation (`ckpt/<k>/<n>`). Restores go the same way.
#
# With as many rollout devices as the train mesh has, the train mesh is the first row as it is
# (no copy). With fewer, its axes are folded (`config.mirror_folds`): a fold (fd, ff, ft) lays
# the train devices out as fd * ff * ft rows of a (data / fd, fsdp / ff, tensor / ft) mesh, and
# the state is first copied, on the train devices, into that layout (each device holding fd * ff
# * ft times the shard it trains with, for the save), then mirrored on a row of that many
# rollout devices. The files are the same either way.


def union_mesh(train_mesh, rollout_groups):
  """(side, data, fsdp, tensor): the train mesh (folded into rows where the rollout devices are
  fewer, see above), then a row of rollout devices taken from each rollout process in turn
  (`rollout_groups`: each one's devices)."""
  from jax.sharding import Mesh

  from jaxrl import config as config_lib

  shape = train_mesh.devices.shape
  turns = [d for row in itertools.zip_longest(*rollout_groups) for d in row if d is not None]
  folds = config_lib.mirror_folds(shape, len(turns), len(rollout_groups))
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
  import logging

  import orbax.checkpoint as ocp

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
  from jax.sharding import NamedSharding, PartitionSpec

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
      import pickle
      data = pickle.dumps(op)
      for k in range(self.K):
        self.channel.put_bytes(f"ckpt/{k}/{self.n}", data)
    self.n += 1

  @property
  def _train_rows(self):
    """The union mesh's train rows (the train mesh, folded where it must be) as a mesh."""
    from jax.sharding import Mesh

    return Mesh(self.union.devices[:-1], self.union.axis_names)

  def _folded(self) -> bool:
    return self.union.devices.shape[0] > 2

  def _lift(self, x):
    from jax.sharding import NamedSharding, PartitionSpec

    spec = PartitionSpec(*_spec_of(x))
    if self._folded():  # a copy into the folded layout, on the train devices
      x = jax.device_put(x, NamedSharding(self._train_rows, spec))
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(self.union, spec), [s.data for s in x.addressable_shards])

  def save(self, step: int, state, host: dict, *, force: bool = False) -> bool:
    treedef, leaves = _describe(state)
    self._tell({"op": "save", "step": int(step), "treedef": treedef, "leaves": leaves,
                "host": host, "force": force})
    return self.inner.save(step, jax.tree.map(self._lift, state), host, force=force)

  def restore(self, step: int | None, target):
    from jax.sharding import NamedSharding, PartitionSpec

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
  import pickle

  from jax.sharding import NamedSharding, PartitionSpec

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
      ckpt.save(op["step"], tree, op["host"], force=op["force"])
    else:  # restore: this side only takes part; a failure is the train side's to report
      try:
        ckpt.restore(op["step"], tree)
      except Exception:  # noqa: BLE001
        pass
