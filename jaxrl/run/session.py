"""What every process of a run opens before its entry's work and closes after it, whatever happens
(`Session`): the topology, the run's parts, the console, the run directory's lock, the decision of
how the run starts, and the checkpointer. Both entries use it: the training run
(`jaxrl.run.driver.run`) and a rollout process's (`jaxrl.run.actor.run`)."""

from __future__ import annotations

import os

import jax
from jax.experimental import multihost_utils

from jaxrl import parallel
from jaxrl.config import MeshShape
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import directory as run_dir_lib
from jaxrl.run.parts import build_parts
from jaxrl.run.topology import Topology
from jaxrl.runtime import checkpoint


class Session:
  """One run's shared set-up (see the module docstring), as a context manager.

  Every process builds the parts (the data, model files and tokenizer are checked, and the model
  built, before anything is written); only the process that writes (`main`) takes the run
  directory's lock (`jaxrl.run.directory`: one run per directory) and prints. `start` is how the
  run starts (`run_dir.decide`); `ckpt` the checkpointer on `<run_dir>/checkpoints`. The trainer
  adds what it opens later (`out`, the metrics writer; `reader`, a checkpointer on another run's
  directory) and the session closes those too.
  """

  def __init__(self, cfg, run_dir: str, mesh_shape: MeshShape):
    self.cfg, self.run_dir, self.mesh_shape = cfg, run_dir, mesh_shape
    self.ckpt = self.out = self.reader = self.quiet = self.lock = None

  def __enter__(self) -> "Session":
    cfg = self.cfg
    self.topology = Topology.build(self.mesh_shape)
    self.topology.begin()
    self.main = parallel.distributed.is_main()
    self.parts, self.params = build_parts(cfg, self.mesh_shape)
    self.quiet = None if self.main else open(os.devnull, "w")
    self.progress = metrics_lib.Progress(stream=self.quiet, every=cfg.log_every)
    self.lock = run_dir_lib.RunDirLock(self.run_dir).acquire() if self.main else None
    try:
      self.start = run_dir_lib.decide(cfg, self.run_dir, self.progress.say, write=self.main)
      # Process 0 has moved a previous run aside. Where the run goes on without a rollout
      # process, that process runs no program with the others (`distributed.own_devices_only`),
      # so all wait in the store; and the same command started again for one (a rejoin) comes
      # after the others passed this point.
      if self.topology.failover:
        if not getattr(parallel.peers.WATCH, "rejoined", False):
          parallel.distributed.store_barrier("jaxrl-run-dir")
      elif jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxrl-run-dir")
      self.own_dir = checkpoint.checkpoint_dir(self.run_dir)
      # A rollout process holds nothing to checkpoint; it takes part in the mirrored ones.
      if not (self.topology.generates_only and self.topology.failover):
        self.ckpt = checkpoint.Checkpointer(self.own_dir, keep=cfg.checkpoint.keep,
                                            async_save=cfg.checkpoint.async_save,
                                            processes=self.topology.checkpoint_processes)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    reader = None if self.reader is self.ckpt else self.reader
    for closing in (self.ckpt, reader, self.out, self.quiet):
      if closing is not None:
        closing.close()
    if self.lock is not None:
      self.lock.release()
    self.ckpt = self.out = self.reader = self.quiet = self.lock = None
