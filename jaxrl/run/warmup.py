"""The supervised warm-up before RL: task demonstrations until the `dev` split's greedy accuracy
reaches `sft.stop_accuracy` (so RL starts with headroom; the stop is on a split never reported),
or loaded from the warm-up cache when this machine has computed the same warm-up before
(`jaxrl.run.warmup_cache`)."""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxrl import parallel
from jaxrl.learner.rl import logprob_impl
from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer, to_rows
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import warmup_cache
from jaxrl.run.validation import Evaluator


def warmup(parts, params, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress,
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

  def __init__(self, parts, params, first_batch):
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
