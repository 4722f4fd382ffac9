"""The RL train step of a run: its static settings from the config (`rl_step_config`), the jitted
step (`build_rl_step`), the shapes of every batch it takes (`rl_batch_spec`) and its compilation
ahead of time on a thread (`CompileAhead`), so it overlaps the warm-up instead of following it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl import config as config_lib
from jaxrl import losses, parallel
from jaxrl.envs.agent_task import is_agent
from jaxrl.models import ModelConfig, abstract_model
from jaxrl.models import lora as lora_lib
from jaxrl.models import moe
from jaxrl.learner.step import StepConfig, build_train_step, compile_step, make_optimizer
from jaxrl.core.names import CORRECTION_KEYS, lag_bound
from jaxrl.core.types import TrainBatch


def logprob_impl(cfg) -> str | None:
  """`loss.logprob_impl` as `StepConfig` takes it ("auto" = the backend's default)."""
  return None if cfg.loss.logprob_impl == "auto" else cfg.loss.logprob_impl


def rl_step_config(cfg, shards: int = 1) -> StepConfig:
  """The RL train step's static settings from a validated run config whose batch rows are split
  over `shards` devices (mesh data x fsdp; it sizes auto micro-batching)."""
  lo = cfg.loss
  objective = losses.ObjectiveConfig(
      policy=lo.policy,
      ratio_base=("rollout" if lag_bound(cfg.rollout) > 0 else "trainer") if lo.ratio_base == "auto"
      else lo.ratio_base,
      eps_low=lo.eps_low, eps_high=lo.eps_high,
      dual_clip=lo.dual_clip or None, sapo_tau_pos=lo.sapo_tau_pos, sapo_tau_neg=lo.sapo_tau_neg,
      correction=losses.parse_correction(lo.correction),
      correction_params=losses.CorrectionParams(**{k: lo[k] for k in CORRECTION_KEYS}),
      reduction=lo.reduction, norm_len=lo.norm_len or None,
      rollout_kl_coef=cfg.rollout_kl.coef, rollout_kl_estimator=cfg.rollout_kl.estimator,
      rollout_kl_reduction=cfg.rollout_kl.reduction,
      ref_kl_coef=cfg.ref_kl.coef, ref_kl_estimator=cfg.ref_kl.estimator,
      ref_kl_reduction=cfg.ref_kl.reduction,
      ref_kl_importance_weighted=cfg.ref_kl.importance_weighted, entropy_coef=lo.entropy_coef,
      seq_logprob_error_threshold=lo.seq_logprob_error_threshold or None,
      distill_coef=cfg.distill.coef if cfg.distill.teacher else 0.0,
      distill_reward_weight=cfg.distill.reward_weight)
  a = cfg.advantage
  packing = bool(cfg.train.get("packing", False))  # absent from configs saved before it
  return StepConfig(loss="rl", objective=objective, advantage=a.estimator, adv_eps=a.eps,
                    adv_ddof=a.std_ddof, adv_clip=a.clip or None,
                    num_microbatches=1 if packing else config_lib.run_microbatches(cfg, shards),
                    shared_prompts=config_lib.shared_prompts(cfg),
                    pack_tokens=cfg.train.microbatch_tokens if packing else 0,
                    logprob_impl=logprob_impl(cfg), moe_aux_coef=cfg.loss.moe_aux_coef,
                    # absent from configs saved before it
                    routing_replay=cfg.get("moe", {}).get("routing_replay") == "rollout",
                    length_buckets=cfg.train.get("length_buckets", 0))


def lora_model(parts) -> ModelConfig | None:
  """The RL phase's model config with its LoRA adapters (`model.lora`), or None without LoRA."""
  m = lora_lib.with_lora(parts.model_cfg, parts.cfg.model.lora)
  return m if m.lora_rank else None


def build_rl_step(parts, params) -> tuple[Callable, Callable]:
  """The RL train step and its state initialiser for `parts` and params like `params`
  (`build_train_step` with the run's optimizer, schedule and step config).

  With LoRA (`model.lora.rank`) the step trains adapters on the model of `lora_model(parts)`
  at `model.lora.learning_rate` (0: `train.learning_rate`), and the initialiser takes the base
  model's params (what the warm-up returns) and attaches fresh adapters (`init_adapters` for
  `seed`; the adapted model equals its base) unless they hold some already."""
  cfg = parts.cfg
  t = cfg.train
  graphdef, lora = parts.graphdef, lora_model(parts)
  lr = t.learning_rate
  if lora is not None:
    graphdef = abstract_model(lora)[0]
    adapters = lora_lib.abstract_adapters(lora)
    params = lora_lib.join(params, adapters)
    lr = cfg.model.lora.learning_rate or lr
    shardings = parallel.param_shardings(adapters, parts.mesh)
  opt = make_optimizer(lr, b1=t.b1, b2=t.b2, eps=t.adam_eps,
                       weight_decay=t.weight_decay,
                       grad_clip=t.grad_clip, warmup_steps=t.warmup_steps,
                       schedule=t.lr_schedule, total_steps=t.steps, final_frac=t.final_lr_frac)
  step_cfg = rl_step_config(cfg, parts.mesh.shape["data"] * parts.mesh.shape["fsdp"])
  teacher = getattr(parts, "teacher", None)
  step, init_state = build_train_step(
      graphdef, opt, step_cfg, parts.mesh, params,
      teacher=None if teacher is None else (teacher.graphdef, teacher.params))
  if lora is None:
    return step, init_state

  def init_with_adapters(p, ref_params=None):
    if not lora_lib.has_adapters(p):
      p = lora_lib.join(p, lora_lib.init_adapters(lora, cfg.seed, shardings))
    return init_state(p, ref_params)

  return step, init_with_adapters


def rl_batch_spec(cfg) -> TrainBatch:
  """Shapes and dtypes (`jax.ShapeDtypeStruct`) of every RL train batch of a run: P x G rows of
  `rollout.max_prompt_len` prompt and `max_total_tokens or max_new_tokens` completion tokens, as
  the data plane hands them to the step (None where the run keeps no such field)."""
  r = cfg.rollout
  b, lp, n = r.num_prompts * r.group_size, r.max_prompt_len, r.max_total_tokens or r.max_new_tokens
  s, m = jax.ShapeDtypeStruct, cfg.model
  return TrainBatch(
      prompt_tokens=s((b, lp), jnp.int32), prompt_valid=s((b, lp), jnp.bool_),
      tokens=s((b, n), jnp.int32), mask=s((b, n), jnp.bool_),
      rollout_logprobs=s((b, n), jnp.float32) if r.logprobs else None,
      rewards=s((b,), jnp.float32), group_id=s((b,), jnp.int32),
      temperature=s((b,), jnp.float32), completion_valid=s((b, n), jnp.bool_),
      routing=s((b, n, m.num_layers, m.num_experts_per_tok), moe.ROUTING_DTYPE)
      if m.num_experts else None,
      completion_segment=s((b, n), jnp.int32) if is_agent(cfg.task.name) else None)


class CompileAhead:
  """Compiles the RL train step on a daemon thread (`compile_step`), so that its compilation
  overlaps the warm-up and the first batch's generation instead of following them.

  Only a head start: a failure here is kept and ignored (the first real call compiles and reports
  it), and `wait` gives up after `timeout_s`, after which the call compiles for itself.
  """

  def __init__(self, parts, step: tuple[Callable, Callable], params, timeout_s: float = 600.0):
    self.error: BaseException | None = None
    self.timeout_s = timeout_s
    step_fn, init_state = step
    spec = rl_batch_spec(parts.cfg)
    # Shapes only, taken now: the warm-up replaces (and donates) the params while this runs.
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          params)

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
