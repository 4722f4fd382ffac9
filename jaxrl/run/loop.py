"""The RL loop: pull a batch, train on it, publish the new params, log, maybe evaluate or save.

`rl(parts, params, topology, io)` runs GRPO for `train.steps` steps from `params`. Where the
rollouts run and how each params version reaches them is the topology's (`jaxrl.run.topology`):
the loop sees one producer, one publisher and one lag pipeline whatever the layout. The lag
pipeline (`jaxrl.pipeline.LagPipeline`, `rollout.lag`, 0 = synchronous) feeds it batches made on
the rollout worker's thread (or inline, or on other processes), and evaluation passes run on a
thread of their own while training goes on (`val.asynchronous`, one process).

Checkpoints (`io.ckpt`, every `checkpoint.every` steps, at the end, on a stop signal and when
`train.max_skipped_updates` halts the run) hold the train state, the lag pipeline and the
`LoopState`, so a run resumed from one (`LoopStart.resume`) continues exactly as if it had not
stopped. Before a save every evaluation pass in flight is finished and logged and the rollout
worker is left idle with the ring full.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax

from jaxrl import parallel
from jaxrl.core.errors import StopWithCheckpoint, UserError
from jaxrl.core.names import AUTO_LAG
from jaxrl.core.types import TrainBatch
from jaxrl.learner.rl import CompileAhead, build_rl_step
from jaxrl.learner.step import model_params
from jaxrl.models import lora as lora_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl.observe import profiling
from jaxrl.observe.rows import step_row
from jaxrl.pipeline import LagPipeline, ParamsHandoff
from jaxrl.pipeline.gate import WorkerFailed
from jaxrl.pipeline.producer import train_fields
from jaxrl.pipeline.tuner import LagTuner
from jaxrl.run import directory as run_dir_lib
from jaxrl.run.state import LoopState
from jaxrl.run.validation import Evaluator


class TrainingHalted(RuntimeError):
  """The run stopped itself (e.g. `train.max_skipped_updates`) after saving a checkpoint."""


class BatchLayoutError(UserError, RuntimeError):
  """A train batch whose rows are not in groups of one prompt (`train.share_prompts`)."""


@dataclasses.dataclass
class RunIO:
  """Where a phase reports and what stops it."""
  out: metrics_lib.MetricsWriter
  progress: metrics_lib.Progress
  ckpt: object = None  # a `Checkpointer` (None: no checkpoints)
  stop: Callable[[], bool] = lambda: False  # a signal asked the run to checkpoint and stop
  run_dir: str | None = None  # where `profile.steps` writes its trace (None: no trace)
  started: float | None = None  # `time.monotonic()` at the process's start: time to first step
  main: bool = True  # this process writes the run's files and messages


@dataclasses.dataclass
class RLStep:
  """The jitted RL train step and its state initialiser (`build_rl_step`); `ahead`, a
  `CompileAhead` compiling it, is waited for before the first update; `on_batch(step, batch) ->
  batch` sees (and may replace) every train batch just before its step: a seam for fault
  injection and debugging."""
  fn: Callable
  init_state: Callable
  ahead: CompileAhead | None = None
  on_batch: Callable[[int, TrainBatch], TrainBatch] | None = None

  @classmethod
  def build(cls, parts, params, **kwargs) -> "RLStep":
    return cls(*build_rl_step(parts, params), **kwargs)


@dataclasses.dataclass
class LoopStart:
  """How the loop starts: the warm-up's summary (kept in every checkpoint) and, to resume,
  `(reader, step, host)` of the checkpoint to restore."""
  warmup: dict = dataclasses.field(default_factory=dict)
  resume: tuple | None = None


def rl(parts, params, topology, io: RunIO, *, start: LoopStart | None = None,
       step: RLStep | None = None) -> tuple[object, dict]:
  """GRPO for `train.steps` steps from `params` (see the module docstring); returns the final
  params and the summary. `topology` gives the producer and publisher (`Topology.feed`)."""
  cfg, start = parts.cfg, start or LoopStart()
  r, v = cfg.rollout, cfg.val
  step = step or RLStep.build(parts, params)
  handoff = ParamsHandoff()  # partial rollouts read its newest version while decoding
  feed = topology.feed(parts, params, handoff, io.main)
  state = step.init_state(params)
  lag = LagTuner(r.max_lag, r.lag_every) if r.lag == AUTO_LAG else r.lag
  pipe = LagPipeline(feed.producer, lag, stall_timeout_s=r.stall_timeout_s, inline=feed.inline,
                     publisher=feed.publisher, handoff=handoff, say=io.progress.say,
                     turns=feed.turns)
  # Its passes run on threads named jaxrl-validation-<step> (benchmarks/soak.py counts them).
  evaluator = Evaluator(parts, asynchronous=v.asynchronous and feed.asynchronous_eval,
                        max_wait_s=v.max_wait_s, name="jaxrl-validation")
  loop = LoopState(warmup=dict(start.warmup), config=run_dir_lib.checkpoint_config(cfg))
  if start.resume is not None:
    reader, at, host = start.resume
    state, loop = LoopState.restore(reader, at, host, state, pipe)
    io.progress.say(f"resumed from step {at} ({reader.directory})")
  run = _Steps(parts, io, feed, pipe, evaluator, step, state, loop,
               profiling.StepPerf(parts, params, io.run_dir))
  try:
    feed.publisher.start(pipe.next_batch())
    run.announce(topology)
    pipe.republish()  # the older versions a checkpoint of a ring not full kept (else nothing)
    published = pipe.publish(loop.step, model_params(run.state))
    if loop.step == 0 and v.at_start:
      evaluator.submit(0, feed.eval_params(published, model_params(run.state)))
    with pipe:
      for t in range(loop.step + 1, cfg.train.steps + 1):
        if run.step(t):
          break
    if run.stopped_at is None:
      run.log_evaluations(evaluator.wait())
  finally:
    feed.publisher.close()
    run.perf.close()
    evaluator.close()
    parts.data.clear("train")  # batches still in the ring when the run ends or fails
  io.progress.newline()
  return model_params(run.state), run.summary()


def _lag_text(r, pipe: LagPipeline) -> str:
  """`r.lag`, or for `auto` its range and the lag of the next batch: the starting lag on a fresh
  run, the lag in force (restored from the checkpoint's schedule) on a resumed one."""
  if r.lag != AUTO_LAG:
    return str(r.lag)
  nxt = pipe.gate.checkpoint_state()["consumed"]  # the batch the next step trains on
  now = pipe.gate.lag_of(nxt)
  where = f"starting at {now}" if nxt == 0 else f"resuming at lag {now} from step {nxt + 1}"
  return f"auto (0..{r.max_lag}, {where}, decided every {r.lag_every} steps)"


class _Steps:
  """What one RL step does, after `rl` has set the run up."""

  def __init__(self, parts, io: RunIO, feed, pipe: LagPipeline, evaluator: Evaluator,
               step: RLStep, state, loop: LoopState, perf: profiling.StepPerf):
    self.parts, self.io, self.feed, self.pipe, self.evaluator = parts, io, feed, pipe, evaluator
    self.rl_step, self.state, self.loop, self.perf = step, state, loop, perf
    self.fields = train_fields(parts.cfg, parts.model_cfg)
    self.stop = feed.stop(io.stop)
    self.timer = metrics_lib.Timer()
    self.stopped_at = self.first_step_s = None
    self.train_span: dict = {}  # the last update's wall-clock span (perf/train_from, _to)

  def announce(self, topology) -> None:
    cfg, say = self.parts.cfg, self.io.progress.say
    r, lora = cfg.rollout, self.feed.lora
    where = topology.describe(self.parts, self.feed)
    if where:
      say(where)
    ds = " with dynamic sampling" if cfg.dynamic_sampling.enabled else ""
    say(f"RL: {cfg.train.steps} GRPO steps of {r.num_prompts} prompts x {r.group_size} samples, "
        f"lag {_lag_text(r, self.pipe)}{ds}")
    if lora is not None:
      trained, total = lora_lib.counts(model_params(self.state))
      opt_values = sum(int(x.size) for x in jax.tree.leaves(self.state.opt_state))
      say(f"LoRA rank {lora.lora_rank} (alpha {lora.lora_alpha:g}) on "
          f"{','.join(lora.lora_targets)}: {trained:,} trained params of {trained + total:,} "
          f"({100 * trained / (trained + total):.2f}%), optimizer state {opt_values:,} values, "
          "base frozen")

  def train(self, t: int, item) -> dict:
    """Step `t`'s update on `item`'s rows; returns the step's metrics on the host."""
    arrays = self.parts.data.get(item.meta, self.fields)
    batch = TrainBatch(**{f: arrays.get(f) for f in TrainBatch._fields})
    if self.rl_step.on_batch is not None:
      batch = self.rl_step.on_batch(t, batch)
    if self.rl_step.ahead is not None:
      self.rl_step.ahead.wait()
      self.rl_step.ahead = None
    train_from = time.time()
    self.state, m = self.rl_step.fn(self.state, batch)
    m = parallel.distributed.fetch(m)
    self.train_span = {"perf/train_from": train_from, "perf/train_to": time.time()}
    self.perf.lap("train")
    if self.first_step_s is None and self.io.started is not None:
      self.first_step_s = time.monotonic() - self.io.started
      cache = jax.config.jax_compilation_cache_dir
      self.io.progress.say(f"first RL step done {self.first_step_s:.1f} s after start "
                           f"(compilation cache: {cache or 'off'})")
    self.parts.data.discard(item.meta)  # the step consumed these rows
    self.loop.step = t
    if int(m["prompt_layout_errors"]):
      raise BatchLayoutError(f"step {t}: the train batch's rows are not in groups of "
                             f"{self.parts.cfg.rollout.group_size} with one prompt each; the "
                             "update was not applied (set train.share_prompts=false to train it "
                             "row by row)")
    self.loop.count_skipped(int(m["skipped_nonfinite"]))
    return m

  def step(self, t: int) -> bool:
    """RL step `t`, whole; True when the run stops after it (a signal)."""
    cfg = self.parts.cfg
    self.perf.begin(t)
    batch_id, item = self.pull()
    self.perf.lap("wait")
    m = self.train(t, item)
    published = self.pipe.publish(t, model_params(self.state))
    self.perf.lap("publish")
    if t % cfg.val.every == 0 or (cfg.val.at_end and t == cfg.train.steps):
      self.evaluator.submit(t, self.feed.eval_params(published, model_params(self.state)))
    evaluations = self.evaluator.poll()
    self.perf.lap("val")
    row = step_row(self.parts, t, batch_id, item, m, {
        "train/skipped_updates": self.loop.skipped_updates,
        **{f"pipeline/{k}": x for k, x in self.pipe.stats().items()},
        "val/trainer_wait_s": self.evaluator.wait_s,
        **self.perf.metrics(item), **self.train_span, "perf/elapsed_s": self.timer()})
    self.io.out.write(row)
    self.log_evaluations(evaluations)
    acc = self.loop.val_accuracy
    self.io.progress.update(t, cfg.train.steps, metrics_lib.rl_progress_text(
        row, acc[max(acc)] if acc else None, skipped_prompts=self.parts.source.draws.total))
    return self.after(t)

  def pull(self):
    """The next batch; a worker failure that leaves the trained state whole (every rollout
    process lost: `StopWithCheckpoint`) first checkpoints the last completed step, the ring as
    it is, and the failure names that step (none before the first: the rerun starts over)."""
    try:
      return self.pipe.pull()
    except WorkerFailed as e:
      cause = e.__cause__
      if isinstance(cause, StopWithCheckpoint) and self.loop.step > 0 and \
          self.save(partial=True):
        cause.saved(self.loop.step)
      raise

  def after(self, t: int) -> bool:
    """Checkpoint and stop decisions after step `t`."""
    c, steps = self.parts.cfg.checkpoint, self.parts.cfg.train.steps
    if self.io.ckpt is not None:
      self.io.ckpt.check()  # a failed background save stops the run now, not at the next save
    halt = self.loop.halt_reason(self.parts.cfg.train)
    # One decision per step, the same on every process (a signal may have reached only one of
    # them: a preempted host): all checkpoint this step and stop.
    stopping = parallel.distributed.any_process(self.stop())
    if (c.every and t % c.every == 0) or t == steps or stopping or halt:
      self.save()
    if halt:
      raise TrainingHalted(f"{halt}; checkpoint of step {t} saved. Check the rewards, the "
                           "sampling temperature and the learning rate, then resume.")
    if stopping:
      self.stopped_at = t
    return stopping

  def log_evaluations(self, results) -> None:
    for vstep, m in results:
      self.loop.val_accuracy[vstep] = m["val/accuracy"]
      self.io.out.write({"phase": "val", "step": vstep, **m})

  def save(self, partial: bool = False) -> bool:
    """Checkpoints the last completed step (`partial`: `LoopState.save`); whether it is."""
    if self.io.ckpt is None:
      return False
    self.log_evaluations(self.evaluator.wait())  # every pass up to this step is logged first
    self.loop.metrics_lines = len(self.io.out.rows)
    return self.loop.save(self.io.ckpt, self.state, self.pipe, partial)

  def summary(self) -> dict:
    acc = self.loop.val_accuracy
    return {"val/accuracy_before_rl": acc.get(0, float("nan")),
            "val/accuracy_after_rl": acc[max(acc)] if acc else float("nan"),
            "rl/time_s": self.timer(), "rl/steps": self.parts.cfg.train.steps,
            "rl/stopped_at": self.stopped_at, "train/skipped_updates": self.loop.skipped_updates,
            **({} if self.first_step_s is None else {"perf/first_rl_step_s": self.first_step_s})}
