"""The transport of a run disaggregated across processes (`mesh.rollout_processes`): how each
params version crosses to the rollout processes (`Versions`, `Sender`) and how their batches
reach the train side (`Receiver`).

The rollout processes run `jaxrl.run.actor`, not the training loop. The train side runs
the usual training loop with a `Receiver` in place of the producer: its rollout worker thread
reserves a ring slot for batch b and waits for its K parts, and the trainer thread puts the rows
in the data plane when it pulls the batch (`globalize`). Everything else (the lag ring,
staleness, metrics, evaluation on the train mesh, checkpoints) is the one-process loop's.

Messages (`jaxrl.parallel.bridge.Channel`, the coordination service): `start` (train -> rollout:
the first batch to make, the last one, the producer state to resume from), `versions/<q>` (where
train process q serves params versions, `Versions`), `assign/<b>` (which rollout process makes
each part of batch b, `Receiver.plan`), `redo/<p>/<n>` (the n-th part of a dropped process that
rollout process p makes again), `rows/<b>/<k>/<q>` (part k of batch b, for train process q),
`ckpt/<k>/<n>` (mirrored checkpoint operation n, for rollout process k, where process 0
generates: `jaxrl.runtime.mirror`; where it trains the train processes checkpoint alone),
`rejoin/<p>/<token>` (the first batch rollout process p makes after it started again, that start
named by its heartbeat token: `Receiver.back`), `state/<b>` (the prompt stream's state before
batch b, written by the rollout processes for one that starts again), `stop`
(a signal reached a rollout process: the train side checkpoints and stops), `done` (the train
side finished: the rollout processes return).
"""

from __future__ import annotations

import functools
import json
import threading
import time

import jax
import numpy as np

from jaxrl import parallel
from jaxrl.core.errors import StopWithCheckpoint
from jaxrl.models import lora as lora_lib
from jaxrl.parallel import bridge as bridge_lib
from jaxrl.parallel import transport
from jaxrl.parallel.sides import rollout_groups, rollout_rank, sides, train_processes
from jaxrl.pipeline.producer import LocalRows, ProcessShare, RingItem, RolloutProducer, combine
from jaxrl.pipeline.worker import params_version
from jaxrl.rollout.precision import cast_first, rollout_dtype


def rollout_share(parts, mesh_shape, k: int | None = None) -> ProcessShare | None:
  """Part k of every batch (default: this rollout process's own, its rank): with K rollout
  processes, the k-th run of P / K whole groups (the rows a one-process run gives them, the same
  keys: `RolloutProducer` with a `ProcessShare`); None with one rollout process, which makes
  whole batches exactly as one process does. Any rollout process can make any part: the part is
  a function of the batch, its groups and the prompt stream's state before the batch."""
  k = rollout_rank(mesh_shape) if k is None else k
  K = len(mesh_shape.rollout_processes)
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


def wire_dtype(cfg, template):
  """The dtype params travel in: the samplers' (`rollout.dtype`) where it is narrower than the
  trainer's, else the trainer's (a wider one is cast on arrival)."""
  d = rollout_dtype(cfg)
  # The rule of every publish (`precision.moved_copy`): cast before the move when narrower.
  return np.dtype(d) if cast_first(template, d) else np.dtype(jax.tree.leaves(template)[0].dtype)


class Versions:
  """How each params version crosses to the rollout processes (both sides build the same one from
  the run's `parts` and the base model's `params`, or arrays of their shapes).

  Over TCP, point to point (`transport.VersionServer`): each train process serves its rows of
  each version's packed params (`ParamsBridge.host_rows`), its address under `versions/<process>`
  in the channel, and each rollout process fetches every train process's rows of the version it
  needs (a `transport.VersionClient` per train process: checksummed, whole or, with
  `rollout.sync = "delta"`, what changed since the version it holds) and unpacks them on its own
  devices (`ParamsBridge.from_rows`). No
  program spans both sides, so a lost rollout process costs only its own connections
  (docs/failures.md). Without LoRA the whole params cross (wire dtype `wire_dtype`, arriving in
  the samplers' dtype). With LoRA (`model.lora`), as colocated (`lora.AdapterSync`): the frozen
  base crosses with the adapters for the first version (and again only if the train state's base
  is another object, e.g. after a restore), the adapters alone for the others, in the trainer's
  dtype, and each rollout process merges them into the base's weights there, in the samplers'
  dtype. `send` (train side) returns what it sent: 'whole', 'base' or 'adapters'.
  """

  def __init__(self, parts, mesh_shape, params, channel: bridge_lib.Channel | None = None,
               timeout_s: float = 60.0):
    cfg = parts.cfg
    train, groups = sides(mesh_shape)[0], rollout_groups(mesh_shape)
    self.K = len(groups)  # rollout processes
    self.trainers = train_processes(mesh_shape)
    self.channel, self.lag, self.timeout_s = channel, cfg.rollout.lag, float(timeout_s)
    lora = lora_lib.with_lora(parts.model_cfg, cfg.model.lora)
    self.lora = lora if lora.lora_rank else None
    self.dtype = rollout_dtype(cfg)
    self.sync = cfg.rollout.sync  # "full" | "delta" (`jaxrl.parallel.transport`)
    self.server: transport.VersionServer | None = None  # train side, `serve`
    self._clients: dict[int, transport.VersionClient] = {}  # rollout side: one per server
    self.faults = transport.SyncFaults.from_env()  # test faults (this process's arrivals)
    if self.lora is None:
      self.whole = bridge_lib.ParamsBridge(train, groups, params, wire_dtype(cfg, params),
                                           self.dtype)
      self.shardings = {"whole": parts.rollout_shardings}
      self.itemsize = self.whole.wire.itemsize  # what a delta diffs by
      return
    full = lora_lib.join(params, lora_lib.abstract_adapters(self.lora))
    adapters = lora_lib.split(full)[0]
    self.base = bridge_lib.ParamsBridge(train, groups, full, jax.tree.leaves(full)[0].dtype)
    self.adapters = bridge_lib.ParamsBridge(train, groups, adapters,
                                            jax.tree.leaves(adapters)[0].dtype)
    self.itemsize = self.adapters.wire.itemsize  # a delta diffs adapters against adapters
    mesh = parts.rollout_mesh
    self.shardings = {"base": parallel.param_shardings(full, mesh),
                      "adapters": parallel.param_shardings(adapters, mesh)}
    self._sent = lora_lib.SeenBase()  # the base last sent (train side)
    self._base = self._rest = None  # the base and its unadapted weights there (rollout side)

  @property
  def bytes_per_version(self) -> int:
    """What crosses for each version (with LoRA: the adapters; the base crosses once)."""
    return (self.whole if self.lora is None else self.adapters).wire_bytes

  @property
  def base_bytes(self) -> int:
    return 0 if self.lora is None else self.base.wire_bytes

  def serve(self) -> None:
    """Train side: starts this process's server and says where it is."""
    self.server = transport.VersionServer(bridge_lib.reachable_host(), 0, self.timeout_s,
                                          self.itemsize if self.sync == "delta" else None)
    self.channel.set(f"versions/{jax.process_index()}", self.server.address)

  def send(self, version: int, params) -> str:
    """The train side's part of publishing `params` (the train state's, with their adapters
    where LoRA) as `version`: the packing (one program on the train devices, every train process
    at the same point), then this process's rows served; versions no batch still to come needs
    (below `version - L`) are retired."""
    if self.lora is None:
      kind, data = "whole", self.whole.host_rows(params)
    else:
      adapters, base = lora_lib.split(params)
      if self._sent.changed(base):
        kind, data = "base", self.base.host_rows(params)
      else:
        kind, data = "adapters", self.adapters.host_rows(adapters)
    self.server.publish(version, _head(kind) + data)
    self.server.retire_below(version - self.lag)
    return kind

  def receive(self, version: int, should_stop=lambda: False):
    """A rollout process's part of publishing `version`: the samplers' params on its rollout
    mesh, once every train process has served its rows (ChannelClosed if `should_stop()`
    first)."""
    rows, kinds = {}, set()
    for q in self.trainers:
      if q not in self._clients:
        self._clients[q] = transport.VersionClient(
            self.channel.wait(f"versions/{q}", should_stop), self.sync == "delta", self.faults,
            functools.partial(print, flush=True), name=f"train process {q}")
      while True:
        if should_stop():
          raise bridge_lib.ChannelClosed(f"version {version}")
        try:
          data = self._clients[q].fetch(version, min(self.timeout_s, 5.0))
          break
        except TimeoutError:  # not published yet (the train step that makes it is running)
          continue
      rows[q] = memoryview(data)[HEAD:]  # no copy of the version's bytes
      kinds.add(bytes(data[:HEAD]).decode().strip())
    if len(kinds) != 1:
      raise RuntimeError(f"version {version} arrived as {sorted(kinds)} from the train processes")
    kind = kinds.pop()
    if self.lora is None:
      return self.whole.from_rows(rows, self.shardings["whole"])
    if kind == "base":
      adapters, self._base = lora_lib.split(self.base.from_rows(rows, self.shardings["base"]))
      self._rest = lora_lib.unadapted(self.lora, self._base, self.dtype)
    else:
      adapters = self.adapters.from_rows(rows, self.shardings["adapters"])
    return lora_lib.merge(self.lora, lora_lib.join(self._base, adapters), self.dtype,
                          self._rest)

  def received(self) -> str:
    """Rollout side: one line on how the versions came (`transport.received`)."""
    return transport.received(list(self._clients.values()), self.sync)

  def close(self) -> None:
    if self.server is not None:
      self.server.close()


HEAD = 16  # bytes of a version's kind ahead of its rows: the rows stay aligned for a delta


def _head(kind: str) -> bytes:
  return kind.encode().ljust(HEAD - 1) + b"\n"


def horizon(steps: int, lag: int) -> int:
  """The last batch a run of `steps` steps makes: the ring holds up to L batches past the last
  one trained on, as one process's worker makes them."""
  return steps - 1 + lag


class RolloutProcessesLost(StopWithCheckpoint, RuntimeError):
  """Every rollout process was dropped and none came back in time; the message says what to
  rerun (and, once the loop has saved it, which checkpoint the rerun resumes from)."""

  rerun = "rerun the same command on every process"


class Receiver:
  """The train side's producer (see the module docstring): `produce` waits for batch b's K parts
  and joins them, `globalize` puts the rows in the data plane; `encode`/`target`/`decode` are the
  one-process producer's (checkpoints hold the same ring), and `state_dict` is the rollout
  processes' producer state after the newest batch received (what they resume from: the same on
  each, since each draws the same prompt stream).

  Who makes which part (docs/failures.md, "Rollout processes that come and go"): part k of every
  batch is rollout process k's (in `rollout_processes` order) while it is live. The first train
  process (`main`) writes each batch's assignment (`assign/<b>`, `plan`) before any of it can be
  made; a rollout process the run's `PeerWatch` drops (`lost`) has its parts of later batches
  assigned to the live ones, and its undelivered parts of batches already assigned made again
  by a live one (`redo/<process>/<n>`), with the same version and prompt stream state, so no
  batch is lost or reordered. Each part's rows say who made it: `pipeline/groups_made/<process>`
  per step, and `summary` for the whole run. With every rollout process dropped, a wait for
  rows ends after `timeout_s` more (`distributed.peer_timeout_s`) with `RolloutProcessesLost`:
  the run stops, and its rerun resumes from the last checkpoint."""

  def __init__(self, parts, channel: bridge_lib.Channel, rollout_processes=(0,),
               main: bool = False, say=print, timeout_s: float = 60.0):
    self.parts, self.channel, self.main, self.say = parts, channel, main, say
    self.procs = tuple(sorted(rollout_processes))
    self.K = len(self.procs)
    self.codec = RolloutProducer(parts, None)
    self.remote_state: dict | None = None
    self.should_stop = lambda: False
    self.live = set(self.procs)
    self.assigned: dict[int, dict[int, int | None]] = {}  # batch -> part -> its maker (main)
    self.got: dict[int, set[int]] = {}  # batch -> the parts this process has taken
    self.orphans: list[tuple[int, int]] = []  # (batch, part) with no live process to make it
    self.made: dict[int, dict[int, int]] = {}  # maker -> part -> groups
    self._redos: dict[int, int] = {}  # process -> its redo messages so far
    self._lock = threading.Lock()
    self.timeout_s = float(timeout_s)
    self._none_since: float | None = None  # when the last live rollout process was dropped
    self.last_planned = -1  # the newest batch assigned (main)
    self.token_of = lambda q: None  # the token of process q's newest start (`PeerWatch`)

  def bind_stop(self, should_stop) -> None:
    """The lag pipeline's worker stop test, which the waits for rows poll."""
    self.should_stop = should_stop

  # -- who makes what (the first train process) -----------------------------------------------

  def plan(self, batch_id: int) -> None:
    """Assigns batch `batch_id`'s parts (main): each to its own rollout process if live, else to
    the live ones in turn."""
    with self._lock:
      live = [q for q in self.procs if q in self.live]
      parts = {k: q if q in self.live else (live[k % len(live)] if live else None)
               for k, q in enumerate(self.procs)}
      self.assigned[batch_id] = parts
      self.last_planned = max(self.last_planned, batch_id)
      self.orphans += [(batch_id, k) for k, q in parts.items() if q is None]
      self.channel.set(f"assign/{batch_id}", json.dumps({str(k): q for k, q in parts.items()}))

  def lost(self, process: int, why: str) -> None:
    """`PeerWatch`'s report that rollout process `process` was dropped: its undelivered parts
    go to the live ones (main), and from now on it is assigned nothing."""
    with self._lock:
      if process not in self.live:
        return
      self.live.discard(process)
      if not self.live:
        self._none_since = time.monotonic()
      moved = 0
      if self.main:
        for b, parts in sorted(self.assigned.items()):
          for k, q in parts.items():
            if q == process and not self._delivered(b, k):
              parts[k] = None
              self.orphans.append((b, k))
        moved = self._place_orphans()
    if self.main:
      live = sorted(self.live)
      self.say(f"jaxrl | {why}: dropped; {moved} undelivered part(s) of its batches go to "
               f"rollout process(es) {live}" if live else
               f"jaxrl | {why}: dropped; no rollout process is left")

  def back(self, process: int) -> None:
    """`PeerWatch`'s report that rollout process `process` started again (the same command):
    it makes its own part again from the first batch not yet assigned (main tells it which,
    `rejoin/<process>/<its start's token>`; it takes the prompt stream's state before that
    batch from the others, `state/<b>`)."""
    with self._lock:
      if process in self.live:
        return
      self.live.add(process)
      self._none_since = None
      first = self.last_planned + 1
      if self.main:
        self.channel.set(f"rejoin/{process}/{self.token_of(process)}",
                         json.dumps({"first_batch": first}))
    if self.main:
      self.say(f"jaxrl | rollout process {process} started again: it makes its part from "
               f"batch {first} on")

  def _none_left(self) -> bool:
    """No rollout process has been live for `timeout_s`."""
    with self._lock:
      return not self.live and self._none_since is not None and \
          time.monotonic() - self._none_since > self.timeout_s

  def _delivered(self, b: int, k: int) -> bool:
    if k in self.got.get(b, ()):
      return True
    return self.channel.has(f"rows/{b}/{k}/{jax.process_index()}/n")

  def _place_orphans(self) -> int:
    """Gives every orphaned part to a live process (under the lock); how many it placed."""
    live = [q for q in self.procs if q in self.live]
    if not live:
      return 0
    placed, self.orphans = self.orphans, []
    for i, (b, k) in enumerate(placed):
      q = live[i % len(live)]
      self.assigned[b][k] = q
      n = self._redos.get(q, 0)
      self._redos[q] = n + 1
      self.channel.set(f"redo/{q}/{n}", json.dumps({"batch": b, "part": k}))
    return len(placed)

  def summary(self) -> str | None:
    """Who made how many groups for whom, when any process made another's part; else None."""
    if all(set(parts) <= {self.procs.index(q)} for q, parts in self.made.items()):
      return None
    said = []
    for q in sorted(self.made):
      parts = self.made[q]
      own = parts.get(self.procs.index(q), 0)
      others = ", ".join(f"{n} for process {self.procs[k]}" for k, n in sorted(parts.items())
                         if k != self.procs.index(q))
      said.append(f"process {q}: {sum(parts.values())} ({own} of its own"
                  f"{', ' + others if others else ''})")
    return "rollout groups made: " + "; ".join(said)

  # -- the batches ------------------------------------------------------------------------------

  def produce(self, batch_id: int, params, version: int) -> RingItem:
    del params
    heads, arrays = [], []
    G = self.parts.cfg.rollout.group_size
    made: dict[str, int] = {}
    for k in range(self.K):
      try:
        got, head = bridge_lib.unpack(self.channel.take_bytes(
            f"rows/{batch_id}/{k}/{jax.process_index()}",
            lambda: self.should_stop() or self._none_left()))
      except bridge_lib.ChannelClosed:
        if not self._none_left():
          raise
        raise RolloutProcessesLost(
            f"every rollout process ({', '.join(map(str, self.procs))}) was lost and none came "
            f"back within distributed.peer_timeout_s={self.timeout_s:g} s while the train side "
            f"waited for batch {batch_id}") from None
      with self._lock:
        self.got.setdefault(batch_id, set()).add(k)
      if head["submit_version"] != version:
        raise RuntimeError(f"batch {batch_id} was generated with params version "
                           f"{head['submit_version']}, expected {version} (rollout process "
                           f"{head['process']})")
      heads.append(head)
      arrays.append(got)
      groups = len(head["meta"]["keys"]) // G
      maker = int(head["process"])
      made[f"pipeline/groups_made/{maker}"] = made.get(f"pipeline/groups_made/{maker}", 0) + \
          groups
      mine = self.made.setdefault(maker, {})
      mine[k] = mine.get(k, 0) + groups
    with self._lock:
      for b in [b for b in self.got if b <= batch_id]:
        self.got.pop(b)
        self.assigned.pop(b, None)
    meta, info, counts, took = combine(heads)
    self.remote_state = heads[-1]["producer"]
    # The rows the rollout processes' draws skipped so far (`data/skipped/<reason>`).
    self.parts.source.skipped.update(heads[-1]["skipped"])
    info["pipeline/generated_from"] = min(h["started_at"] for h in heads)
    info["pipeline/generated_to"] = max(h["finished_at"] for h in heads)
    info.update(made)
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
  (`first`..`last`, set by `start`; `versions`: how, a `Versions`), then tells them. With each
  version the first train process assigns the batches it lets start (`Receiver.plan`)."""

  def __init__(self, versions: Versions, channel: bridge_lib.Channel, main: bool,
               receiver: Receiver | None = None):
    self.versions, self.channel, self.main, self.receiver = versions, channel, main, receiver
    self.first, self.last = 0, -1
    self.batches, self.lag = range(0), 0
    versions.serve()

  def start(self, first_batch: int, last_batch: int, lag: int, producer: dict | None) -> None:
    """Tells the rollout process which batches to make (and from which producer state)."""
    self.first = params_version(first_batch, lag)
    self.last = params_version(last_batch, lag) if last_batch >= first_batch else -1
    self.batches, self.lag = range(first_batch, last_batch + 1), lag
    if self.main:
      self.channel.set("start", json.dumps({"first_batch": first_batch, "last_batch": last_batch,
                                            "producer": producer}))

  def __call__(self, version: int, params) -> None:
    if self._plan(version):
      self.versions.send(version, params)
    return None

  def replay(self, version: int, data: bytes) -> None:
    """Serves `version` again as this process served it before (`served`), e.g. from a
    checkpoint of a ring that was not full (`LagPipeline.republish`)."""
    if self._plan(version):
      self.versions.server.publish(version, data)

  def served(self, version: int) -> bytes | None:
    """What this process served as `version`, while it still serves it."""
    return self.versions.server.get(version)

  def _plan(self, version: int) -> bool:
    """Whether `version` is one the rollout processes ask for; if so the first train process
    assigns the batches it lets start (`Receiver.plan`)."""
    if not self.first <= version <= self.last:
      return False
    if self.main and self.receiver is not None:
      for b in range(version if version else self.batches.start, version + self.lag + 1):
        if b in self.batches and params_version(b, self.lag) == version:
          self.receiver.plan(b)
    return True

  def done(self) -> None:
    if self.main:
      self.channel.set("done", "1")
    self.versions.close()
