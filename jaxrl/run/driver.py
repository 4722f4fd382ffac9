"""The training run: build the parts from a validated config, warm up, train with GRPO, report.

`run(cfg, run_dir, mesh_shape)` is what `python -m jaxrl.train` calls on a process that trains
(a rollout process of a run disaggregated across processes runs `jaxrl.run.actor.run`
instead; `jaxrl.cli.train` picks). Phases:

1. supervised warm-up on task demonstrations (`jaxrl.run.warmup`), stopped at the first `dev`
   greedy accuracy >= `sft.stop_accuracy`;
2. GRPO for `train.steps` steps with a fresh optimizer (`jaxrl.run.loop`);
3. held-out accuracy on `val` before RL, every `val.every` steps and at the end
   (`jaxrl.run.validation`).

Where the rest lives: what a run is built from in `jaxrl.run.parts`, where rollouts run and how
params reach them in `jaxrl.run.topology`, the RL step in `jaxrl.learner.rl`, batches in
`jaxrl.pipeline.producer`, checkpointed loop state in `jaxrl.run.state`.
"""

from __future__ import annotations

import json
import os

import jax

from jaxrl import config as config_lib
from jaxrl.config import memory
from jaxrl.config.schema import flatten
from jaxrl.learner.rl import CompileAhead
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import directory as run_dir_lib
from jaxrl.run.loop import LoopStart, RLStep, RunIO, TrainingHalted, rl  # noqa: F401
from jaxrl.run.state import LoopState
from jaxrl.run.session import Session
from jaxrl.run.warmup import warmup
from jaxrl.runtime import checkpoint


def run(cfg, run_dir: str, mesh_shape: config_lib.MeshShape, stop=None,
        started: float | None = None) -> dict:
  """Runs warm-up and RL; writes config.json, metrics.jsonl, curves.png, summary.json, and
  checkpoints under `<run_dir>/checkpoints`.

  The data, model files and tokenizer are checked (and the model built) before anything is
  written (`Session`). The run then owns `run_dir` and decides how it starts (`run_dir.decide`):
  from a checkpoint (`resume`: auto | none | a path or one step of it; the newest usable one,
  checked against the config), its own checkpoint's metrics.jsonl cut back to the lines written
  when it was saved, so the resumed run continues the file exactly; or fresh, a previous run
  moved aside. config.json is written only then. With several processes every process runs this
  whole function (the same computations in the same order); only process 0 prints and writes
  files. `stop()` true (a signal) makes the run checkpoint and return early with
  `rl/stopped_at` set.
  """
  total = metrics_lib.Timer()
  with Session(cfg, run_dir, mesh_shape) as s:
    s.ckpt = s.topology.checkpointer(s.ckpt, s.main)
    if s.main:
      _write_run_files(cfg, run_dir)
    _announce(s, cfg, mesh_shape)
    # One process: compile the RL step while the warm-up runs (several processes compile in
    # lockstep on the main thread, as they launch everything else).
    step = RLStep.build(s.parts, s.params)
    if jax.process_count() == 1:
      step.ahead = CompileAhead(s.parts, (step.fn, step.init_state), s.params)
    try:
      summary = _phases(s, cfg, RunIO(None, s.progress, s.ckpt, stop or (lambda: False),
                                      run_dir if s.main else None, started, s.main), step)
    finally:
      # A run that ends before its first update (an error, a signal) still has the compile on
      # its thread: the interpreter must not exit under it (a thread inside XLA at exit aborts
      # the process).
      if step.ahead is not None:
        step.ahead.wait()
    if summary.get("sft/stopped"):
      return summary
    if summary["rl/stopped_at"] is not None:
      s.progress.say(f"stopped by signal after step {summary['rl/stopped_at']}: checkpoint "
                     f"saved in {s.own_dir}; continue with --config.run_dir={run_dir} "
                     "(resume=auto)")
      return summary
    summary["val/rl_gain"] = summary["val/accuracy_after_rl"] - summary["val/accuracy_before_rl"]
    summary["total_time_s"] = total()
    s.out.write({"phase": "summary", **summary})
    rows = s.out.rows
  if s.main:
    metrics_lib.finish(run_dir, summary, rows, f"jaxrl {cfg.name}: GRPO on {cfg.task.name}",
                       s.progress)
  return summary


def _write_run_files(cfg, run_dir: str) -> None:
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(cfg), f, indent=2)
  if cfg.model.hf_path:
    # What `python -m jaxrl.export` needs besides the weights, kept with the run so the export
    # does not depend on the starting directory still being there.
    run_dir_lib.copy_metadata(cfg.model.hf_path, os.path.join(run_dir, run_dir_lib.METADATA_DIR))


def _announce(s: Session, cfg, mesh_shape) -> None:
  n_params = sum(x.size for x in jax.tree.leaves(s.params))
  s.progress.say(f"jaxrl | run dir {s.run_dir} | task {cfg.task.name} | model {n_params:,} "
                 f"params | mesh {mesh_shape.data}x{mesh_shape.fsdp}x{mesh_shape.tensor} on "
                 f"{jax.devices()[0].platform}")
  # The memory plan that validation checked against the device (`jaxrl.config.memory`).
  inputs = memory.inputs_from_config(flatten(cfg), mesh_shape, jax.default_backend(),
                                     jax.process_count(), vocab=s.parts.model_cfg.vocab_size)
  if inputs is not None:
    s.progress.say(memory.plan_memory(inputs).render())
  if s.parts.teacher is not None:
    d = cfg.distill
    s.progress.say(f"distillation: teacher {s.parts.teacher.source}, coef {d.coef}, task reward "
                   f"weight {d.reward_weight}")
  note = s.parts.source.note()  # rows the checks up front skip (data.max_skipped_frac)
  if note:
    s.progress.say(note)


def _phases(s: Session, cfg, io: RunIO, step: RLStep) -> dict:
  """Warm-up (or the restore of a checkpoint) and RL; a checkpoint the restore finds unreadable
  is passed over for the one before it. Returns the run's summary."""
  start, params, unreadable = s.start, s.params, set()
  while True:
    s.out = io.out = metrics_lib.MetricsWriter(s.run_dir if s.main else None,
                                               keep_lines=start.keep_lines, cfg=cfg)
    loop_start = _loop_start(s, start)
    if loop_start.resume is None:
      params, warm = warmup(s.parts, params, io.out, io.progress, io.stop)
      if warm.get("sft/stopped"):
        return warm
      loop_start.warmup = warm
    try:
      params, rl_summary = rl(s.parts, params, s.topology, io, start=loop_start, step=step)
      break
    except checkpoint.UnreadableStep as e:  # found by the restore: try the one before it
      io.progress.say(f"jaxrl: {e}; trying the one before it")
      # That step and the newer ones (reported when it was chosen) are passed over silently.
      unreadable.update(x for x in checkpoint.complete_steps(e.directory) if x >= e.step)
      s.out.close()
      start = run_dir_lib.decide(cfg, s.run_dir, io.progress.say, unreadable, write=False)
  summary = {**loop_start.warmup, **rl_summary}
  if loop_start.resume is not None:  # this process did not warm up: not in total_time_s
    summary = {k: v for k, v in summary.items() if k != "sft/time_s"}
    summary["resumed_from_step"] = loop_start.resume[1]
  return summary


def _loop_start(s: Session, start) -> LoopStart:
  """Fresh (the warm-up's summary is filled in after it), or the checkpoint to restore."""
  if start.resume is None:
    return LoopStart()
  directory, step, host = start.resume
  same = os.path.abspath(directory) == os.path.abspath(s.own_dir)
  if s.topology.across and not same:
    raise config_lib.ConfigError([
        f"{config_lib.PREFIX}resume: with {config_lib.PREFIX}mesh.rollout_processes a run "
        f"resumes from its own checkpoints only, got {directory}"])
  s.reader = s.ckpt if same else checkpoint.Checkpointer(directory, read_only=True)
  return LoopStart(LoopState.restore_warmup(host), (s.reader, step, host))
