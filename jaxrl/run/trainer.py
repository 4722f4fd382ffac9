"""The run: build the parts from a validated config, warm up, train with GRPO, report.

`run(cfg, run_dir, mesh_shape)` is what `python -m jaxrl.train` calls after validating the
config. Phases:

1. supervised warm-up on task demonstrations, stopped at the first `dev` greedy accuracy
   >= `sft.stop_accuracy` (so RL starts with headroom; the stop is on a split never reported);
2. GRPO for `train.steps` steps with a fresh optimizer: P prompts x G samples, exact-match
   reward, group-normalised advantages, the loss composed from `loss.*`; the lag pipeline
   (`jaxrl.pipeline.LagPipeline`, `rollout.lag`, 0 = synchronous) feeds it batches made by the
   rollout producer on its own thread, which with `dynamic_sampling.enabled` drops groups without
   reward variance while keeping every batch at P whole groups;
3. held-out accuracy on `val` before RL, every `val.every` steps and at the end
   (`jaxrl.run.validation`, generated on a thread while training goes on, `val.asynchronous`).

Where the rest lives: what a run is built from in `jaxrl.run.parts`, the RL step in `jaxrl.learner.rl`,
batches in `jaxrl.pipeline.producer`, checkpointed loop state in `jaxrl.run.loop_state`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from jaxrl.runtime import checkpoint

from jaxrl.cli import export
from jaxrl import config as config_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl import parallel
from jaxrl.observe import profiling
from jaxrl.run import run_dir as run_dir_lib
from jaxrl.run import warmup_cache
from jaxrl.run.validation import Evaluator
from jaxrl.run.loop_state import LoopState
from jaxrl.models import lora as lora_lib
from jaxrl.run.parts import Parts, build_parts
from jaxrl.pipeline import LagPipeline, ParamsHandoff
from jaxrl.pipeline.dynamic_sampling import finite_mean
from jaxrl.pipeline import remote
from jaxrl.pipeline.producer import RingItem, RolloutProducer, process_share, train_fields
from jaxrl.pipeline.staleness import staleness_from_rows
from jaxrl.learner.rl import CompileAhead, build_rl_step, logprob_impl, lora_model
from jaxrl.rollout.precision import rollout_dtype
from jaxrl.run.signals import Stop  # noqa: F401  (python -m jaxrl.train installs it)
from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer, model_params, to_rows
from jaxrl.core.types import TrainBatch


class TrainingHalted(RuntimeError):
  """The run stopped itself (e.g. `train.max_skipped_updates`) after saving a checkpoint."""


def warmup(parts: Parts, params, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress,
           stop=None) -> tuple[object, dict]:
  """Supervised warm-up from `params`; returns `(params, summary)`. A stop signal ends it early
  (it is not checkpointed: a resumed run starts from the first RL checkpoint, and a run stopped
  before one starts over). With `sft.cache` a warm-up this machine has computed before is loaded
  instead of run (`jaxrl.run.warmup_cache`): the same parameters and metrics rows."""
  cfg = parts.cfg.sft
  if not cfg.enabled or cfg.max_steps == 0:
    return params, {"sft/steps": 0}
  rng = np.random.default_rng([parts.cfg.seed, 1])
  first = parts.sft_batch(parts.task.sample(rng, cfg.batch_size))
  cache = _WarmupCache(parts, params, first)
  hit = cache.load(params, out, progress)
  if hit is not None:
    return hit
  opt = make_optimizer(cfg.learning_rate, b1=parts.cfg.train.b1, b2=parts.cfg.train.b2,
                       eps=parts.cfg.train.adam_eps,
                       grad_clip=parts.cfg.train.grad_clip)
  step_cfg = StepConfig(loss="sft", logprob_impl=logprob_impl(parts.cfg))
  step_fn, init_state = build_train_step(parts.graphdef, opt, step_cfg, parts.mesh, params)
  state = init_state(params)
  evaluator = Evaluator(parts, asynchronous=False)
  timer = metrics_lib.Timer()
  acc, steps, rows = 0.0, 0, []
  progress.say(f"warm-up: supervised steps until dev accuracy >= {cfg.stop_accuracy}")
  for steps in range(1, cfg.max_steps + 1):
    batch = first if steps == 1 else parts.sft_batch(parts.task.sample(rng, cfg.batch_size))
    state, m = step_fn(state, to_rows(batch, parts.mesh))
    row = {"phase": "sft", "step": steps, "sft/loss": m["loss"]}
    if steps % cfg.eval_every == 0:
      acc = evaluator.evaluate(state.params, "dev")["val/accuracy"]
      row["sft/dev_accuracy"] = acc
      progress.update(steps, cfg.max_steps, f"loss {float(m['loss']):.3f} | dev accuracy {acc:.3f}"
                      f" | {timer():.0f} s", force=False)
    out.write(row)
    if cache.enabled:
      rows.append(out.rows[-1])  # the row as written (host values), for the cache to replay
    if steps % cfg.eval_every == 0 and acc >= cfg.stop_accuracy:
      break
    # Every process decides together: a signal may have reached only one of them.
    if stop is not None and parallel.distributed.any_process(stop()):
      progress.newline()
      progress.say(f"warm-up: stopped by signal at step {steps}; nothing saved (warm-up is "
                   "not checkpointed)")
      return state.params, {"sft/steps": steps, "sft/stopped": True}
  progress.newline()
  stopped = "reached" if acc >= cfg.stop_accuracy else "hit sft.max_steps before reaching"
  progress.say(f"warm-up: {steps} steps, {timer():.1f} s, dev accuracy {acc:.3f} ({stopped} "
               f"{cfg.stop_accuracy})")
  summary = {"sft/steps": steps, "sft/dev_accuracy": acc, "sft/time_s": timer()}
  cache.store(state.params, rows, summary, progress)
  return state.params, summary


class _WarmupCache:
  """`jaxrl.run.warmup_cache` for one run's warm-up. Every process takes the same branch: whether the
  cache is used at all is the config's (`sft.cache` empty or not, the same everywhere), a hit
  needs the entry on every process (each reads its own copy), and every process takes part in
  gathering the parameters to store (a process whose "auto" resolves to no directory counts as a
  miss and writes nothing)."""

  def __init__(self, parts: Parts, params, first_batch):
    self.enabled = bool(parts.cfg.sft.cache.strip())
    self.directory = warmup_cache.resolve(parts.cfg.sft.cache) if self.enabled else None
    self.key = self.inputs = None
    if self.directory is not None:
      self.key, self.inputs = warmup_cache.fingerprint(parts.cfg, parts.task, first_batch)

  def load(self, params, out, progress):
    if not self.enabled:
      return None
    timer = metrics_lib.Timer()
    got = None
    if self.directory is not None:
      got = warmup_cache.load(self.directory, self.key, params)
    if parallel.distributed.any_process(got is None):
      return None
    arrays, rows, summary = got
    loaded = warmup_cache.place(arrays, params)
    for row in rows:
      out.write(row)
    computed = summary.get("sft/time_s", float("nan"))
    progress.say(f"warm-up: loaded from the warm-up cache {os.path.join(self.directory, self.key)}"
                 f" ({summary['sft/steps']} steps, dev accuracy {summary['sft/dev_accuracy']:.3f};"
                 f" computed in {computed:.1f} s; sft.cache=\"\" runs it again)")
    return loaded, {**summary, "sft/time_s": timer(), "sft/from_cache": 1.0}

  def store(self, params, rows, summary, progress):
    if not self.enabled or warmup_cache.nbytes(params) > warmup_cache.MAX_ENTRY_BYTES:
      return
    if self.directory is None and jax.process_count() == 1:
      return
    host = parallel.distributed.fetch(params)  # every process takes part
    if self.directory is None:
      return
    path = warmup_cache.store(self.directory, self.key, host, rows, summary, self.inputs)
    if path is not None:
      progress.say(f"warm-up: cached in {path} (a run with the same warm-up settings loads it)")


def step_metrics(parts: Parts, step: int, batch_id: int, item: RingItem, lag: int,
                 train: dict, loop: LoopState, pipe: dict, evaluator: Evaluator,
                 perf: dict, elapsed_s: float) -> dict:
  """The metrics row of RL step `step`, which trained on batch `batch_id` (`item`); `perf` is
  its time breakdown (`jaxrl.observe.profiling.StepPerf.metrics`)."""
  meta, consumer = item.meta, step - 1  # versions published so far: one per completed step
  rewards = meta.tags["reward"]
  mixed = [np.ptp(rewards[g]) > 0 for g in meta.group_rows()]
  n = max(len(meta), 1)
  # (batch_id, slot, submit_version, consume_version, seed) make an async run replayable
  # synchronously: batch b used params version submit_version and the stream of `seed`.
  return {"phase": "rl", "step": step, "batch_id": batch_id, "slot": batch_id % (lag + 1),
          "submit_version": item.submit_version, "consume_version": consumer,
          "reward": finite_mean(rewards), "filtered_reward": finite_mean(rewards), **item.info,
          "reward/mixed_groups": float(np.mean(mixed)),
          "completion_len": float(meta.lengths.mean()),
          "env/turns/mean": float(meta.tags["turns"].mean()),
          **{f"env/{k}_frac": float(meta.tags[k].sum()) / n
             for k in ("terminated", "truncated", "failed")}, **train,
          "train/skipped_updates": loop.skipped_updates,
          **{f"data/skipped/{k}": c for k, c in parts.source.skipped.items()},
          **staleness_from_rows({k: meta.tags[f"version/{k}"] for k in ("first", "last", "mean")},
                                consumer),
          **{f"pipeline/{k}": v for k, v in pipe.items()},
          "data_plane/train_rows": parts.data.stats()["train/rows"],
          "val/trainer_wait_s": evaluator.wait_s,
          **perf, "perf/elapsed_s": elapsed_s}


def rl(parts: Parts, params, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress, *,
       ckpt: checkpoint.Checkpointer | None = None, resume: tuple | None = None,
       warm: dict | None = None, stop=None,
       on_batch: Callable[[int, TrainBatch], TrainBatch] | None = None,
       rl_step: tuple[Callable, Callable] | None = None,
       ahead: CompileAhead | None = None, run_dir: str | None = None,
       started: float | None = None,
       sender: remote.Sender | None = None) -> tuple[object, dict]:
  """GRPO for `train.steps` steps from `params` (see the module docstring); returns the final
  params and the summary.

  Checkpoints (`ckpt`, every `checkpoint.every` steps, at the end, on a stop signal and when
  `train.max_skipped_updates` halts the run) hold the train state, the lag pipeline and the
  `LoopState`, so `resume = (reader, step, host)` continues exactly as if the run had not
  stopped. Before a save every evaluation pass in flight is finished and logged and the rollout
  worker is left idle with the ring full.

  `on_batch(step, batch) -> batch`, if given, sees (and may replace) every train batch just
  before its step: a seam for fault injection and debugging. `rl_step` is `build_rl_step(parts,
  params)` when the caller built it already (None: built here); `ahead`, a `CompileAhead`
  compiling that step, is waited for before the first update. `run_dir`: where
  `profile.steps` writes its trace (`jaxrl.observe.profiling`; None: no trace). `started`: the
  `time.monotonic()` of the process's start, from which the time to the first RL step is
  printed and kept in the summary (`perf/first_rl_step_s`). `sender`: the train side of a run
  disaggregated across processes (`jaxrl.pipeline.remote`): the batches come from the rollout
  process, and each params version is published to it.
  """
  cfg = parts.cfg
  r, t, v, c = cfg.rollout, cfg.train, cfg.val, cfg.checkpoint
  stop = stop or (lambda: False)
  if sender is not None:  # a signal may also reach the rollout process, which says so
    asked, stop = stop, lambda: asked() or sender.channel.has("stop")
  step_fn, init_state = rl_step or build_rl_step(parts, params)
  state = init_state(params)
  fields = train_fields(cfg)
  # Several processes must launch global computations in the same order: evaluation runs inline;
  # rollouts run on a thread that makes each process's share of a batch on its own devices
  # (`process_share`; the trainer thread publishes params to them and assembles each batch), or,
  # where a batch cannot be split by process, inline (same batches and staleness; no overlap).
  single = jax.process_count() == 1
  share = process_share(parts) if sender is None else None
  # Its passes run on threads named jaxrl-validation-<step> (benchmarks/soak.py counts them as
  # per-pass threads, not as threads the loop keeps).
  evaluator = Evaluator(parts, asynchronous=v.asynchronous and single, max_wait_s=v.max_wait_s,
                        name="jaxrl-validation")
  # Published params are copies: the train step donates its own buffers, and the worker (or an
  # evaluation pass) may still be reading an older version. Disaggregated, the copy is the
  # reshard onto the rollout mesh; on several processes, each process's copy on its own devices.
  # With LoRA the samplers run the base model with the adapters merged into its weights: the
  # base goes to the rollout side once, then each version moves only the adapters.
  lora = lora_model(parts)
  if lora is None:
    prepare = lambda p: parts.rollout_copy(p, share)  # cast to rollout.dtype there
    merged = lambda p: p
  else:
    prepare = lora_lib.AdapterSync(lora, lambda tree: parts.rollout_place(tree, share),
                                   rollout_dtype(cfg))
    merged = lambda p: lora_lib.merge(lora, p)
  handoff = ParamsHandoff()  # partial rollouts read its newest version while decoding
  if sender is None:
    producer = RolloutProducer(parts, parts.train_loop(
        handoff.latest if r.partial_rollouts else None, share and share.mesh), share)
  else:  # the rollout process makes the batches; each version goes there as it is published
    producer = remote.Receiver(parts, sender.channel, sender.versions.K)
    prepare = lambda p: sender(loop.step, p)  # with LoRA: the base once, then the adapters
  pipe = LagPipeline(producer, r.lag, stall_timeout_s=r.stall_timeout_s,
                     inline=not single and share is None and sender is None, prepare=prepare,
                     handoff=handoff)
  if sender is not None:
    producer.should_stop = pipe.worker.should_stop
  # What evaluation (inline on several processes, so done before the next step) generates with.
  for_eval = (lambda published: published) if share is None and sender is None else \
      (lambda _: merged(model_params(state)))
  loop = LoopState(warmup=dict(warm or {}), config=run_dir_lib.checkpoint_config(cfg))
  timer = metrics_lib.Timer()
  perf = profiling.StepPerf(parts, params, run_dir)  # time breakdown, MFU, profiler trace
  if resume is not None:
    reader, start, host = resume
    state, loop = LoopState.restore(reader, start, host, state, pipe)
    progress.say(f"resumed from step {start} ({reader.directory})")
  if sender is not None:  # what the rollout process makes, from where
    sender.start(pipe.gate.checkpoint_state()["submitted"], remote.horizon(t.steps, r.lag),
                 r.lag, producer.remote_state)

  def log_evaluations(results):
    for vstep, m in results:
      loop.val_accuracy[vstep] = m["val/accuracy"]
      out.write({"phase": "val", "step": vstep, **m})

  def save() -> None:
    if ckpt is not None:
      log_evaluations(evaluator.wait())  # every pass up to this step is in the metrics first
      loop.metrics_lines = len(out.rows)
      loop.save(ckpt, state, pipe)

  ds = " with dynamic sampling" if cfg.dynamic_sampling.enabled else ""
  progress.say(f"RL: {t.steps} GRPO steps of {r.num_prompts} prompts x {r.group_size} samples, "
               f"lag {r.lag}{ds}")
  if lora is not None:
    trained, total = lora_lib.counts(model_params(state))
    opt_values = sum(int(x.size) for x in jax.tree.leaves(state.opt_state))
    progress.say(f"LoRA rank {lora.lora_rank} (alpha {lora.lora_alpha:g}) on "
                 f"{','.join(lora.lora_targets)}: {trained:,} trained params of "
                 f"{trained + total:,} ({100 * trained / (trained + total):.2f}%), optimizer state "
                 f"{opt_values:,} values, base frozen")
  published = pipe.publish(loop.step, model_params(state))
  if loop.step == 0 and v.at_start:
    evaluator.submit(0, for_eval(published))
  stopped_at = None
  first_step_s = None
  try:
    with pipe:
      for step in range(loop.step + 1, t.steps + 1):
        perf.begin(step)
        batch_id, item = pipe.pull()
        perf.lap("wait")
        arrays = parts.data.get(item.meta, fields)
        batch = TrainBatch(**{f: arrays.get(f) for f in TrainBatch._fields})
        if on_batch is not None:
          batch = on_batch(step, batch)
        if ahead is not None:
          ahead.wait()
          ahead = None
        train_from = time.time()
        state, m = step_fn(state, batch)
        m = parallel.distributed.fetch(m)
        train_span = {"perf/train_from": train_from, "perf/train_to": time.time()}
        perf.lap("train")
        if first_step_s is None and started is not None:
          first_step_s = time.monotonic() - started
          cache = jax.config.jax_compilation_cache_dir
          progress.say(f"first RL step done {first_step_s:.1f} s after start (compilation "
                       f"cache: {cache or 'off'})")
        del batch, arrays
        parts.data.discard(item.meta)  # the step consumed these rows
        loop.step = step
        if int(m["prompt_layout_errors"]):
          raise RuntimeError(f"step {step}: the train batch's rows are not in groups of "
                             f"{r.group_size} with one prompt each; the update was not applied "
                             "(set train.share_prompts=false to train it row by row)")
        skipped = int(m["skipped_nonfinite"])
        loop.skipped_updates += skipped
        loop.consecutive_skipped = loop.consecutive_skipped + 1 if skipped else 0
        published = pipe.publish(step, model_params(state))
        perf.lap("publish")
        if step % v.every == 0 or (v.at_end and step == t.steps):
          evaluator.submit(step, for_eval(published))
        evaluations = evaluator.poll()
        perf.lap("val")
        row = step_metrics(parts, step, batch_id, item, r.lag, m, loop, pipe.stats(), evaluator,
                           {**perf.metrics(item), **train_span}, timer())
        out.write(row)
        log_evaluations(evaluations)
        acc = loop.val_accuracy[max(loop.val_accuracy)] if loop.val_accuracy else None
        progress.update(step, t.steps, metrics_lib.rl_progress_text(
            row, acc, skipped_prompts=parts.source.draws.total))
        if ckpt is not None:
          ckpt.check()  # a failed background save stops the run now, not at the next save
        halt = None
        if t.max_skipped_updates and loop.skipped_updates > t.max_skipped_updates:
          halt = (f"{loop.skipped_updates} updates were skipped for non-finite gradients, more "
                  f"than train.max_skipped_updates={t.max_skipped_updates}")
        elif t.max_consecutive_skipped and loop.consecutive_skipped >= t.max_consecutive_skipped:
          halt = (f"the last {loop.consecutive_skipped} updates (to step {step}) were all skipped "
                  "for non-finite gradients (train.max_consecutive_skipped="
                  f"{t.max_consecutive_skipped})")
        # One decision per step, the same on every process (a signal may have reached only one
        # of them: a preempted host): all checkpoint this step and stop.
        stopping = parallel.distributed.any_process(stop())
        if (c.every and step % c.every == 0) or step == t.steps or stopping or halt:
          save()
        if halt:
          raise TrainingHalted(f"{halt}; checkpoint of step {step} saved. Check the rewards, "
                               "the sampling temperature and the learning rate, then resume.")
        if stopping:
          stopped_at = step
          break
    if stopped_at is None:
      log_evaluations(evaluator.wait())
  finally:
    if sender is not None:
      sender.done()
    perf.close()
    evaluator.close()
    parts.data.clear("train")  # batches still in the ring when the run ends or fails
  progress.newline()
  acc = loop.val_accuracy
  return model_params(state), {"val/accuracy_before_rl": acc.get(0, float("nan")),
                        "val/accuracy_after_rl": acc[max(acc)] if acc else float("nan"),
                        "rl/time_s": timer(), "rl/steps": t.steps, "rl/stopped_at": stopped_at,
                        "train/skipped_updates": loop.skipped_updates,
                        **({} if first_step_s is None else
                           {"perf/first_rl_step_s": first_step_s})}


def run(cfg: ConfigDict, run_dir: str, mesh_shape: config_lib.MeshShape, stop=None,
        started: float | None = None) -> dict:
  """Runs warm-up and RL; writes config.json, metrics.jsonl, curves.png, summary.json, and
  checkpoints under `<run_dir>/checkpoints`.

  The data, model files and tokenizer are checked (and the model built) before anything is
  written. The run then owns `run_dir` (`jaxrl.run.run_dir`: a lock, one run per directory) and
  decides how it starts (`run_dir.decide`): from a checkpoint (`resume`: auto | none | a path or
  one step of it; the newest usable one, checked against the config), its own checkpoint's
  metrics.jsonl cut back to the lines written when it was saved, so the resumed run continues the
  file exactly; or fresh, a previous run moved aside. config.json is written only then. With
  several processes every process runs this whole function (the same computations in the same
  order); only process 0 prints and writes files. `stop()` true (a signal) makes the run
  checkpoint and return early with `rl/stopped_at` set.
  """
  total = metrics_lib.Timer()
  across = bool(mesh_shape.rollout_processes)  # disaggregated across processes
  rollout_side = across and jax.process_index() in mesh_shape.rollout_processes
  if across:  # the trainers' collectives and files are theirs alone (`jaxrl.pipeline.remote`)
    parallel.distributed.set_group(remote.train_processes(mesh_shape))
    remote.new_run()
  main = parallel.distributed.is_main()
  parts, params = build_parts(cfg, mesh_shape)
  quiet = None if main else open(os.devnull, "w")
  progress = metrics_lib.Progress(stream=quiet, every=cfg.log_every)
  lock = run_dir_lib.RunDirLock(run_dir).acquire() if main else None
  ckpt = out = reader = None
  try:
    start = run_dir_lib.decide(cfg, run_dir, progress.say, write=main)
    if jax.process_count() > 1:  # process 0 has moved a previous run aside
      multihost_utils.sync_global_devices("jaxrl-run-dir")
    own_dir = checkpoint.checkpoint_dir(run_dir)
    ckpt = checkpoint.Checkpointer(own_dir, keep=cfg.checkpoint.keep,
                                   async_save=cfg.checkpoint.async_save)
    if across:  # both sides take part in every checkpoint (`jaxrl.pipeline.remote`)
      remote.use_first_replica_writes()
      union = remote.union_mesh(remote.train_mesh(mesh_shape), remote.rollout_groups(mesh_shape))
      if rollout_side:
        inner, ckpt = ckpt, None  # serve closes it when the train side does
        # It generates with the versions it receives only: its own starting params are a
        # template (shapes and dtypes), their device memory freed here, and a distillation
        # teacher (the train step's) is dropped.
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        parts = dataclasses.replace(parts, teacher=None)
        return remote.serve(parts, params, mesh_shape, progress, stop, ckpt=inner,
                            union=union)
      ckpt = remote.MirroredCheckpointer(ckpt, remote.run_channel(), union, main,
                                         len(mesh_shape.rollout_processes))
    if main:
      with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_lib.to_dict(cfg), f, indent=2)
      if cfg.model.hf_path:
        # What `python -m jaxrl.export` needs besides the weights, kept with the run so the export
        # does not depend on the starting directory still being there.
        export.copy_metadata(cfg.model.hf_path, os.path.join(run_dir, export.METADATA_DIR))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    progress.say(f"jaxrl | run dir {run_dir} | task {cfg.task.name} | model {n_params:,} params | "
                 f"mesh {mesh_shape.data}x{mesh_shape.fsdp}x{mesh_shape.tensor} on "
                 f"{jax.devices()[0].platform}")
    if parts.teacher is not None:
      d = cfg.distill
      progress.say(f"distillation: teacher {parts.teacher.source}, coef {d.coef}, task reward "
                   f"weight {d.reward_weight}")
    note = parts.source.note()  # rows the checks up front skip (data.max_skipped_frac)
    if note:
      progress.say(note)
    if mesh_shape.disaggregated and not across:
      first = mesh_shape.train_devices
      progress.say(f"disaggregated: train on devices 0-{mesh_shape.size - 1}, rollouts on "
                   f"devices {first}-{first + mesh_shape.rollout_devices - 1} (mesh "
                   f"{'x'.join(map(str, mesh_shape.rollout_shape))})")
    sender = None
    if across:
      sender = remote.Sender(remote.Versions(parts, mesh_shape, params),
                             remote.run_channel(), main)
      crossing = f"{sender.versions.bytes_per_version:,} bytes per params version"
      if sender.versions.lora is not None:
        crossing = (f"the base once ({sender.versions.base_bytes:,} bytes), then the adapters "
                    f"({sender.versions.bytes_per_version:,} bytes per version)")
      progress.say(f"disaggregated across processes: processes "
                   f"{list(mesh_shape.rollout_processes)} generate on their "
                   f"{mesh_shape.rollout_devices} devices (a "
                   f"{'x'.join(map(str, mesh_shape.rollout_shape))} mesh each), processes "
                   f"{list(remote.train_processes(mesh_shape))} train on "
                   f"{mesh_shape.train_devices}; {crossing}")
    rl_step = build_rl_step(parts, params)
    # One process: compile the RL step while the warm-up runs (several processes compile in
    # lockstep on the main thread, as they launch everything else).
    ahead = CompileAhead(parts, rl_step, params) if jax.process_count() == 1 else None
    unreadable: set[int] = set()
    while True:
      out = metrics_lib.MetricsWriter(run_dir if main else None, keep_lines=start.keep_lines,
                                      cfg=cfg)
      resume = None
      if start.resume is not None:
        directory, step, host = start.resume
        same = os.path.abspath(directory) == os.path.abspath(own_dir)
        if across and not same:
          raise config_lib.ConfigError([
              f"{config_lib.PREFIX}resume: with {config_lib.PREFIX}mesh.rollout_processes a run "
              f"resumes from its own checkpoints only, got {directory}"])
        reader = ckpt if same else checkpoint.Checkpointer(directory, read_only=True)
        resume = (reader, step, host)
        warm = LoopState.restore_warmup(host)
      else:
        params, warm = warmup(parts, params, out, progress, stop)
        if warm.get("sft/stopped"):
          return warm
      try:
        params, rl_summary = rl(parts, params, out, progress, ckpt=ckpt, resume=resume,
                                warm=warm, stop=stop, rl_step=rl_step, ahead=ahead,
                                run_dir=run_dir if main else None, started=started,
                                sender=sender)
        break
      except checkpoint.UnreadableStep as e:  # found by the restore: try the one before it
        progress.say(f"{e}; trying the one before it")
        # That step and the newer ones (reported when it was chosen) are passed over silently.
        unreadable.update(s for s in checkpoint.complete_steps(e.directory) if s >= e.step)
        out.close()
        start = run_dir_lib.decide(cfg, run_dir, progress.say, unreadable, write=False)
    summary = {**warm, **rl_summary}
    if resume is not None:  # this process did not warm up: its time is not in total_time_s
      summary = {k: v for k, v in summary.items() if k != "sft/time_s"}
      summary["resumed_from_step"] = resume[1]
    if summary["rl/stopped_at"] is not None:
      progress.say(f"stopped by signal after step {summary['rl/stopped_at']}: checkpoint saved in "
                   f"{own_dir}; continue with --config.run_dir={run_dir} (resume=auto)")
      return summary
    summary["val/rl_gain"] = summary["val/accuracy_after_rl"] - summary["val/accuracy_before_rl"]
    summary["total_time_s"] = total()
    out.write({"phase": "summary", **summary})
  finally:
    for closing in (ckpt, None if reader is ckpt else reader, out, quiet):
      if closing is not None:
        closing.close()
    if lock is not None:
      lock.release()
  if main:
    metrics_lib.finish(run_dir, summary, out.rows, f"jaxrl {cfg.name}: GRPO on {cfg.task.name}",
                       progress)
  return summary
