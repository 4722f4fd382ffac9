"""The run: build the parts from a validated config, warm up, train with GRPO, report.

`run(cfg, run_dir, mesh_shape)` is what `python -m jaxrl.train` calls after validating the
config. Phases:

1. supervised warm-up on task demonstrations, stopped at the first `dev` greedy accuracy
   >= `sft.stop_accuracy` (so RL starts with headroom; the stop is on a split never reported);
2. GRPO for `train.steps` steps with a fresh optimizer: P prompts x G samples, exact-match
   reward, group-normalised advantages, the loss composed from `loss.*`; a rollout thread feeds
   the forced-lag ring (`rollout.lag`, 0 = synchronous) and, with `dynamic_sampling.enabled`,
   drops groups without reward variance while keeping every batch at P whole groups;
3. held-out greedy accuracy on `val` before RL, every `val.every` steps and at the end
   (generated on a thread while training goes on, `val.asynchronous`).

Rollout rows live in the data plane (`jaxrl.pipeline.DataPlane`): partition `train` for training
batches, keyed once when sampled, placed length-balanced over the data shards, read by the train
step by key and freed once the step consumed them; partition `val` for evaluation passes. Only
batch metadata crosses the ring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from jaxrl import checkpoint, export
from jaxrl import config as config_lib
from jaxrl import losses
from jaxrl import metrics as metrics_lib
from jaxrl import parallel
from jaxrl.data import left_pad
from jaxrl.data.sources import CheckedSource, MixedSource
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs import AddSource, CountdownSource, GuessSource, MathSource, make_env
from jaxrl.models import ModelConfig, abstract_model, init_model
from jaxrl.models import hf as hf_lib
from jaxrl.pipeline import (BatchMeta, DataPlane, InlineWorker, LagGate, ParamsHandoff,
                            RolloutWorker, balance_rows, dynamic_sampling, fill_batch)
from jaxrl.pipeline.dynamic_sampling import finite_mean
from jaxrl.pipeline.staleness import row_versions, staleness_from_rows
from jaxrl.pipeline.validator import Validator
from jaxrl.rollout.multi_turn import Budget, MultiTurn
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.sampler import make_sampler
from jaxrl.train_step import (StepConfig, build_train_step, compile_step, make_optimizer,
                              shard_params, to_rows)
from jaxrl.types import TrainBatch


TASK_NAMES = config_lib.TASK_NAMES


def make_source(cfg):
  """The task source of `task.name`: one built-in task, or several joined by "+" mixed per row
  (a source drawn per training row with `task.weights`; validation covers every task)."""
  names = cfg.task.name.split("+")
  if len(names) == 1:
    return _one_source(cfg, names[0])
  # One weight per task is checked by config.validate.
  weights = [float(w) for w in cfg.task.weights.split(",")] if cfg.task.weights else None
  return MixedSource([_one_source(cfg, n) for n in names], weights, seed=cfg.seed)


def _one_source(cfg, name: str):
  t = cfg.task
  if name == "add":
    return AddSource(num_digits=t.num_digits, seed=cfg.seed, dev_size=t.dev_size,
                     val_size=t.val_size)
  if name == "countdown":
    return CountdownSource(seed=cfg.seed, val_size=t.val_size)
  if name == "guess":
    return GuessSource(seed=cfg.seed)
  if name == "math":  # config.validate checks that task.path is a file
    return MathSource.from_jsonl(t.path, val_path=t.val_path or None, seed=cfg.seed,
                                 instruction=t.instruction)
  raise KeyError(f"unknown task {name!r}; built in: {TASK_NAMES}")


def engine_sampler(engine: Engine, group_size: int, newest=None):
  """The continuous engine behind the static sampler's call signature (`MultiTurn` calls
  either): left-padded prompt rows become token lists, and `group_size` samples of each come
  back prompt-major, with the same tokens as the static sampler for the same keys.

  `newest() -> (version, params) | None` turns on partial rollouts: the batch starts on the
  params it was given (so its first tokens are exactly as stale as the forced lag says) and,
  between decode dispatches, switches to any newer published version; every token is stamped
  with the version that produced it (`EngineOutput.versions`).
  """

  def sample(params, prompts, prompt_valid, key, request_ids, temperature, top_k=0, top_p=1.0,
             version=0):
    prompts, valid = np.asarray(prompts), np.asarray(prompt_valid)
    rows = [p[v].tolist() for p, v in zip(prompts, valid)]
    source = None if newest is None else _partial_source(newest, version, params)
    return engine.run(params, rows, np.asarray(request_ids), key, temperature, top_k, top_p,
                      group_size=group_size, version=version, params_source=source)

  sample.engine = engine
  return sample


def _rows_over(mesh, sample):
  """The static sampler with its row inputs split over the 'data' axis of `mesh` (the rollout
  mesh), so each data shard decodes its own rows (on several processes: each process its
  share); rows that 'data' does not divide stay replicated. 'fsdp' is left out on purpose:
  splitting rows over the axis that splits the weights would all-gather every layer's weights
  at every decode step."""
  shards = mesh.shape["data"]
  by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

  def put(x):
    x = np.asarray(x)  # the same rows on every process; each places only its own shards
    return x if len(x) % shards else jax.make_array_from_callback(x.shape, by_rows,
                                                                  lambda i: x[i])

  def split_rows(params, prompts, prompt_valid, key, request_ids, *args, **kwargs):
    if shards > 1:
      prompts, prompt_valid, request_ids = put(prompts), put(prompt_valid), put(request_ids)
    return sample(params, prompts, prompt_valid, key, request_ids, *args, **kwargs)

  return split_rows


def _partial_source(newest, version: int, params):
  """The engine's `params_source` for one batch: its own `(version, params)` at the first call
  (the batch's first tokens keep the forced lag), then whichever is newer of those and
  `newest()`."""
  started = []

  def source():
    got = newest() if started else None
    started.append(True)
    return got if got is not None and got[0] > version else (version, params)

  return source


def make_tokenizer(cfg, source):
  """The model's own tokenizer with `model.hf_path`, else a character tokenizer over the task's
  alphabet (the built-in tasks say which characters their text can hold)."""
  if cfg.model.hf_path:
    from jaxrl.data.hf_tokenizer import HFTokenizer, HFTokenizerError
    try:
      return HFTokenizer.from_dir(cfg.model.hf_path,
                                  use_chat_template=cfg.tokenizer.chat_template,
                                  system_prompt=cfg.tokenizer.system_prompt or None)
    except HFTokenizerError as e:  # names the file and the field
      raise config_lib.ConfigError([f"config.model.hf_path: {e}"]) from None
  return CharTokenizer(source.alphabet)


class Parts:
  """Everything built from the config, before any step runs."""

  def __init__(self, cfg: ConfigDict, mesh_shape: config_lib.MeshShape):
    self.cfg = cfg
    r = cfg.rollout
    source = make_source(cfg)
    # The arithmetic task keeps its demonstrations (warm-up) and `dev` split (warm-up stop rule).
    self.task = getattr(source, "task", None)
    self.tok = make_tokenizer(cfg, source)
    self.envs = {name: make_env(name) for name in cfg.task.name.split("+")}
    # Rows are checked when drawn: skipped and counted (data/skipped/<reason>) or raised with
    # the row named, by data.on_bad_row; the validation split is checked here, before compiling.
    self.source = CheckedSource(source, self.row_problem, cfg.data.on_bad_row)
    # What config.validate cannot know without the data: lengths, demonstrations and splits of
    # the built-in tasks are checked there.
    problems = []
    if not self.source.split("val"):
      problems.append(f"config.task.name: task {cfg.task.name!r} has no usable validation rows "
                      f"(skipped: {self.source.skipped})")
    hf_path = cfg.model.hf_path
    if hf_path:
      config_path = os.path.join(hf_path, hf_lib.CONFIG_FILE)
      try:
        with open(config_path) as f:
          model_cfg = hf_lib.config_from_hf(json.load(f), param_dtype=cfg.model.param_dtype,
                                            scan_layers=cfg.model.scan_layers,
                                            config_path=config_path)
        vocab, vocab_key = model_cfg.vocab_size, f"{config_path} vocab_size"
      except (ValueError, NotImplementedError) as e:  # names the file and field
        problems.append(f"config.model.hf_path: {e}")
        vocab = 0
    else:
      vocab, vocab_key = cfg.model.vocab_size, "config.model.vocab_size"
    if vocab and vocab < self.tok.vocab_size:
      problems.append(f"{vocab_key}: the tokenizer needs {self.tok.vocab_size}, got {vocab}")
    if mesh_shape.disaggregated and jax.process_count() > 1:
      problems.append(
          f"config.mesh.rollout: disaggregated rollout and train meshes run in one process for "
          f"now, got {jax.process_count()} processes; set it to 0 (colocated)")
    if problems:
      raise config_lib.ConfigError(problems)

    devices = jax.devices()
    self.mesh = parallel.make_mesh(mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor,
                                   devices[:mesh_shape.train_devices or len(devices)])
    # Rollouts are generated on `rollout_mesh`: the train mesh itself when colocated, else the
    # `rollout_devices` after the train devices, params tensor-parallel and rows split over
    # 'data'. Params reach it through `for_rollout`, which reshards shard by shard.
    self.rollout_mesh = self.mesh
    if mesh_shape.disaggregated:
      first = mesh_shape.train_devices
      self.rollout_mesh = parallel.make_mesh(
          *mesh_shape.rollout_shape, devices[first:first + mesh_shape.rollout_devices])
    if hf_path:
      # Straight onto the mesh from the memory-mapped files; the compute dtype is the run's.
      try:
        self.model_cfg, _, self.params = hf_lib.load_hf(
            hf_path, mesh=self.mesh, param_dtype=cfg.model.param_dtype,
            scan_layers=cfg.model.scan_layers)
      except hf_lib.HFCheckpointError as e:  # a missing shard or tensor, a wrong shape
        raise config_lib.ConfigError([f"config.model.hf_path: {e}"]) from None
      self.model_cfg = dataclasses.replace(self.model_cfg, dtype=cfg.model.dtype,
                                           remat=cfg.model.remat)
      self.graphdef, _ = abstract_model(self.model_cfg)
    else:
      self.model_cfg = ModelConfig.from_config(cfg.model, self.tok.vocab_size)
      self.graphdef, params = init_model(self.model_cfg, cfg.seed)
      self.params = shard_params(params, self.mesh)
    self._rollout_shardings = parallel.param_shardings(self.params, self.rollout_mesh)
    # Rollout rows of partitions `train` and `val`: metadata here, arrays on the (train) mesh.
    self.data = DataPlane(self.mesh)
    self._passes = 0

    common = dict(max_new_tokens=r.max_new_tokens, eos_id=self.tok.eos_ids, pad_id=self.tok.pad_id)
    # Partial rollouts: `rl` points this at the params handoff's newest version.
    self.newest_params = lambda: None
    if r.engine == "continuous":
      def engine(group_size, prompt_len, rows, partial=False):
        slots = r.engine_slots or rows
        newest = (lambda: self.newest_params()) if partial else None
        return engine_sampler(Engine(self.graphdef, num_slots=slots, max_prompt_len=prompt_len,
                                     steps_per_dispatch=r.engine_steps,
                                     compact=r.engine_compact, **common), group_size, newest)
      P, G, k = r.num_prompts, r.group_size, cfg.val.samples_per_prompt
      partial = r.partial_rollouts
      self.sample = engine(G, r.max_prompt_len, P * G, partial)
      sample_next = engine(1, r.max_prompt_len + (r.max_total_tokens or r.max_new_tokens), P * G,
                           partial)
      # Validation measures the params of one step: never partial.
      self.sample_val = engine(k, r.max_prompt_len, cfg.val.batch_size * k)
    else:
      rows = lambda f: _rows_over(self.rollout_mesh, f)
      self.sample = rows(make_sampler(self.graphdef, num_samples=r.group_size, **common))
      # Later turns: every row continues its own context (compiled only if a task has them).
      sample_next = rows(make_sampler(self.graphdef, num_samples=1, **common))
      self.sample_val = rows(make_sampler(self.graphdef,
                                          num_samples=cfg.val.samples_per_prompt, **common))
    self.budget = Budget(max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
                         max_total_tokens=r.max_total_tokens or r.max_new_tokens,
                         max_turns=r.max_turns)
    fetch = parallel.distributed.fetch
    self.loop = MultiTurn(self.tok, self.envs, self.budget, r.group_size, self.sample,
                          sample_next, fetch, cfg.env.timeout_s)
    self.val_loop = MultiTurn(self.tok, self.envs, self.budget, cfg.val.samples_per_prompt,
                              self.sample_val, sample_next, fetch, cfg.env.timeout_s)

  def for_rollout(self, params):
    """`params` placed for generation: as they are when colocated; else a copy on the rollout
    mesh, resharded shard by shard (no leaf is gathered whole onto one device). Params already
    there are returned as they are."""
    if self.rollout_mesh is self.mesh:
      return params
    leaf = jax.tree.leaves(params)[0]
    if leaf.sharding == jax.tree.leaves(self._rollout_shardings)[0]:
      return params
    return parallel.reshard(params, self._rollout_shardings)

  def row_problem(self, task) -> tuple[str, str] | None:
    """What makes a task row unusable, as (reason, detail), or None."""
    if task.env not in self.envs:
      return "unknown_task", f"task {task.env!r} is not one of {sorted(self.envs)}"
    if not task.prompt.strip():
      return "empty_prompt", "the prompt is empty"
    try:
      n = len(self.tok.encode_prompt(task.prompt))
    except ValueError as e:
      return "undecodable", str(e)
    if n > self.cfg.rollout.max_prompt_len:
      return "too_long", (f"{n} prompt tokens, over rollout.max_prompt_len="
                          f"{self.cfg.rollout.max_prompt_len}")
    return None

  # ---- batches -------------------------------------------------------------------------------

  def prompts(self, problems) -> tuple[np.ndarray, np.ndarray]:
    return left_pad([self.tok.encode_prompt(p.prompt) for p in problems],
                    self.cfg.rollout.max_prompt_len,
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

  def validate(self, params, split: str = "val") -> dict:
    """One validation pass over a split, through the training loop's multi-turn rollouts.

    `val.samples_per_prompt = k` samples per prompt at `val.temperature` (0 = greedy). A row is
    solved when its episode reward is >= 1 (every built-in environment gives 1 for a solved
    task). Metrics: `val/accuracy` (solved rows), `val/pass@k` (prompts with a solved sample),
    `val/reward`, `val/avg_length` (generated tokens per row), turn and outcome statistics and
    `val/env_calls`. Rows go through partition `val` of the data plane and are freed after the
    pass. The last chunk of prompts is padded by repetition to keep one shape; padding rows
    count for nothing.
    """
    v = self.cfg.val
    params = self.for_rollout(params)
    tasks = self.source.split(split)
    bs, k = v.batch_size, v.samples_per_prompt
    self._passes += 1
    metas, eps = [], []
    try:
      for start in range(0, len(tasks), bs):
        chunk = tasks[start:start + bs]
        padded = chunk + [chunk[-1]] * (bs - len(chunk))
        ep = self.val_loop.run(params, padded, jax.random.key(self.cfg.seed), request_base=0,
                               version=0, temperature=v.temperature)
        real = np.arange(bs * k) < len(chunk) * k
        meta = BatchMeta.mint("val", f"v{self._passes}/{start}",
                              group_ids=start + np.arange(bs * k) // k, lengths=ep.mask.sum(1),
                              versions=np.zeros(bs * k),
                              tags={"reward": ep.rewards, "real": real.astype(np.float32)})
        metas.append(self.data.put(meta, {"tokens": ep.tokens, "mask": ep.mask,
                                          "completion_valid": ep.valid}))
        eps.append((ep, real))
      rewards = np.concatenate([m.tags["reward"] for m in metas])
      real = np.concatenate([m.tags["real"] for m in metas]) > 0
      lengths = np.concatenate([m.lengths for m in metas])
      solved = (np.nan_to_num(rewards, nan=0.0) >= 1.0 - 1e-6)[real].reshape(-1, k)
      out = {"val/accuracy": float(solved.mean()), f"val/pass@{k}": float(solved.any(1).mean()),
             "val/reward": finite_mean(rewards[real]),
             "val/avg_length": float(lengths[real].mean())}
      turns = np.concatenate([e.turns[m] for e, m in eps])
      out["val/turns/mean"] = float(turns.mean())
      for key in ("terminated", "truncated", "failed"):
        out[f"val/{key}_frac"] = float(np.concatenate([getattr(e, key)[m] for e, m in eps]).mean())
      out["val/env_calls"] = float(sum(e.env_calls for e, _ in eps))
      if len(self.envs) > 1:  # mixed tasks: accuracy per task too
        env_of = np.array([t.env for e, m in eps for t, keep in zip(e.tasks, m) if keep])
        flat = solved.reshape(-1)
        for name in self.envs:
          rows = env_of == name
          if rows.any():
            out[f"val/{name}/accuracy"] = float(flat[rows].mean())
      return out
    finally:
      for m in metas:
        self.data.discard(m)


def _logprob_impl(cfg) -> str | None:
  """`loss.logprob_impl` as `StepConfig` takes it ("auto" = the backend's default)."""
  return None if cfg.loss.logprob_impl == "auto" else cfg.loss.logprob_impl


def rl_step_config(cfg, shards: int = 1) -> StepConfig:
  """The RL train step's static settings from a validated run config whose batch rows are split
  over `shards` devices (mesh data x fsdp; it sizes auto micro-batching)."""
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
                    adv_clip=a.clip or None,
                    num_microbatches=config_lib.run_microbatches(cfg, shards),
                    logprob_impl=_logprob_impl(cfg))


def warmup(parts: Parts, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress,
           stop=None) -> dict:
  """Supervised warm-up; a stop signal ends it early (it is not checkpointed: a resumed run
  starts from the first RL checkpoint, and a run stopped before one starts over)."""
  cfg = parts.cfg.sft
  if not cfg.enabled or cfg.max_steps == 0:
    return {"sft/steps": 0}
  opt = make_optimizer(cfg.learning_rate, b1=parts.cfg.train.b1, b2=parts.cfg.train.b2,
                       grad_clip=parts.cfg.train.grad_clip)
  step_cfg = StepConfig(loss="sft", logprob_impl=_logprob_impl(parts.cfg))
  step_fn, init_state = build_train_step(parts.graphdef, opt, step_cfg, parts.mesh, parts.params)
  state = init_state(parts.params)
  rng = np.random.default_rng([parts.cfg.seed, 1])
  timer = metrics_lib.Timer()
  acc, steps = 0.0, 0
  progress.say(f"warm-up: supervised steps until dev accuracy >= {cfg.stop_accuracy}")
  for steps in range(1, cfg.max_steps + 1):
    batch = parts.sft_batch(parts.task.sample(rng, cfg.batch_size))
    state, m = step_fn(state, to_rows(batch, parts.mesh))
    row = {"phase": "sft", "step": steps, "sft/loss": m["loss"]}
    if steps % cfg.eval_every == 0:
      acc = parts.validate(state.params, "dev")["val/accuracy"]
      row["sft/dev_accuracy"] = acc
      progress.update(steps, cfg.max_steps, f"loss {float(m['loss']):.3f} | dev accuracy {acc:.3f}"
                      f" | {timer():.0f} s", force=False)
    out.write(row)
    if steps % cfg.eval_every == 0 and acc >= cfg.stop_accuracy:
      break
    if stop is not None and stop():
      progress.newline()
      progress.say(f"warm-up: stopped by signal at step {steps}; nothing saved (warm-up is "
                   "not checkpointed)")
      return {"sft/steps": steps, "sft/stopped": True}
  progress.newline()
  stopped = "reached" if acc >= cfg.stop_accuracy else "hit sft.max_steps before reaching"
  progress.say(f"warm-up: {steps} steps, {timer():.1f} s, dev accuracy {acc:.3f} ({stopped} "
               f"{cfg.stop_accuracy})")
  parts.params = state.params
  return {"sft/steps": steps, "sft/dev_accuracy": acc, "sft/time_s": timer()}


def _train_fields(cfg) -> tuple[str, ...]:
  """The data-plane fields the train step reads (`TrainBatch` in field order)."""
  return tuple(f for f in TrainBatch._fields if f != "rollout_logprobs" or cfg.rollout.logprobs)


# Per-row outcome arrays of an episode batch that stay on the host (tags), not device fields.
_HOST_ROWS = ("turns", "terminated", "truncated", "failed")


class Rollouts:
  """The rollout side of RL, run by the worker thread: sample, score, filter, store.

  Each batch's rows go into partition `train` of the data plane, keyed once here; what crosses the
  lag ring is the batch's metadata alone. Group ids come from one counter, so no two groups of a
  run share an id (the pending cache mixes generations). Only the worker thread calls `produce`,
  one batch after another, so the prompt stream does not depend on timing.
  """

  def __init__(self, parts: Parts, gate: LagGate):
    cfg = parts.cfg
    self.parts, self.gate, self.r, self.ds = parts, gate, cfg.rollout, cfg.dynamic_sampling
    self.rng = np.random.default_rng([cfg.seed, 2])
    self.key = jax.random.key(cfg.seed)
    self.next_group = 0

  def _sample(self, params, tasks, key, request_base: int, version: int, info: dict) -> dict:
    """Episodes of G samples for each of `tasks`: per-row host arrays, rows in group order."""
    r = self.r
    ep = self.parts.loop.run(params, tasks, key, request_base, version, r.temperature, r.top_k,
                             r.top_p)
    info["env/calls"] = info.get("env/calls", 0) + ep.env_calls
    for reason in ep.fail_reasons:
      if reason is not None:
        k = f"env/failed/{reason.split(':', 1)[0]}"
        info[k] = info.get(k, 0) + 1
    return dict(prompt_tokens=ep.prompt_tokens, prompt_valid=ep.prompt_valid, tokens=ep.tokens,
                mask=ep.mask, completion_valid=ep.valid, rollout_logprobs=ep.logprobs,
                policy_version=ep.policy_version, rewards=ep.rewards, turns=ep.turns,
                terminated=ep.terminated, truncated=ep.truncated, failed=ep.failed)

  def _store(self, prefix: str, rows: dict, place: bool) -> BatchMeta:
    """Mints keys for `rows`, puts them in the data plane; returns their metadata.

    With `place`, rows are first put in length-balanced data-shard order (so the trainer's read
    is the stored arrays themselves); otherwise in generation order. The raw reward (NaN for a
    failed row) is the host tag dynamic sampling and metrics read; the device field has 0 there
    (the row is out of the loss and the advantages anyway: its loss mask is empty).
    """
    dp, G = self.parts.data, self.r.group_size
    n = len(rows["rewards"])
    groups = self.next_group + np.arange(n // G)
    self.next_group += n // G
    mask = rows["mask"]
    versions = row_versions(rows["policy_version"], mask)
    meta = BatchMeta.mint(
        "train", prefix, group_ids=np.repeat(groups, G), lengths=mask.sum(1),
        versions=np.nan_to_num(versions["first"]).astype(np.int64),
        tags={"reward": rows["rewards"], **{k: rows[k].astype(np.float32) for k in _HOST_ROWS},
              **{f"version/{k}": v for k, v in versions.items()}})
    arrays = {k: v for k, v in rows.items() if k not in _HOST_ROWS}
    arrays.update(rewards=np.nan_to_num(rows["rewards"], nan=0.0).astype(np.float32),
                  group_id=np.repeat(groups, G).astype(np.int32),
                  temperature=np.full(n, self.r.temperature, np.float32))
    if not self.r.logprobs:
      del arrays["rollout_logprobs"]
    if place:
      perm, _ = balance_rows(meta.lengths, dp.num_row_shards())
      meta = meta.subset(perm)
      arrays = {k: v[perm] for k, v in arrays.items()}
    return dp.put(meta, arrays)

  def produce(self, batch_id: int, params, version: int) -> dict:
    """One training batch (P whole groups) with params `version`; returns its ring item."""
    st = metrics_lib.Timer()
    r, ds, P, G = self.r, self.ds, self.r.num_prompts, self.r.group_size
    step = batch_id + 1
    key = jax.random.fold_in(self.key, step)
    source = self.parts.source
    tasks = source.sample(self.rng, P)
    info: dict = {}
    if ds.enabled and r.lag == 0:
      # Synchronous: whole generation batches into a pending cache until P groups are ready.
      def generate(attempt):
        batch = tasks if attempt == 1 else source.sample(self.rng, P)
        k = key if attempt == 1 else jax.random.fold_in(key, attempt)
        rows = self._sample(params, batch, k, step * P * G, version, info)
        return self._store(f"b{batch_id}/g{attempt}", rows, place=False)

      meta, ds_info = dynamic_sampling.fill_from_generations(
          generate, num_groups=P, max_gen_batches=ds.max_gen_batches, tol=ds.tol,
          reward_field=ds.reward_field, discard=self.parts.data.discard)
      info.update(ds_info)
      perm, _ = balance_rows(meta.lengths, self.parts.data.num_row_shards())
      meta = meta.subset(perm)
      self.gate.add("filtered", info["dynamic_sampling/dropped_groups"])
    else:
      # One generation; a filtered group is re-sampled into its own slot (lag > 0 dynamic
      # sampling, or a group whose every episode failed).
      seen = []

      def sample(slots, attempt):
        k = key
        if attempt:
          for s in slots:
            tasks[s] = source.sample(self.rng, 1)[0]
          k = jax.random.fold_in(key, attempt)
        rows = self._sample(params, tasks, k, step * P * G, version, info)
        return [{f: v[s * G:(s + 1) * G] for f, v in rows.items()} for s in slots]

      def keep(group):
        seen.append(group["rewards"])
        if ds.enabled:
          return dynamic_sampling.keep_group(group[_REWARD_ARRAY[ds.reward_field]], ds.tol)
        return bool(np.any(np.isfinite(group["rewards"])))

      cap = dict(max_regenerations=r.max_regenerations)
      if ds.enabled:
        cap = dict(max_regenerations=ds.max_gen_batches - 1,
                   cap_name="dynamic_sampling.max_gen_batches", cap_value=ds.max_gen_batches)
      groups, counts = fill_batch(batch_id, P, sample, keep, **cap)
      for name in ("regenerated", "filtered"):  # reported by the gate as pipeline/<name>
        self.gate.add(name, counts[name])
      rows = {f: np.concatenate([g[f] for g in groups]) for f in groups[0]}
      meta = self._store(f"b{batch_id}", rows, place=True)
      if ds.enabled:  # regeneration never over-generates: nothing valid is discarded
        info.update(dynamic_sampling.batch_metrics(
            np.concatenate(seen), rows["rewards"], attempts=counts["attempts"],
            dropped=counts["filtered"], discarded=0))
    return {"meta": meta, "submit_version": version, "sample_time_s": st(), "info": info}


# Rollout reward tags -> the per-group host array holding them.
_REWARD_ARRAY = {"reward": "rewards"}


class Stop:
  """Set by SIGTERM / SIGINT (preemption, Ctrl-C): the run checkpoints and exits cleanly.

  The handler only records the signal; the trainer acts on it between steps. A second signal
  restores the default handlers, so a second Ctrl-C interrupts at once.
  """

  def __init__(self):
    self.signal: int | None = None

  def __call__(self) -> bool:
    return self.signal is not None

  def handler(self, signum, frame) -> None:
    import signal as signal_lib
    if self.signal is not None:
      signal_lib.signal(signal_lib.SIGINT, signal_lib.default_int_handler)
      signal_lib.signal(signal_lib.SIGTERM, signal_lib.SIG_DFL)
    self.signal = signum


class TrainingHalted(RuntimeError):
  """The run stopped itself (e.g. `train.max_skipped_updates`) after saving a checkpoint."""


def _json_num(x):
  """Numbers for a checkpoint's JSON: floats as repr strings (exact, NaN-safe), ints as is."""
  return repr(float(x)) if isinstance(x, (float, np.floating)) else int(x)


def _from_json_num(x):
  return float(x) if isinstance(x, str) else x


def _stored_fields(cfg) -> tuple[str, ...]:
  return _train_fields(cfg) + ("policy_version",)


def _ring_snapshot(parts: Parts, items: dict, fields) -> tuple[dict, dict]:
  """The delivered, unpulled batches as (device arrays, JSON metadata), by batch id."""
  arrays, host = {}, {}
  for bid, item in items.items():
    meta = item["meta"]
    got = parts.data.get(meta, fields)
    arrays[str(bid)] = got
    host[str(bid)] = {"meta": meta.to_json(), "submit_version": item["submit_version"],
                      "sample_time_s": item["sample_time_s"],
                      "info": {k: _json_num(v) for k, v in item["info"].items()},
                      "shapes": {f: [list(a.shape), a.dtype.str] for f, a in got.items()}}
  return arrays, host


def _ring_target(parts: Parts, host_ring: dict) -> dict:
  rows = parallel.batch_sharding(parts.mesh)
  return {bid: {f: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=rows)
                for f, (shape, dtype) in h["shapes"].items()} for bid, h in host_ring.items()}


def _ring_restore(parts: Parts, arrays: dict, host_ring: dict) -> dict[int, dict]:
  """Puts checkpointed batches back in the data plane; returns their ring items by batch id."""
  items = {}
  for bid, h in host_ring.items():
    meta = parts.data.put(BatchMeta.from_json(h["meta"]), arrays[bid])
    items[int(bid)] = {"meta": meta, "submit_version": h["submit_version"],
                       "sample_time_s": h["sample_time_s"],
                       "info": {k: _from_json_num(v) for k, v in h["info"].items()}}
  return items


def build_rl_step(parts: Parts) -> tuple[Callable, Callable]:
  """The RL train step and its state initialiser for `parts` (`build_train_step` with the run's
  optimizer, schedule and step config)."""
  cfg = parts.cfg
  t = cfg.train
  opt = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                       grad_clip=t.grad_clip, warmup_steps=t.warmup_steps,
                       schedule=t.lr_schedule, total_steps=t.steps, final_frac=t.final_lr_frac)
  step_cfg = rl_step_config(cfg, parts.mesh.shape["data"] * parts.mesh.shape["fsdp"])
  return build_train_step(parts.graphdef, opt, step_cfg, parts.mesh, parts.params)


def rl_batch_spec(cfg) -> TrainBatch:
  """Shapes and dtypes (`jax.ShapeDtypeStruct`) of every RL train batch of a run: P x G rows of
  `rollout.max_prompt_len` prompt and `max_total_tokens or max_new_tokens` completion tokens, as
  the data plane hands them to the step (None where the run keeps no such field)."""
  r = cfg.rollout
  b, lp, n = r.num_prompts * r.group_size, r.max_prompt_len, r.max_total_tokens or r.max_new_tokens
  s = jax.ShapeDtypeStruct
  return TrainBatch(
      prompt_tokens=s((b, lp), jnp.int32), prompt_valid=s((b, lp), jnp.bool_),
      tokens=s((b, n), jnp.int32), mask=s((b, n), jnp.bool_),
      rollout_logprobs=s((b, n), jnp.float32) if r.logprobs else None,
      rewards=s((b,), jnp.float32), group_id=s((b,), jnp.int32),
      temperature=s((b,), jnp.float32), completion_valid=s((b, n), jnp.bool_))


class CompileAhead:
  """Compiles the RL train step on a daemon thread (`compile_step`), so that its compilation
  overlaps the warm-up and the first batch's generation instead of following them.

  Only a head start: a failure here is kept and ignored (the first real call compiles and reports
  it), and `wait` gives up after `timeout_s`, after which the call compiles for itself.
  """

  def __init__(self, parts: Parts, step: tuple[Callable, Callable], timeout_s: float = 600.0):
    self.error: BaseException | None = None
    self.timeout_s = timeout_s
    step_fn, init_state = step
    spec = rl_batch_spec(parts.cfg)
    # Shapes only, taken now: the warm-up replaces (and donates) the params while this runs.
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          parts.params)

    def work():
      try:
        compile_step(step_fn, init_state, params, spec)
      except BaseException as e:  # noqa: BLE001  (reported by the real call, not here)
        self.error = e

    self._thread = threading.Thread(target=work, name="jaxrl-compile-ahead", daemon=True)
    self._thread.start()

  def wait(self) -> bool:
    """True when the compile finished (successfully or not) within the timeout."""
    self._thread.join(self.timeout_s)
    return not self._thread.is_alive()


def rl(parts: Parts, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress, *,
       ckpt: checkpoint.Checkpointer | None = None, resume: tuple | None = None,
       warm: dict | None = None, stop=None,
       on_batch: Callable[[int, TrainBatch], TrainBatch] | None = None,
       rl_step: tuple[Callable, Callable] | None = None,
       ahead: CompileAhead | None = None) -> dict:
  """GRPO for `train.steps` steps (see the module docstring).

  Checkpoints (`ckpt`, every `checkpoint.every` steps, at the end, on a stop signal and when
  `train.max_skipped_updates` halts the run) hold the train state, the rollout batches already
  made for later steps (the lag ring), the rollout RNG and counters, the metrics line count and
  the validation results so far, so `resume = (reader, step, host)` continues exactly as if the
  run had not stopped. Before a save every validation pass in flight is finished and logged and
  the rollout worker is left idle with the ring full.

  `on_batch(step, batch) -> batch`, if given, sees (and may replace) every train batch just
  before its step: a seam for fault injection and debugging. `rl_step` is `build_rl_step(parts)`
  when the caller built it already (None: built here); `ahead`, a `CompileAhead` compiling that
  step, is waited for before the first update.
  """
  cfg = parts.cfg
  r, t, v, c = cfg.rollout, cfg.train, cfg.val, cfg.checkpoint
  P, G = r.num_prompts, r.group_size
  stop = stop or (lambda: False)
  step_fn, init_state = rl_step or build_rl_step(parts)
  state = init_state(parts.params)
  L = r.lag
  fields = _train_fields(cfg)
  # Several processes must launch computations in the same order: validation runs inline there.
  validator = Validator(lambda step, params: parts.validate(params),
                        asynchronous=v.asynchronous and jax.process_count() == 1,
                        max_wait_s=v.max_wait_s)
  val_acc: dict[int, float] = {}

  def log_validation(results):
    for vstep, m in results:
      val_acc[vstep] = m["val/accuracy"]
      out.write({"phase": "val", "step": vstep, **m})

  timer = metrics_lib.Timer()
  gate = LagGate(L, r.stall_timeout_s)
  rollouts = Rollouts(parts, gate)
  handoff = ParamsHandoff()
  if r.partial_rollouts:
    parts.newest_params = handoff.latest
  skipped = 0
  start = 0
  if resume is not None:
    reader, start, host = resume
    restored, _ = reader.restore(start, {"train": state,
                                         "ring": _ring_target(parts, host["ring"])})
    state = restored["train"]
    gate.restore(host["gate"], _ring_restore(parts, restored["ring"], host["ring"]))
    rollouts.rng = checkpoint.restore_numpy_rng(host["rng"])
    rollouts.next_group = host["next_group"]
    val_acc = {int(k): _from_json_num(a) for k, a in host["val_accuracy"].items()}
    skipped = host["skipped_updates"]
    progress.say(f"resumed from step {start} ({reader.directory})")

  def save(step: int) -> None:
    if ckpt is None:
      return
    log_validation(validator.wait())  # every pass up to `step` is in the metrics first
    ring_arrays, ring_host = _ring_snapshot(parts, gate.quiesce(r.stall_timeout_s),
                                            _stored_fields(cfg))
    host = {"step": step, "rng": checkpoint.numpy_rng_state(rollouts.rng),
            "next_group": rollouts.next_group, "gate": gate.checkpoint_state(),
            "ring": ring_host, "metrics_lines": len(out.rows),
            "val_accuracy": {str(k): _json_num(a) for k, a in val_acc.items()},
            "skipped_updates": skipped, "warmup": warm or {}}
    ckpt.save(step, {"train": state, "ring": ring_arrays}, host)

  def publish(version):
    # Published params are copies: the train step donates its own buffers, and the worker (or a
    # validation pass) may still be reading an older version. Disaggregated, the copy is the
    # reshard onto the rollout mesh.
    params = parts.for_rollout(state.params) if parts.rollout_mesh is not parts.mesh else \
        jax.tree.map(jnp.copy, state.params)
    handoff.publish(version, params)
    return params

  ds = " with dynamic sampling" if cfg.dynamic_sampling.enabled else ""
  progress.say(f"RL: {t.steps} GRPO steps of {P} prompts x {G} samples, lag {L}{ds}")
  published = publish(start)
  if start == 0 and v.at_start:
    validator.submit(0, published)
  stopped_at = None
  try:
    # One process: rollouts on their own thread. Several: inline, so that every process launches
    # the same computations in the same order (same batches, versions and staleness).
    inline = jax.process_count() > 1
    worker_cls = InlineWorker if inline else RolloutWorker
    with worker_cls(gate, handoff, rollouts.produce, L) as worker:
      for step in range(start + 1, t.steps + 1):
        st = metrics_lib.Timer()
        if inline:
          worker.catch_up()
        batch_id, item = gate.pull()
        consumer = step - 1  # versions published so far: one per completed train step
        # The next batch to start is >= batch_id + 1 and needs version >= batch_id + 1 - L.
        handoff.prune_below(max(0, batch_id + 1 - L))
        meta = item["meta"]
        batch = _read_batch(parts.data, meta, fields)
        if on_batch is not None:
          batch = on_batch(step, batch)
        if ahead is not None:
          ahead.wait()
          ahead = None
        state, m = step_fn(state, batch)
        m = parallel.distributed.fetch(m)
        del batch
        parts.data.discard(meta)  # the step consumed these rows
        skipped += int(m["skipped_nonfinite"])
        published = publish(step)
        if step % v.every == 0 or (v.at_end and step == t.steps):
          validator.submit(step, published)
        dt = st()
        pipe = gate.stats()
        rewards = meta.tags["reward"]
        mixed = [np.ptp(rewards[g]) > 0 for g in meta.group_rows()]
        n = max(len(meta), 1)
        # (batch_id, slot, submit_version, consume_version, seed) make an async run replayable
        # synchronously: batch b used params version submit_version and the stream of `seed`.
        row = {"phase": "rl", "step": step, "batch_id": batch_id, "slot": batch_id % (L + 1),
               "submit_version": item["submit_version"], "consume_version": consumer,
               "reward": finite_mean(rewards), "filtered_reward": finite_mean(rewards),
               **item["info"],
               "reward/mixed_groups": float(np.mean(mixed)),
               "completion_len": float(meta.lengths.mean()),
               "env/turns/mean": float(meta.tags["turns"].mean()),
               **{f"env/{k}_frac": float(meta.tags[k].sum()) / n
                  for k in ("terminated", "truncated", "failed")}, **m,
               "train/skipped_updates": skipped,
               **{f"data/skipped/{k}": n for k, n in parts.source.skipped.items()},
               **staleness_from_rows({k: meta.tags[f"version/{k}"]
                                      for k in ("first", "last", "mean")}, consumer),
               **{f"pipeline/{k}": v for k, v in pipe.items()},
               "data_plane/train_rows": parts.data.stats()["train/rows"],
               "val/trainer_wait_s": validator.wait_s,
               "perf/step_time_s": dt, "perf/sample_time_s": item["sample_time_s"],
               "perf/elapsed_s": timer(),
               "perf/gen_tokens_per_s": float(meta.lengths.sum()) / dt}
        out.write(row)
        log_validation(validator.poll())
        acc = val_acc[max(val_acc)] if val_acc else float("nan")
        progress.update(step, t.steps, f"reward {row['reward']:.3f} | val {acc:.3f} | "
                        f"{dt:.2f} s/step | {row['perf/gen_tokens_per_s']:.0f} tok/s")
        halt = t.max_skipped_updates and skipped > t.max_skipped_updates
        if (c.every and step % c.every == 0) or step == t.steps or stop() or halt:
          save(step)
        if halt:
          raise TrainingHalted(
              f"{skipped} updates were skipped for non-finite gradients, more than "
              f"train.max_skipped_updates={t.max_skipped_updates}; checkpoint of step {step} "
              "saved. Check the rewards and the learning rate, then resume.")
        if stop():
          stopped_at = step
          break
    if stopped_at is None:
      log_validation(validator.wait())
  finally:
    validator.close()
    parts.data.clear("train")  # batches still in the ring when the run ends or fails
  progress.newline()
  parts.params = state.params
  first = val_acc.get(0, float("nan"))
  last = val_acc[max(val_acc)] if val_acc else float("nan")
  return {"val/accuracy_before_rl": first, "val/accuracy_after_rl": last,
          "rl/time_s": timer(), "rl/steps": t.steps, "rl/stopped_at": stopped_at}


def _read_batch(data: DataPlane, meta: BatchMeta, fields: tuple[str, ...]) -> TrainBatch:
  """The train step's batch: its fields read from the data plane, rows in `meta` order."""
  arrays = data.get(meta, fields)
  return TrainBatch(**{f: arrays.get(f) for f in TrainBatch._fields})


def run(cfg: ConfigDict, run_dir: str, mesh_shape: config_lib.MeshShape, stop=None) -> dict:
  """Runs warm-up and RL; writes config.json, metrics.jsonl, curves.png, summary.json, and
  checkpoints under `<run_dir>/checkpoints`.

  `resume` (auto | none | a path) picks a checkpoint to continue from: the run then skips the
  warm-up, and, when the checkpoint is this run directory's own, cuts `metrics.jsonl` back to
  the lines written when it was saved, so the resumed run's metrics continue the file exactly.
  With several processes every process runs this whole function (the same computations in the
  same order); only process 0 prints and writes files. `stop()` true (a signal) makes the run
  checkpoint and return early with `rl/stopped_at` set.
  """
  total = metrics_lib.Timer()
  main = parallel.distributed.is_main()
  own_dir = checkpoint.checkpoint_dir(run_dir)
  resume_dir = checkpoint.resolve_resume(cfg.resume, run_dir)
  c = cfg.checkpoint
  ckpt = checkpoint.Checkpointer(own_dir, keep=c.keep, async_save=c.async_save)
  resume = None
  keep_lines = None
  if resume_dir is not None:
    same = os.path.abspath(resume_dir) == os.path.abspath(own_dir)
    reader = ckpt if same else checkpoint.Checkpointer(resume_dir, read_only=True)
    rstep, host = reader.read_host()
    resume = (reader, rstep, host)
    keep_lines = host["metrics_lines"] if same else None
  if main:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
      json.dump(config_lib.to_dict(cfg), f, indent=2)
    if cfg.model.hf_path:
      # What `python -m jaxrl.export` needs besides the weights, kept with the run so the export
      # does not depend on the starting directory still being there.
      export.copy_metadata(cfg.model.hf_path, os.path.join(run_dir, export.METADATA_DIR))
  quiet = None if main else open(os.devnull, "w")
  progress = metrics_lib.Progress(stream=quiet, every=cfg.log_every)
  out = metrics_lib.MetricsWriter(run_dir if main else None, keep_lines=keep_lines)
  try:
    parts = Parts(cfg, mesh_shape)
    n_params = sum(x.size for x in jax.tree.leaves(parts.params))
    progress.say(f"jaxrl | run dir {run_dir} | task {cfg.task.name} | model {n_params:,} params | "
                 f"mesh {mesh_shape.data}x{mesh_shape.fsdp}x{mesh_shape.tensor} on "
                 f"{jax.devices()[0].platform}")
    if mesh_shape.disaggregated:
      first = mesh_shape.train_devices
      progress.say(f"disaggregated: train on devices 0-{mesh_shape.size - 1}, rollouts on "
                   f"devices {first}-{first + mesh_shape.rollout_devices - 1} (mesh "
                   f"{'x'.join(map(str, mesh_shape.rollout_shape))})")
    rl_step = build_rl_step(parts)
    # One process: compile the RL step while the warm-up runs (several processes compile in
    # lockstep on the main thread, as they launch everything else).
    ahead = CompileAhead(parts, rl_step) if jax.process_count() == 1 else None
    if resume is not None:
      warm = {k: _from_json_num(x) for k, x in resume[2]["warmup"].items()}
    else:
      warm = warmup(parts, out, progress, stop)
      if warm.get("sft/stopped"):
        return warm
    summary = {**warm, **rl(parts, out, progress, ckpt=ckpt, resume=resume,
                            warm={k: _json_num(x) for k, x in warm.items()}, stop=stop,
                            rl_step=rl_step, ahead=ahead)}
    if summary["rl/stopped_at"] is not None:
      progress.say(f"stopped by signal after step {summary['rl/stopped_at']}: checkpoint saved in "
                   f"{own_dir}; continue with --config.run_dir={run_dir} (resume=auto)")
      return summary
    summary["val/rl_gain"] = summary["val/accuracy_after_rl"] - summary["val/accuracy_before_rl"]
    summary["total_time_s"] = total()
    out.write({"phase": "summary", **summary})
  finally:
    ckpt.close()
    if resume is not None and resume[0] is not ckpt:
      resume[0].close()
    out.close()
    if quiet is not None:
      quiet.close()
  if not main:
    return summary
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
