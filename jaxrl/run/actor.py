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
takes part in every checkpoint the train side saves (`jaxrl.runtime.mirror`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import jax
import numpy as np

from jaxrl.observe import metrics as metrics_lib
from jaxrl.parallel import bridge as bridge_lib
from jaxrl.parallel.sides import rollout_rank, train_processes
from jaxrl.pipeline.handoff import ParamsHandoff
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
    union = s.topology.union()
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
  checkpoints it takes part in (`serve_checkpoints`, on a thread of its own) until the train side
  closes them."""
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
