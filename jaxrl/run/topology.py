"""Where a run's rollouts are generated and how each params version reaches them: one `Topology`,
built once from the validated `MeshShape`, and one `Publisher` per run.

Three layouts, one value each (never a branch in the loop):

- **colocated** (`mesh.rollout = 0`): the samplers generate on the train mesh; on one process the
  rollout worker is a thread beside the trainer;
- **devices** (`mesh.rollout > 0`, one process): the samplers generate on devices of their own in
  the same process (`Parts.rollout_mesh`); a version crosses as a reshard;
- **processes** (`mesh.rollout_processes`): whole processes generate (`jaxrl.run.actor`)
  and the train processes receive their rows (`jaxrl.pipeline.remote`).

On several processes a colocated run makes each process's share of every batch on its own devices
(`ProcessShare`) when the train mesh's row shards allow it, else the whole batch inline on the
trainer thread (the same batches and staleness, without overlap).

`Topology.feed(parts, handoff)` gives the loop what it runs the lag pipeline with (`Feed`): the
producer, whether it runs inline, and the `Publisher`, which turns the train state's params of
version v into what the samplers read. Every publisher makes new buffers (the train step donates
its own): a cast or copy colocated, a reshard onto the rollout devices, each process's own copy,
or the exchange with the rollout processes. LoRA's adapter-only sync (`AdapterPublisher`) wraps
the in-process publishers: the frozen base moves once, then only the adapters; across processes
the exchange itself does the same (`remote.Versions`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl import parallel
from jaxrl.config import MeshShape
from jaxrl.envs.agent_task import is_agent
from jaxrl.learner.rl import lora_model
from jaxrl.models import lora as lora_lib
from jaxrl.parallel import sides as devices_lib
from jaxrl.pipeline import ParamsHandoff, remote
from jaxrl.pipeline.producer import RolloutProducer, process_share
from jaxrl.pipeline.turns import SamplerFirst
from jaxrl.rollout.precision import rollout_dtype
from jaxrl.runtime import mirror


class Publisher(Protocol):
  """Publishes params version v: `publish(v, params)` returns what the samplers read (None when
  it went to another process). `start(first_batch)` is called once the loop knows where it starts
  (after a restore); `close()` when it ends, whether or not it failed."""

  def __call__(self, version: int, params): ...

  def start(self, first_batch: int) -> None: ...

  def close(self) -> None: ...


class _InProcess:
  """Shared by the publishers whose samplers run in this process."""

  def start(self, first_batch: int) -> None:
    del first_batch

  def close(self) -> None:
    pass


class LocalPublisher(_InProcess):
  """The samplers' copy in this process: a cast (or copy) on the train mesh when colocated, a
  reshard onto the rollout devices when they are others (`Parts.rollout_copy`)."""

  def __init__(self, parts):
    self.parts = parts

  def place(self, tree):
    return self.parts.rollout_place(tree)

  def __call__(self, version: int, params):
    del version
    return self.parts.rollout_copy(params)


class ProcessPublisher(_InProcess):
  """Each process's copy on its own devices (`ProcessShare.publish`): a global program, which the
  trainer thread launches at the same point on every process."""

  def __init__(self, parts, share):
    self.parts, self.share = parts, share

  def place(self, tree):
    return self.parts.rollout_place(tree, self.share)

  def __call__(self, version: int, params):
    del version
    return self.share.publish(params)


class AdapterPublisher(_InProcess):
  """LoRA around an in-process publisher: the samplers run the base with the adapters merged into
  its weights; the base moves once (again only if the train state's base is another object), then
  each version moves the adapters alone (`lora.AdapterSync`)."""

  def __init__(self, inner, lora, dtype):
    self.inner = inner
    self.sync = lora_lib.AdapterSync(lora, inner.place, dtype)

  def __call__(self, version: int, params):
    del version
    return self.sync(params)


class RemotePublisher:
  """To the rollout processes (`remote.Sender`): every version they will ask for crosses in the
  one program both sides launch; nothing is published in this process."""

  def __init__(self, sender: remote.Sender, receiver: remote.Receiver, steps: int, lag: int,
               mesh=None):
    self.sender, self.receiver, self.steps, self.lag = sender, receiver, steps, lag
    # Versions kept in a checkpoint are bytes split over every train device (a replicated copy
    # would put a whole params version on each device).
    self.split = None if mesh is None else NamedSharding(mesh, PartitionSpec(mesh.axis_names))

  def __call__(self, version: int, params):
    self.sender(version, params)
    return None

  def kept(self, versions) -> dict | None:
    """What this process served of `versions`, as uint8 arrays on the train mesh, for a
    checkpoint of a ring that is not full (`LagPipeline.state_dict(partial=True)`); None where
    they would not come back whole: several train processes (each serves its own rows of a
    version, which one array cannot hold, and each may have received other parts, so none
    saves) or LoRA where older versions are needed (a version of adapters alone needs the
    base a fresh rollout process lacks)."""
    versions = list(versions)
    if self.split is None or len(self.sender.versions.trainers) != 1 or \
        (versions and self.sender.versions.lora is not None):
      return None
    out, devices = {}, self.split.mesh.devices.size
    for v in versions:
      data = self.sender.served(v)
      if data is None:
        return None
      # Its length first (8 bytes), then the bytes, zero-padded to a multiple of the devices.
      n = 8 + len(data)
      flat = np.zeros(-(-n // devices) * devices, np.uint8)
      flat[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
      flat[8:n] = np.frombuffer(data, np.uint8)
      out[v] = jax.device_put(flat, self.split)
    return out

  def kept_target(self, shapes: dict) -> dict:
    """The abstract arrays `kept`'s restore into, from their `[shape, dtype]` by version."""
    return {v: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=self.split)
            for v, (shape, dtype) in shapes.items()}

  def replay(self, version: int, data) -> None:
    """Serves a kept version again (`LagPipeline.republish`); nothing in this process."""
    flat = np.asarray(data)
    n = int.from_bytes(flat[:8].tobytes(), "little")
    self.sender.replay(version, flat[8:8 + n].tobytes())
    return None

  def start(self, first_batch: int) -> None:
    """Tells the rollout processes which batches to make, from the producer state a restore
    gave the receiver (None: from the start)."""
    self.sender.start(first_batch, remote.horizon(self.steps, self.lag), self.lag,
                      self.receiver.remote_state)

  def close(self) -> None:
    server = self.sender.versions.server
    if self.sender.main and server is not None:  # what crossed (`rollout.sync`)
      print(f"jaxrl | {server.summary()}", flush=True)
    self.sender.done()
    said = self.receiver.summary()
    if said is not None and self.sender.main:
      print(f"jaxrl | {said}", flush=True)


@dataclasses.dataclass
class Feed:
  """What the loop runs its lag pipeline with (`Topology.feed`)."""
  producer: object  # `RolloutProducer`, or `remote.Receiver` across processes
  publisher: Publisher
  inline: bool  # produce on the trainer thread just before each pull
  # Evaluation generates with the train params (merged with their adapters) instead of the
  # published copy: on several processes evaluation is a global program on the train mesh.
  eval_on_train: bool
  asynchronous_eval: bool  # evaluation may run on a thread (one process only)
  lora: object = None  # the LoRA model config, or None
  # A stop asked for on another process (a signal that reached a rollout process), or None.
  stop_elsewhere: Callable[[], bool] | None = None
  # The producer's device sections go before the train step (`jaxrl.pipeline.turns`), or None.
  turns: SamplerFirst | None = None

  def eval_params(self, published, train_params):
    """The params an evaluation pass of this version generates with."""
    if not self.eval_on_train:
      return published
    return train_params if self.lora is None else lora_lib.merge(self.lora, train_params)

  def stop(self, asked: Callable[[], bool]) -> Callable[[], bool]:
    """The loop's stop test: `asked()` (a signal here), or `stop_elsewhere()`."""
    elsewhere = self.stop_elsewhere
    return asked if elsewhere is None else (lambda: asked() or elsewhere())


@dataclasses.dataclass(frozen=True)
class Topology:
  """This process's place in the run (see the module docstring)."""
  mesh_shape: MeshShape | None  # None: one process, laid out by its parts (`of`)
  kind: str  # "colocated" | "devices" | "processes"
  generates_only: bool = False  # a rollout process of a run disaggregated across processes

  @classmethod
  def of(cls, parts) -> "Topology":
    """The topology of a one-process run as its parts lay it out (tests, tools)."""
    return cls(None, "colocated" if parts.rollout_mesh is parts.mesh else "devices")

  @classmethod
  def build(cls, mesh_shape: MeshShape) -> "Topology":
    if mesh_shape.rollout_processes:
      return cls(mesh_shape, "processes",
                 jax.process_index() in mesh_shape.rollout_processes)
    return cls(mesh_shape, "devices" if mesh_shape.disaggregated else "colocated")

  @property
  def across(self) -> bool:
    return self.kind == "processes"

  def begin(self) -> None:
    """Every process, before anything else of the run: across processes, the collectives and
    files of the run are the train processes' alone, and the run's messages start afresh."""
    if self.across:
      parallel.distributed.set_group(devices_lib.train_processes(self.mesh_shape))
      remote.new_run()

  @property
  def failover(self) -> bool:
    """Across processes with process 0 (the coordination service) a train process: the rollout
    processes may be lost without ending the run (docs/failures.md), and the train processes
    checkpoint alone."""
    return self.across and 0 not in self.mesh_shape.rollout_processes

  @property
  def checkpoint_processes(self) -> tuple[int, ...] | None:
    """The processes that checkpoint (None: all of them): with `failover`, the train processes
    alone (the rollout processes hold none of the state, and a save must not wait for one that
    is lost)."""
    return devices_lib.train_processes(self.mesh_shape) if self.failover else None

  def checkpointer(self, ckpt, main: bool):
    """The train side's checkpointer: across processes without `failover` (process 0
    generates), every checkpoint also runs on the rollout processes (`jaxrl.runtime.mirror`),
    which hold none of the state. (With one train process other than process 0 the train side
    cannot save alone: Orbax writes an array held whole by one process of several only from
    process 0.)"""
    if not self.across or self.failover:
      return ckpt
    return mirror.MirroredCheckpointer(ckpt, remote.run_channel(), self.union(), main,
                                       len(self.mesh_shape.rollout_processes))

  def union(self):
    """The mesh of both sides every mirrored checkpoint runs over. Also sets Orbax to write
    each array's first replica only, which every process must do before the first checkpoint
    (`jaxrl.runtime.mirror`)."""
    mirror.use_first_replica_writes()
    return mirror.union_mesh(devices_lib.train_mesh(self.mesh_shape),
                             devices_lib.rollout_groups(self.mesh_shape))

  def feed(self, parts, params, handoff: ParamsHandoff, main: bool) -> Feed:
    """The producer and publisher of the training side of a run; `params` the base model's
    (their shapes size the exchange across processes); `handoff` the lag pipeline's, which
    partial rollouts read the newest version from."""
    r, lora = parts.cfg.rollout, lora_model(parts)
    newest = handoff.latest if r.partial_rollouts else None
    single = jax.process_count() == 1
    if self.across:
      channel = remote.run_channel()
      versions = remote.Versions(parts, self.mesh_shape, params, channel)
      producer = remote.Receiver(parts, channel, self.mesh_shape.rollout_processes, main,
                                 functools.partial(print, flush=True),
                                 parts.cfg.distributed.peer_timeout_s)
      sender = remote.Sender(versions, channel, main, producer)
      if parallel.peers.WATCH is not None:  # a dropped rollout process's parts move on
        producer.token_of = parallel.peers.WATCH.token_of
        parallel.peers.WATCH.listen(producer.lost, producer.back)
      # A signal that reaches a rollout process is said on the channel (`jaxrl.run.actor`).
      return Feed(producer, RemotePublisher(sender, producer, parts.cfg.train.steps, r.lag,
                                            parts.mesh),
                  inline=False, eval_on_train=True, asynchronous_eval=False, lora=lora,
                  stop_elsewhere=lambda: sender.channel.has("stop"))
    share = process_share(parts)
    inline = not single and share is None
    turns = SamplerFirst() if not inline and self.sampler_first(parts) else None
    producer = RolloutProducer(parts, parts.train_loop(newest, share and share.mesh, turns),
                               share)
    publisher = LocalPublisher(parts) if share is None else ProcessPublisher(parts, share)
    if lora is not None:
      publisher = AdapterPublisher(publisher, lora, rollout_dtype(parts.cfg))
    return Feed(producer, publisher, inline=inline, eval_on_train=not single,
                asynchronous_eval=single, lora=lora, turns=turns)

  def sampler_first(self, parts) -> bool:
    """Whether the train step lets the rollout worker's device sections go first
    (`jaxrl.pipeline.turns`, `rollout.sampler_first`): colocated, with samplers whose calls
    mark their sections (not an agent's server), and for "auto" on CPU devices (whose cores the
    two would split) without partial rollouts (whose batches are to take the versions
    published while they generate)."""
    r = parts.cfg.rollout
    how = r.get("sampler_first", "auto")
    if self.kind != "colocated" or how == "off" or is_agent(parts.cfg.task.name):
      return False
    return how == "on" or (parts.mesh.devices.flat[0].platform == "cpu"
                           and not r.partial_rollouts)

  def describe(self, parts, feed: Feed | None = None) -> str | None:
    """One line on where rollouts run, or None when colocated."""
    shape = "x".join(map(str, parts.rollout_mesh.devices.shape))
    if self.kind == "devices":
      first, n = parts.mesh.devices.size, parts.rollout_mesh.devices.size
      return (f"disaggregated: train on devices 0-{first - 1}, rollouts on devices {first}-"
              f"{first + n - 1} (mesh {shape})")
    if self.kind != "processes" or feed is None:
      return None
    m, versions = self.mesh_shape, feed.publisher.sender.versions
    shape = "x".join(map(str, m.rollout_shape))
    crossing = f"{versions.bytes_per_version:,} bytes per params version"
    if versions.lora is not None:
      crossing = (f"the base once ({versions.base_bytes:,} bytes), then the adapters "
                  f"({versions.bytes_per_version:,} bytes per version)")
    return (f"disaggregated across processes: processes {list(m.rollout_processes)} generate on "
            f"their {m.rollout_devices} devices (a {shape} mesh each), processes "
            f"{list(devices_lib.train_processes(m))} train on {m.train_devices}; {crossing}")
