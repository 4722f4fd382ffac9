"""A rollout process of a run disaggregated across processes (`mesh.rollout_processes`): its own
entry, `run`, instead of the training run's.

It only generates. A receiver thread fetches every params version the train side publishes
(`jaxrl.pipeline.remote.Versions`, over TCP from each train process, in version order), and its main thread makes batches 0, 1, 2, ... with the forced-lag version of each,
`params_version(b, L)`, on its own devices, exactly as the one-process `RolloutProducer` does (the
same prompt stream, request ids, group ids, dynamic sampling), then sends each batch's rows to the
train side (`jaxrl.pipeline.remote` has the messages). With K rollout processes, process k makes
the k-th run of P / K whole groups of every batch (`remote.rollout_share`). It never waits for a
train step it does not need: it starts batch b as soon as version b - L is published. With
partial rollouts a batch switches, between decode dispatches, to the newest version joined. It
holds nothing a checkpoint needs (the producer state it resumes from travels with every batch's
rows): where process 0 trains, the train processes checkpoint alone; where process 0 generates,
it takes part in every checkpoint the train side saves (`jaxrl.runtime.mirror`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import jax
import numpy as np

from jaxrl import parallel
from jaxrl.observe import metrics as metrics_lib
from jaxrl.parallel import bridge as bridge_lib
from jaxrl.parallel.sides import rollout_rank, train_processes
from jaxrl.pipeline.handoff import ParamsHandoff, VersionUnavailable
from jaxrl.pipeline.producer import LocalRows, RolloutProducer, part_json
from jaxrl.pipeline.remote import Versions, rollout_share, run_channel
from jaxrl.pipeline.worker import params_version
from jaxrl.run.session import Session
from jaxrl.runtime.mirror import serve_checkpoints


def run(cfg, run_dir: str, mesh_shape, stop=None, started: float | None = None) -> dict:
  """A rollout process's whole run; returns a summary of what it made. `stop()` true (a signal)
  is told to the train side, which decides when the run stops."""
  del started
  with Session(cfg, run_dir, mesh_shape) as s:
    union = None if s.ckpt is None else s.topology.union()
    inner, s.ckpt = s.ckpt, None  # serve's checkpoint thread closes it when the train side does
    # It generates with the versions it receives only: its own starting params are a template
    # (shapes and dtypes), their device memory freed here, and a distillation teacher (the
    # train step's) is dropped.
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s.params)
    s.params = None
    parts = dataclasses.replace(s.parts, teacher=None)
    return serve(parts, params, mesh_shape, s.progress, stop, ckpt=inner, union=union)


def serve(parts, params, mesh_shape, progress: metrics_lib.Progress, stop=None, *,
          ckpt=None, union=None) -> dict:
  """The rollout process's whole run (module docstring); returns a summary of what it made.
  `params`: the starting params or their shapes (the template of every version it receives).
  `ckpt` (a `Checkpointer` on the run's checkpoint directory) and `union` (`union_mesh`): the
  mirrored checkpoints it takes part in where process 0 generates (`serve_checkpoints`, on a
  thread of its own) until the train side closes them; None where the train processes
  checkpoint alone."""
  stop = stop or (lambda: False)
  channel = run_channel()
  versions = Versions(parts, mesh_shape, params, channel)
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
  # Printed, not said: a rollout process's progress lines are quiet, this one is its report.
  print(f"jaxrl | rollout process {jax.process_index()}: {versions.received()}", flush=True)
  while saver is not None and saver.is_alive():  # until the train side closes its checkpoints
    saver.join(0.5)
  return made


class _Parts:
  """Makes the parts of batches a rollout process is assigned (`make`) and, between batches,
  those of a dropped process it is given to make again (`redo`: `redo/<process>/<n>`, for a
  batch it has made its own part of already, so it goes back to that batch's prompt stream
  state and version; `jaxrl.pipeline.remote.Receiver`)."""

  def __init__(self, parts, mesh_shape, producer, channel, versions, handoff, should_stop):
    self.parts, self.producer, self.channel = parts, producer, channel
    self.versions, self.handoff, self.should_stop = versions, handoff, should_stop
    self.shares = [rollout_share(parts, mesh_shape, k)
                   for k in range(len(mesh_shape.rollout_processes))]
    self.trainers = train_processes(mesh_shape)
    self.me, self.lag = jax.process_index(), parts.cfg.rollout.lag
    self.before: dict[int, dict] = {}  # batch -> the prompt stream's state before it
    self.taken = 0  # the redo messages taken so far
    self.pending: list[tuple[int, int]] = []  # (batch, part) to redo once the batch is reached
    self.redone = 0

  def reach(self, b: int) -> None:
    """Batch b is next: the state before it is kept (for the last L + 2 batches: the train
    side has every older one), and said (`state/<b>`) for a rollout process that joins again."""
    self.before[b] = self.producer.state_dict()
    self.channel.set(f"state/{b}", json.dumps(self.before[b]))
    for old in [a for a in self.before if a < b - self.lag - 2]:
      del self.before[old]

  def make(self, b: int, k: int, p, v: int) -> None:
    """Part k of batch b with params `p` (version v), from the state before b."""
    producer, data_plane, fields = self.producer, self.parts.data, self.producer.fields
    producer.load_state_dict(self.before[b])
    producer.share = self.shares[k]
    started = time.time()
    item = producer.produce(b, p, v)
    if item.local is None:  # one rollout process: the whole batch, in its data plane
      arrays = {f: np.asarray(x) for f, x in data_plane.get(item.meta, fields).items()}
      data_plane.discard(item.meta)
      item = dataclasses.replace(item, local=LocalRows(arrays, {}, item.counts))
    head = {**part_json(item), "submit_version": item.submit_version, "process": self.me,
            "part": k, "producer": producer.state_dict(),
            "skipped": dict(self.parts.source.skipped), "started_at": started,
            "finished_at": time.time()}
    data = bridge_lib.pack({f: item.local.arrays[f] for f in fields}, head)
    for q in self.trainers:
      self.channel.put_bytes(f"rows/{b}/{k}/{q}", data)

  def redo(self) -> None:
    """The parts given to this process to make again, of the batches it has reached (a later
    one's wait until it gets there)."""
    while self.channel.has(f"redo/{self.me}/{self.taken}"):
      job = json.loads(self.channel.wait(f"redo/{self.me}/{self.taken}"))
      self.taken += 1
      self.pending.append((job["batch"], job["part"]))
    for b, k in [job for job in self.pending if job[0] in self.before]:
      self.pending.remove((b, k))
      v = params_version(b, self.lag)
      try:
        p = self.handoff.get(v, timeout=0)
      except (TimeoutError, VersionUnavailable):  # pruned: fetch it again
        p = self.versions.receive(v, self.should_stop)
      after = self.producer.state_dict()
      self.make(b, k, p, v)
      self.producer.load_state_dict(after)
      self.redone += 1


def _generate(parts, mesh_shape, progress, channel, versions: Versions, should_stop, failure,
              ended) -> dict:
  """`serve`'s batches: a receiver thread fetches each params version, this one makes the parts
  of each batch the train side assigns it (`assign/<b>`) and those it is given to make again
  (`_Parts`)."""
  r = parts.cfg.rollout
  start = json.loads(channel.wait("start", should_stop))
  first, last = start["first_batch"], start["last_batch"]
  # Partial rollouts: a batch starts on its forced-lag version and switches, between decode
  # dispatches, to the newest one the receiver thread has joined.
  handoff = ParamsHandoff()
  producer = RolloutProducer(parts, parts.train_loop(handoff.latest if r.partial_rollouts
                                                     else None), rollout_share(parts, mesh_shape))
  watch = parallel.peers.WATCH
  if watch is not None and watch.rejoined:  # started again: from where the train side says
    me = jax.process_index()
    first = json.loads(channel.wait(f"rejoin/{me}/{watch.token}", should_stop))["first_batch"]
    if first <= last:
      start["producer"] = json.loads(channel.wait(f"state/{first}", should_stop))
    progress.say(f"rollout process {me} joins the run again from batch {first}")
  if start["producer"] is not None:
    producer.load_state_dict(start["producer"])
  wanted = range(params_version(first, r.lag), params_version(last, r.lag) + 1) \
      if last >= first else range(0)

  def receive() -> None:  # fetches each version from the train processes (`Versions`)
    try:
      for v in wanted:
        handoff.publish(v, versions.receive(v, should_stop))
    except bridge_lib.ChannelClosed:
      pass
    except BaseException as e:  # noqa: BLE001  (reported by the main thread)
      failure.append(e)

  receiver = threading.Thread(target=receive, name="params-receiver", daemon=True)
  receiver.start()
  maker = _Parts(parts, mesh_shape, producer, channel, versions, handoff, should_stop)
  me, batches = maker.me, 0
  progress.say(f"rollout process {me}: making batches {first}..{last} for "
               f"train processes {list(maker.trainers)} (lag {r.lag})")

  def params_for(v: int):
    while True:
      if failure:
        raise failure[0]
      maker.redo()
      try:
        return handoff.get(v, timeout=0.2)
      except TimeoutError:
        if failure:  # e.g. the train side is gone
          raise failure[0] from None
        if should_stop():
          return None

  def summary(stopped: bool) -> dict:
    return {"rollout/batches": batches, "rollout/parts_redone": maker.redone,
            "rollout/stopped": stopped}

  try:
    for b in range(first, last + 1):
      v = params_version(b, r.lag)
      p = params_for(v)
      if p is None:
        return summary(True)
      handoff.prune_below(v)
      maker.reach(b)
      assign = json.loads(channel.wait(f"assign/{b}", should_stop))
      mine = sorted(int(k) for k, q in assign.items() if q == me)
      for k in mine:
        maker.make(b, k, p, v)
      maker.redo()
      if not mine:  # a live process always makes its own part: this one was dropped (hung)
        progress.say(f"rollout process {me}: assigned nothing of batch {b}: the train side "
                     "dropped this process; stopping")
        return summary(True)
      batches += 1
    while not should_stop():
      maker.redo()
      time.sleep(0.2)
  except bridge_lib.ChannelClosed:
    return summary(True)
  finally:
    ended.set()
    receiver.join(timeout=30)
  return summary(False)
