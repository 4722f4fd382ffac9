"""The synchronous GRPO run: build the parts from a validated config, warm up, train, report.

`run(cfg, run_dir, mesh_shape)` is what `python -m jaxrl.train` calls after validating the
config. Phases:

1. supervised warm-up on task demonstrations, stopped at the first `dev` greedy accuracy
   >= `sft.stop_accuracy` (so RL starts with headroom; the stop is on a split never reported);
2. GRPO for `train.steps` steps with a fresh optimizer: P prompts x G samples, exact-match
   reward, group-normalised advantages, PPO-clip token-mean loss;
3. held-out greedy accuracy on `val` before RL, every `eval.every` steps and at the end.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from jaxrl import config as config_lib
from jaxrl import losses
from jaxrl import metrics as metrics_lib
from jaxrl import parallel
from jaxrl.data import left_pad
from jaxrl.envs import TASKS
from jaxrl.models import ModelConfig, init_model
from jaxrl.pipeline import (LagGate, ParamsHandoff, RolloutWorker, fill_batch,
                            staleness_metrics)
from jaxrl.rollout.sampler import make_sampler
from jaxrl.train_step import (StepConfig, build_train_step, make_optimizer, shard_params,
                              to_rows)
from jaxrl.types import TrainBatch


class Parts:
  """Everything built from the config, before any step runs."""

  def __init__(self, cfg: ConfigDict, mesh_shape: config_lib.MeshShape):
    self.cfg = cfg
    self.task = TASKS[cfg.task.name](num_digits=cfg.task.num_digits, seed=cfg.seed,
                                     dev_size=cfg.task.dev_size, val_size=cfg.task.val_size)
    self.tok = self.task.tokenizer
    problems = []
    if self.task.max_answer_tokens > cfg.rollout.max_new_tokens:
      problems.append(f"config.rollout.max_new_tokens: task {cfg.task.name!r} answers need up to "
                      f"{self.task.max_answer_tokens} tokens, got {cfg.rollout.max_new_tokens}")
    prompt_len = len(self.tok.encode(self.task.problem(0).prompt))
    if prompt_len > cfg.rollout.max_prompt_len:
      problems.append(f"config.rollout.max_prompt_len: task {cfg.task.name!r} prompts have "
                      f"{prompt_len} tokens, got {cfg.rollout.max_prompt_len}")
    if cfg.model.vocab_size and cfg.model.vocab_size < self.tok.vocab_size:
      problems.append(f"config.model.vocab_size: the tokenizer needs {self.tok.vocab_size}, got "
                      f"{cfg.model.vocab_size}")
    if problems:
      raise config_lib.ConfigError(problems)

    self.model_cfg = ModelConfig.from_config(cfg.model, self.tok.vocab_size)
    self.mesh = parallel.make_mesh(mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor)
    self.graphdef, params = init_model(self.model_cfg, cfg.seed)
    self.params = shard_params(params, self.mesh)

    r = cfg.rollout
    common = dict(max_new_tokens=r.max_new_tokens, eos_id=self.tok.eos_id, pad_id=self.tok.pad_id)
    self.sample = make_sampler(self.graphdef, num_samples=r.group_size, **common)
    self.sample_greedy = make_sampler(self.graphdef, num_samples=1, **common)

  # ---- batches -------------------------------------------------------------------------------

  def prompts(self, problems) -> tuple[np.ndarray, np.ndarray]:
    return left_pad([self.tok.encode(p.prompt) for p in problems], self.cfg.rollout.max_prompt_len,
                    self.tok.pad_id)

  def sft_batch(self, problems) -> TrainBatch:
    n = self.cfg.rollout.max_new_tokens
    b = len(problems)
    prompts, valid = self.prompts(problems)
    tokens = np.full((b, n), self.tok.pad_id, np.int32)
    mask = np.zeros((b, n), bool)
    for i, p in enumerate(problems):
      demo = self.task.demonstration(p)
      tokens[i, :len(demo)] = demo
      mask[i, :len(demo)] = True
    return TrainBatch(prompts, valid, tokens, mask, np.zeros((b, n), np.float32),
                      np.zeros(b, np.float32), np.arange(b, dtype=np.int32),
                      np.ones(b, np.float32))

  def evaluate(self, params, problems) -> float:
    """Greedy exact-match accuracy; the last batch is padded by repetition to keep one shape."""
    bs = self.cfg.eval.batch_size
    correct = 0.0
    for start in range(0, len(problems), bs):
      chunk = problems[start:start + bs]
      padded = chunk + [chunk[-1]] * (bs - len(chunk))
      prompts, valid = self.prompts(padded)
      out = self.sample_greedy(params, prompts, valid, jax.random.key(0), np.arange(bs), 0.0)
      tokens, mask = jax.device_get((out.tokens, out.mask))
      correct += float(self.task.rewards(chunk, tokens[:len(chunk)], mask[:len(chunk)]).sum())
    return correct / len(problems)


def _logprob_impl(cfg) -> str | None:
  """`loss.logprob_impl` as `StepConfig` takes it ("auto" = the backend's default)."""
  return None if cfg.loss.logprob_impl == "auto" else cfg.loss.logprob_impl


def rl_step_config(cfg) -> StepConfig:
  """The RL train step's static settings from a validated run config."""
  lo = cfg.loss
  bands = {f"{b}_{side}": lo[f"{b}_{side}"] for b in
           ("icepop", "seq_mask", "geo_mask", "product_mask", "outlier", "dppo_delta")
           for side in ("low", "high")}
  objective = losses.ObjectiveConfig(
      policy=lo.policy,
      ratio_base=("rollout" if cfg.rollout.lag > 0 else "trainer") if lo.ratio_base == "auto"
      else lo.ratio_base,
      eps_low=lo.eps_low, eps_high=lo.eps_high,
      dual_clip=lo.dual_clip or None, correction=losses.parse_correction(lo.correction),
      correction_params=losses.CorrectionParams(
          token_tis_cap=lo.token_tis_cap, seq_tis_cap=lo.seq_tis_cap, **bands),
      reduction=lo.reduction, norm_len=lo.norm_len or None,
      rollout_kl_coef=cfg.rollout_kl.coef, rollout_kl_estimator=cfg.rollout_kl.estimator,
      rollout_kl_reduction=cfg.rollout_kl.reduction,
      ref_kl_coef=cfg.ref_kl.coef, ref_kl_estimator=cfg.ref_kl.estimator,
      ref_kl_reduction=cfg.ref_kl.reduction, entropy_coef=lo.entropy_coef,
      seq_logprob_error_threshold=lo.seq_logprob_error_threshold or None)
  a = cfg.advantage
  return StepConfig(loss="rl", objective=objective, advantage=a.estimator, adv_eps=a.eps,
                    adv_clip=a.clip or None, num_microbatches=cfg.train.num_microbatches,
                    logprob_impl=_logprob_impl(cfg))


def warmup(parts: Parts, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress) -> dict:
  cfg = parts.cfg.sft
  if not cfg.enabled or cfg.max_steps == 0:
    return {"sft/steps": 0}
  opt = make_optimizer(cfg.learning_rate, b1=parts.cfg.train.b1, b2=parts.cfg.train.b2,
                       grad_clip=parts.cfg.train.grad_clip)
  step_cfg = StepConfig(loss="sft", logprob_impl=_logprob_impl(parts.cfg))
  step_fn, init_state = build_train_step(parts.graphdef, opt, step_cfg, parts.mesh, parts.params)
  state = init_state(parts.params)
  rng = np.random.default_rng([parts.cfg.seed, 1])
  dev = parts.task.split("dev")
  timer = metrics_lib.Timer()
  acc, steps = 0.0, 0
  progress.say(f"warm-up: supervised steps until dev accuracy >= {cfg.stop_accuracy}")
  for steps in range(1, cfg.max_steps + 1):
    batch = parts.sft_batch(parts.task.sample(rng, cfg.batch_size))
    state, m = step_fn(state, to_rows(batch, parts.mesh))
    row = {"phase": "sft", "step": steps, "sft/loss": m["loss"]}
    if steps % cfg.eval_every == 0:
      acc = parts.evaluate(state.params, dev)
      row["sft/dev_accuracy"] = acc
      progress.update(steps, cfg.max_steps, f"loss {float(m['loss']):.3f} | dev accuracy {acc:.3f}"
                      f" | {timer():.0f} s", force=False)
    out.write(row)
    if steps % cfg.eval_every == 0 and acc >= cfg.stop_accuracy:
      break
  progress.newline()
  stopped = "reached" if acc >= cfg.stop_accuracy else "hit sft.max_steps before reaching"
  progress.say(f"warm-up: {steps} steps, {timer():.1f} s, dev accuracy {acc:.3f} ({stopped} "
               f"{cfg.stop_accuracy})")
  parts.params = state.params
  return {"sft/steps": steps, "sft/dev_accuracy": acc, "sft/time_s": timer()}


def rl(parts: Parts, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress) -> dict:
  cfg = parts.cfg
  r, t = cfg.rollout, cfg.train
  P, G = r.num_prompts, r.group_size
  opt = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                       grad_clip=t.grad_clip, warmup_steps=t.warmup_steps)
  step_cfg = rl_step_config(cfg)
  step_fn, init_state = build_train_step(parts.graphdef, opt, step_cfg, parts.mesh, parts.params)
  state = init_state(parts.params)
  val = parts.task.split("val")
  L = r.lag
  # Only the worker thread draws from `rng`, one batch after another in batch order, so the
  # prompt stream does not depend on timing.
  rng = np.random.default_rng([cfg.seed, 2])
  rl_key = jax.random.key(cfg.seed)
  group_id = np.repeat(np.arange(P, dtype=np.int32), G)
  temperature = np.full(P * G, r.temperature, np.float32)

  def produce(batch_id: int, params, version: int) -> dict:
    """One batch on the worker thread: sample P x G with params `version`, then rewards."""
    st = metrics_lib.Timer()
    step = batch_id + 1
    problems = parts.task.sample(rng, P)

    def sample(slots, attempt):
      key = jax.random.fold_in(rl_key, step)
      if attempt:
        # A filtered group is replaced by a fresh prompt in the same slot, new samples.
        for s in slots:
          problems[s] = parts.task.sample(rng, 1)[0]
        key = jax.random.fold_in(key, attempt)
      prompts, valid = parts.prompts(problems)
      out = parts.sample(params, prompts, valid, key, np.arange(P * G) + step * P * G,
                         r.temperature, r.top_k, r.top_p)
      tokens, mask, logprobs = jax.device_get((out.tokens, out.mask, out.logprobs))
      rewards = parts.task.rewards([p for p in problems for _ in range(G)], tokens, mask)
      rows = lambda s: slice(s * G, (s + 1) * G)
      return [dict(prompt=prompts[s], valid=valid[s], tokens=tokens[rows(s)],
                   mask=mask[rows(s)], logprobs=logprobs[rows(s)], rewards=rewards[rows(s)])
              for s in slots]

    # The generic "this group is filtered" hook: a group is kept unless every sample failed
    # (the built-in tasks never fail a sample; dynamic sampling plugs in here).
    keep = lambda g: bool(np.any(np.isfinite(g["rewards"])))
    groups, counts = fill_batch(batch_id, P, sample, keep, r.max_regenerations)
    for name, n in counts.items():  # reported by the gate's stats as pipeline/<name>
      gate.add(name, n)
    cat = lambda k: np.concatenate([g[k] for g in groups])
    mask = cat("mask")
    batch = TrainBatch(np.repeat(np.stack([g["prompt"] for g in groups]), G, 0),
                       np.repeat(np.stack([g["valid"] for g in groups]), G, 0), cat("tokens"),
                       mask, cat("logprobs") if r.logprobs else None, cat("rewards"), group_id,
                       temperature)
    # Placed on the mesh here, on the worker thread, so the transfer overlaps training; the
    # host copy stays for metrics.
    return {"batch": batch, "device_batch": to_rows(batch, parts.mesh),
            "policy_version": np.full(mask.shape, version, np.int32),
            "submit_version": version, "sample_time_s": st()}

  acc0 = parts.evaluate(state.params, val)
  out.write({"phase": "rl", "step": 0, "val/accuracy": acc0})
  progress.say(f"RL: {t.steps} GRPO steps of {P} prompts x {G} samples, lag {L}; "
               f"val accuracy {acc0:.3f}")
  timer = metrics_lib.Timer()
  acc = acc0
  gate = LagGate(L, r.stall_timeout_s)
  handoff = ParamsHandoff()
  # Published params are copies: the train step donates its own buffers, and the worker may
  # still be sampling from an older version.
  publish = lambda v: handoff.publish(v, jax.tree.map(jnp.copy, state.params))
  publish(0)
  with RolloutWorker(gate, handoff, produce, L):
    for step in range(1, t.steps + 1):
      st = metrics_lib.Timer()
      batch_id, item = gate.pull()
      consumer = step - 1  # versions published so far: one per completed train step
      # The next batch to start is >= batch_id + 1 and needs version >= batch_id + 1 - L.
      handoff.prune_below(max(0, batch_id + 1 - L))
      batch = item["batch"]
      state, m = step_fn(state, item["device_batch"])
      m = jax.device_get(m)
      publish(step)
      dt = st()
      pipe = gate.stats()
      rewards, mask = batch.rewards, batch.mask
      groups = rewards.reshape(P, G)
      # (batch_id, slot, submit_version, consume_version, seed) make an async run replayable
      # synchronously: batch b used params version submit_version and the stream of `seed`.
      row = {"phase": "rl", "step": step, "batch_id": batch_id, "slot": batch_id % (L + 1),
             "submit_version": item["submit_version"], "consume_version": consumer,
             "reward": float(rewards.mean()),
             "reward/mixed_groups": float(np.mean(groups.max(1) > groups.min(1))),
             "completion_len": float(mask.sum(1).mean()), **m,
             **staleness_metrics(item["policy_version"], mask, consumer),
             **{f"pipeline/{k}": v for k, v in pipe.items()},
             "perf/step_time_s": dt, "perf/sample_time_s": item["sample_time_s"],
             "perf/elapsed_s": timer(),
             "perf/gen_tokens_per_s": float(mask.sum()) / dt}
      if step % cfg.eval.every == 0 or step == t.steps:
        acc = parts.evaluate(state.params, val)
        row["val/accuracy"] = acc
      out.write(row)
      progress.update(step, t.steps, f"reward {row['reward']:.3f} | val {acc:.3f} | "
                      f"{dt:.2f} s/step | {row['perf/gen_tokens_per_s']:.0f} tok/s")
  progress.newline()
  parts.params = state.params
  return {"val/accuracy_before_rl": acc0, "val/accuracy_after_rl": acc,
          "rl/time_s": timer(), "rl/steps": t.steps}


def run(cfg: ConfigDict, run_dir: str, mesh_shape: config_lib.MeshShape) -> dict:
  """Runs warm-up and RL; writes config.json, metrics.jsonl, curves.png, summary.json."""
  total = metrics_lib.Timer()
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(cfg), f, indent=2)
  progress = metrics_lib.Progress(every=cfg.log_every)
  out = metrics_lib.MetricsWriter(run_dir)
  try:
    parts = Parts(cfg, mesh_shape)
    n_params = sum(x.size for x in jax.tree.leaves(parts.params))
    progress.say(f"jaxrl | run dir {run_dir} | task {cfg.task.name} | model {n_params:,} params | "
                 f"mesh {mesh_shape.data}x{mesh_shape.fsdp}x{mesh_shape.tensor} on "
                 f"{jax.devices()[0].platform}")
    summary = {**warmup(parts, out, progress), **rl(parts, out, progress)}
    summary["val/rl_gain"] = summary["val/accuracy_after_rl"] - summary["val/accuracy_before_rl"]
    summary["total_time_s"] = total()
    out.write({"phase": "summary", **summary})
  finally:
    out.close()
  metrics_lib.write_chart(os.path.join(run_dir, "curves.png"), out.rows,
                          f"jaxrl {cfg.name}: GRPO on {cfg.task.name}")
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  progress.say(
      f"\nheld-out accuracy: {summary['val/accuracy_before_rl']:.3f} before RL -> "
      f"{summary['val/accuracy_after_rl']:.3f} after {summary['rl/steps']} RL steps "
      f"({summary['val/rl_gain']:+.3f})\n"
      f"time: {summary['total_time_s']:.0f} s total ({summary.get('sft/time_s', 0):.0f} s warm-up,"
      f" {summary['rl/time_s']:.0f} s RL)\n"
      f"wrote {run_dir}/metrics.jsonl, curves.png, summary.json, config.json")
  return summary
