"""The pure training step: `step(state, batch) -> (state, metrics)`, one jitted function.

- The loss is `jaxrl.losses.objective` composed from `StepConfig.objective` (policy loss,
  corrections, reduction, rollout-KL, reference-KL and entropy terms), or the token-mean NLL for
  the supervised warm-up. Every term's denominator is its count over the *whole* batch, computed
  before the batch is split; each micro-batch's loss is divided by those global counts and the
  gradients are summed through `lax.scan`, so M micro-batches give the single-batch gradient
  exactly and an all-masked (padding) micro-batch adds exactly 0.
- Trainer log-probs and entropy come from the fused kernel (`jaxrl.kernels.fused_logprob`,
  `xla` on CPU, `pallas` on TPU/GPU): the `[B, N, V]` logits are never materialised.
- Advantages are computed over the whole batch before it is split, so a group may straddle
  micro-batches; rows with no loss token or a non-finite reward count as failed samples
  (advantage 0, excluded from their group's statistics; non-finite rewards are counted in
  `nonfinite_rewards`).
- The reference model (for the reference-KL term) lives in `TrainState.ref_params` and exists
  only when `objective.ref_kl_coef != 0`.
- A batch missing a field the objective needs (`rollout_logprobs` for corrections, rollout KL
  or sequence masking) is rejected on the host by `check_batch`, before the jitted call.
- A non-finite gradient skips the update (params and optimizer state unchanged, `step` not
  advanced) and sets `skipped_nonfinite`; nothing raises inside jit.
- Shardings are explicit: params and optimizer state by the logical-axis rules, batch rows over
  ('data', 'fsdp'), metrics replicated. Params and optimizer state are donated. The step traces
  under its mesh (`jax.sharding.use_abstract_mesh`), so the model keeps its activations split by
  rows over ('data', 'fsdp') too (`parallel.sharding.constrain_rows`) instead of following the
  weights' d_model split.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxrl import parallel
from jaxrl import losses
from jaxrl.kernels import fused_logprob
from jaxrl.losses import ObjectiveConfig
from jaxrl.models import lora as lora_lib
from jaxrl.models import moe
from jaxrl.models.logprobs import continuation_positions, left_positions
from jaxrl.models.model_config import KVCache
from jaxrl.core.types import TrainBatch, TrainState
from jaxrl.learner import packing, routing, widths as widths_lib
# The optimizer is built here too (callers import it with the step).
from jaxrl.learner.optimizer import learning_rate_schedule, make_optimizer  # noqa: F401


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of a train step (hashable; changing one recompiles, by design)."""

  loss: str = "rl"  # "rl": the composed objective below; "sft": token-mean NLL (warm-up)
  objective: ObjectiveConfig = ObjectiveConfig()
  advantage: str = "grpo"  # jaxrl.losses.ADVANTAGE_ESTIMATORS
  adv_eps: float = 1e-4
  adv_ddof: int = 0  # ddof of the std of grpo / grpo_batch_std (1 = sample std, as TRL)
  adv_clip: float | None = None  # clamp advantages to [-adv_clip, adv_clip]
  num_microbatches: int = 1
  logprob_impl: str | None = None  # jaxrl.kernels.fused_logprob impl; None = backend default
  logprob_chunk: int | None = None  # vocabulary chunk of the fused kernel; None = its default
  # Rows come in groups of this many consecutive rows with one prompt (GRPO's G samples per
  # prompt): the forward pass then runs each prompt once and the G completions attend to its keys
  # and values (`completion_hidden`). 0 or 1 = every row runs its own prompt. A batch whose
  # groups are not laid out so is detected in the step and not applied (`prompt_layout_errors`).
  shared_prompts: int = 0
  # With shared prompts: run the prompts and the completions as one packed set of positions
  # (`Transformer.grouped_forward`) instead of two passes through a repeated key/value cache.
  # None = when the step's rows are on one shard: on CPU measured faster (issue 22), and on every
  # backend the packed form is the one whose memory is linear in positions (its attention is
  # `model.attention`'s, blockwise for long rows, and its layers rematerialise; the two-pass
  # form's continuation pass attends densely through a repeated cache). The two-pass form keeps
  # rows split over the batch axes of a mesh. `pack_tokens` packs beyond one group per row.
  pack_prompts: bool | None = None
  # > 0: token-budget packing (`jaxrl.learner.packing`). Rows are laid end to end in packed rows
  # of this many positions, one per row shard in each micro-batch; micro-batches run until every
  # row has (their count follows the batch's tokens, `num_microbatches` is not used). 0: off.
  pack_tokens: int = 0
  # Mixture-of-experts models: the weight of the load-balancing loss (`moe.aux_loss`, logged as
  # `moe/aux_loss` whatever its weight), added per micro-batch divided by `num_microbatches`.
  moe_aux_coef: float = 0.0
  # Mixture-of-experts models: route the generated tokens to the sampler's experts
  # (`TrainBatch.routing`) in the policy's forward passes (`learner.routing`).
  routing_replay: bool = False
  # > 1: each batch runs with its prompts and completions cut to the columns its rows use,
  # rounded up to one of this many widths per budget (`jaxrl.learner.widths`; a program per
  # width used). 0 or 1: every batch at its full widths.
  length_buckets: int = 0

  def rollout_logprob_users(self) -> tuple[str, ...]:
    return self.objective.rollout_logprob_users() if self.loss == "rl" else ()

  def needs_reference(self) -> bool:
    return self.loss == "rl" and self.objective.ref_kl_coef != 0


def completion_hidden(model, batch: TrainBatch, group: int = 0,
                      lora_dropout_key: jax.Array | None = None, packed: bool = False,
                      replay: bool = False) -> jax.Array:
  """Final hidden states [B, N, D] that predict each completion token.

  `group` > 1: every `group` consecutive rows share one prompt (the first row's is used). The
  prompts run once ([B / group] rows) into a key/value cache, which is repeated to every row of
  the group; the completions then run over it (with `packed`, prompts and completions run as
  one packed set of positions instead: `Transformer.grouped_forward`). Same function as the
  per-row pass (each completion token attends to its own prompt and the completion tokens
  before it), with (Lp + G N) / (G (Lp + N)) of its dense work; the prompt's gradient sums over
  the group. `lora_dropout_key`: the model's LoRA dropout (training only). `batch.routing`: the
  sampler's experts of the generated tokens, replayed with `replay` (`learner.routing`).
  `batch.completion_segment`: rows of several causal sequences, run per row whatever `group`.
  """
  kw = {} if lora_dropout_key is None else {"lora_dropout_key": lora_dropout_key}
  lp = batch.prompt_tokens.shape[1]
  route = lambda prompt_len=0: {} if batch.routing is None else {
      "routing": routing.model_routing(batch.routing, prompt_len), "use_routing": replay}
  seen = batch.mask if batch.completion_valid is None else batch.completion_valid
  if batch.completion_segment is not None:  # per row (a later sequence sees no shared prompt)
    return packing.segmented_hidden(model, batch, seen, **kw, **route(lp))
  if group <= 1:
    seq = jnp.concatenate([batch.prompt_tokens, batch.tokens], axis=1)
    valid = jnp.concatenate([batch.prompt_valid, seen], axis=1)
    hidden, _ = model(seq, left_positions(valid), valid, **kw, **route(lp))
    # Position lp - 1 + j holds the state that predicts completion token j.
    return hidden[:, lp - 1 : -1]
  b, n = batch.tokens.shape
  first = lambda x: x.reshape(b // group, group, *x.shape[1:])[:, 0]
  prompts, prompt_valid = first(batch.prompt_tokens), first(batch.prompt_valid)
  rep = lambda x, axis=0: jnp.repeat(x, group, axis=axis)
  if packed:
    prompt_hidden, hidden = model.grouped_forward(prompts, prompt_valid, batch.tokens, seen, **kw,
                                                  **route())
    return jnp.concatenate([rep(prompt_hidden[:, -1:]), hidden[:, :-1]], axis=1)
  cache = KVCache.zeros(model.cfg, b // group, lp + n)
  # Both passes are differentiated: their layers rematerialise by `model.remat` as the per-row
  # pass's do (`remat=True`; a cache alone turns it off, for decode and prefill).
  prompt_hidden, cache = model(prompts, left_positions(prompt_valid), prompt_valid, cache=cache,
                               remat=True, **kw)
  stacked = model.cfg.scan_layers  # [L, rows, ...] caches; unrolled: a tuple of [rows, ...]
  per_row = lambda c: rep(c, 1) if stacked else tuple(map(rep, c))
  cache = KVCache(per_row(cache.k), per_row(cache.v), rep(cache.valid))
  positions = continuation_positions(prompt_valid, seen, group)
  hidden, _ = model(batch.tokens, positions, seen, cache=cache, cache_index=lp, remat=True, **kw,
                    **route())
  # The prompt's last state predicts completion token 0; completion state j - 1 predicts j.
  return jnp.concatenate([rep(prompt_hidden[:, -1:]), hidden[:, :-1]], axis=1)


def prompt_layout_ok(batch: TrainBatch, group: int) -> jax.Array:
  """True when every `group` consecutive rows have one prompt and one group id (the layout
  `completion_hidden` relies on)."""
  def same(x):
    g = x.reshape(x.shape[0] // group, group, -1)
    return jnp.all(g == g[:, :1])
  return same(batch.prompt_tokens) & same(batch.prompt_valid) & same(batch.group_id)


def completion_logprobs(graphdef: nnx.GraphDef, params, batch: TrainBatch, cfg: StepConfig,
                        with_entropy: bool = True, lora_dropout_key: jax.Array | None = None,
                        packed: tuple | None = None, router_stats: list | None = None
                        ) -> tuple[jax.Array, jax.Array | None]:
  """Trainer-side `(logp, entropy)` [B, N] through the fused kernel (no [B, N, V] logits).
  `params`: the model's `nnx.State`, or a tuple of states that together make it (LoRA: the
  frozen base and the adapters). `packed`: `(PackedBatch, micro-batch, shards)`: run that
  micro-batch's packed rows instead (`packing.packed_logprobs`). `router_stats`: a list that
  receives a mixture-of-experts model's `moe.RouterStats` of the passes (none for a dense one)."""
  model = nnx.merge(graphdef, *params) if isinstance(params, tuple) else nnx.merge(graphdef, params)
  if router_stats is None:  # the sampler's experts are the policy's (not a reference's, teacher's)
    batch = batch._replace(routing=None)
  if packed is not None:
    out = packing.packed_logprobs(model, *packed, batch, with_entropy=with_entropy,
                                  impl=cfg.logprob_impl, chunk=cfg.logprob_chunk,
                                  lora_dropout_key=lora_dropout_key,
                                  replay=cfg.routing_replay)
    if router_stats is not None:
      router_stats.extend(moe.pop_router_stats(model))
    return out
  hidden = completion_hidden(model, batch, cfg.shared_prompts, lora_dropout_key,
                             packed=bool(cfg.pack_prompts),
                             replay=cfg.routing_replay)
  if router_stats is not None:
    router_stats.extend(moe.pop_router_stats(model))
  b, n, d = hidden.shape
  out = fused_logprob(
      hidden.reshape(b * n, d), model.unembedding().astype(hidden.dtype),
      batch.tokens.reshape(b * n), temperature=jnp.repeat(batch.temperature, n),
      with_entropy=with_entropy, impl=cfg.logprob_impl, chunk_size=cfg.logprob_chunk)
  entropy = None if out.entropy is None else out.entropy.reshape(b, n)
  return out.logp.reshape(b, n), entropy


def _loss_and_metrics(params, graphdef, batch: TrainBatch, advantages, counts, ref_params,
                      cfg: StepConfig, teacher=None, frozen=None, key=None, packed=None):
  o = cfg.objective
  if frozen is not None:  # LoRA: the model is the frozen base with these adapters
    params = (frozen, params)
    ref_params = None if ref_params is None else (frozen, ref_params)
  router: list = []
  if cfg.loss == "sft":
    logp, _ = completion_logprobs(graphdef, params, batch, cfg, with_entropy=False,
                                  lora_dropout_key=key, packed=packed, router_stats=router)
    loss_sum, n = losses.nll(logp, batch.mask)
    loss = loss_sum / jnp.maximum(counts["token_mean"], 1.0)
    stats = losses.stats.Stats({"nll": (loss_sum, n)}, {"loss": loss}, {}, {})
    return routing.with_moe_terms(loss, stats, router, cfg, False)
  logp, entropy = completion_logprobs(graphdef, params, batch, cfg, lora_dropout_key=key,
                                      packed=packed, router_stats=router)
  if o.entropy_coef == 0:
    entropy = jax.lax.stop_gradient(entropy)
  lp_ref = None
  if ref_params is not None:
    lp_ref, _ = completion_logprobs(graphdef, ref_params, batch, cfg, with_entropy=False,
                                    packed=packed)
    lp_ref = jax.lax.stop_gradient(lp_ref)
  lp_teacher = None
  if teacher is not None and o.distill_coef != 0:
    t_graphdef, t_params = teacher
    lp_teacher, _ = completion_logprobs(t_graphdef, t_params, batch, cfg, with_entropy=False,
                                        packed=packed)
    lp_teacher = jax.lax.stop_gradient(lp_teacher)
  # One update per batch: the "old" policy is the current one, so r = 1 with its gradient.
  loss, stats = losses.objective(o, logp, jax.lax.stop_gradient(logp), advantages, batch.mask,
                                 counts, lp_gen=batch.rollout_logprobs, lp_ref=lp_ref,
                                 entropy=entropy, lp_teacher=lp_teacher)
  return routing.with_moe_terms(loss, stats, router, cfg, batch.routing is not None)


def _split(x: jax.Array, m: int, group: int = 1) -> jax.Array:
  # Micro-batch k takes rows (groups of `group` rows) k, k+m, k+2m, ...: with rows sharded in
  # contiguous blocks, every device contributes equally to every micro-batch.
  rest = x.shape[1:]
  x = x.reshape(x.shape[0] // (m * group), m, group, *rest).swapaxes(0, 1)
  return x.reshape(m, -1, *rest)


def shared_group(cfg: StepConfig, rows: int) -> int:
  """The prompt-sharing group size the step uses for `rows` rows (0: none): whole groups in
  every micro-batch."""
  g = cfg.shared_prompts
  return g if cfg.loss == "rl" and g > 1 and rows % (g * cfg.num_microbatches) == 0 else 0


def row_shards(row_sharding: NamedSharding | None) -> int:
  """How many shards the batch rows are split into (1 without a sharding)."""
  if row_sharding is None:
    return 1
  spec = row_sharding.spec[0] if row_sharding.spec else None
  axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  return int(np.prod([row_sharding.mesh.shape[a] for a in axes])) if axes else 1


def global_counts(batch: TrainBatch, cfg: StepConfig) -> dict[str, jax.Array]:
  """Denominators of the whole batch, computed once before micro-batching."""
  if cfg.loss == "sft":
    return {"token_mean": losses.count("token_mean", batch.mask)}
  return losses.global_counts(cfg.objective, batch.mask)


def train_step(state: TrainState, batch: TrainBatch, *, graphdef, optimizer, cfg: StepConfig,
               row_sharding: NamedSharding | None = None, teacher=None
               ) -> tuple[TrainState, dict]:
  """Pure step; see the module docstring. `row_sharding` constrains each micro-batch's rows and,
  through its mesh, the model's activations. `teacher`: `(graphdef, params)` of on-policy
  distillation's frozen teacher, scoring every completion token (`objective.distill_coef`)."""
  if row_sharding is not None:
    with jax.sharding.use_abstract_mesh(row_sharding.mesh.abstract_mesh):
      return _train_step(state, batch, graphdef=graphdef, optimizer=optimizer, cfg=cfg,
                         row_sharding=row_sharding, teacher=teacher)
  return _train_step(state, batch, graphdef=graphdef, optimizer=optimizer, cfg=cfg,
                     teacher=teacher)


def _train_step(state: TrainState, batch: TrainBatch, *, graphdef, optimizer, cfg: StepConfig,
                row_sharding: NamedSharding | None = None, teacher=None
                ) -> tuple[TrainState, dict]:
  m = cfg.num_microbatches
  # Rows of several causal sequences share no prompt (a later sequence does not see it).
  group = 0 if batch.completion_segment is not None else shared_group(cfg, batch.tokens.shape[0])
  pack = cfg.pack_prompts
  if pack is None:
    pack = row_shards(row_sharding) == 1
  cfg = dataclasses.replace(cfg, shared_prompts=group, pack_prompts=bool(group) and pack)
  clip = cfg.adv_clip
  has_tokens = jnp.any(batch.mask, axis=-1)
  # A row with a non-finite reward is excluded like a failed sample: advantage 0, out of its
  # group's statistics, so it can neither poison the gradient nor silence its group.
  valid = has_tokens & jnp.isfinite(batch.rewards)
  advantages = losses.compute_advantages(
      cfg.advantage, batch.rewards, batch.group_id, valid, eps=cfg.adv_eps, ddof=cfg.adv_ddof,
      clip_low=None if clip is None else -clip, clip_high=clip)
  counts = global_counts(batch, cfg)
  ref_params = state.ref_params if cfg.needs_reference() else None
  grad_fn = jax.value_and_grad(_loss_and_metrics, has_aux=True)
  frozen = state.frozen
  # LoRA dropout's key: a function of the update count and the micro-batch, so a resumed run
  # drops exactly what the uninterrupted one did.
  step_key = None if frozen is None else jax.random.fold_in(jax.random.key(0), state.step)

  def micro_grads(mb_batch, mb_adv, k, packed=None):
    if row_sharding is not None:
      mb_batch, mb_adv = jax.lax.with_sharding_constraint((mb_batch, mb_adv), row_sharding)
    key = None if step_key is None else jax.random.fold_in(step_key, k)
    (_, stats), grads = grad_fn(state.params, graphdef, mb_batch, mb_adv, counts, ref_params, cfg,
                                teacher, frozen, key, packed)
    return grads, stats

  def add(acc, grads, stats):
    return jax.tree.map(jnp.add, acc[0], grads), losses.stats.merge(acc[1], stats)

  def start(stats0):
    # Identity elements: maxes start at -inf and mins at +inf, so empty micro-batches are neutral.
    fill = losses.stats.Stats(
        *(jax.tree.map(lambda s, v=v: jnp.full(s.shape, v, s.dtype), part)
          for part, v in zip(stats0, (0.0, 0.0, -jnp.inf, jnp.inf))))
    return jax.tree.map(jnp.zeros_like, state.params), fill

  if cfg.pack_tokens:
    grads, stats = packing.micro_batches(batch, advantages, cfg.pack_tokens, cfg.shared_prompts,
                                         row_shards(row_sharding), micro_grads, add, start)
  else:
    micro = jax.tree.map(lambda x: _split(x, m, max(group, 1)), (batch, advantages))
    _, stats0 = jax.eval_shape(micro_grads, *jax.tree.map(lambda x: x[0], micro), 0)

    def body(acc, mb):
      (mb_batch, mb_adv), k = mb
      return add(acc, *micro_grads(mb_batch, mb_adv, k)), None
    (grads, stats), _ = jax.lax.scan(body, start(stats0), (micro, jnp.arange(m)))

  # Each micro-batch already divided by the global counts: the sum is the batch gradient.
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(grad_norm)
  layout_ok = prompt_layout_ok(batch, group) if group else jnp.bool_(True)
  apply = finite & layout_ok
  def update(params, opt_state):
    updates, new_opt = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt

  # A skipped update keeps params and optimizer state as they are. Under a conditional, not a
  # select of new against old per leaf: the select re-read and re-wrote every parameter and both
  # Adam moments each step (issue 22's CPU train step: ~4 ms of ~60).
  new_params, new_opt = jax.lax.cond(apply, update, lambda p, o: (p, o), state.params,
                                     state.opt_state)
  new_state = state._replace(params=new_params, opt_state=new_opt,
                             step=state.step + apply.astype(jnp.int32))
  adv_sum, adv_n = losses.stats.masked_mean(jnp.abs(advantages), valid)
  metrics = {
      **losses.stats.finalize(stats),
      "grad_norm": grad_norm,
      "tokens": jnp.sum(batch.mask).astype(jnp.float32),
      "skipped_nonfinite": (~finite).astype(jnp.int32),
      "prompt_layout_errors": (~layout_ok).astype(jnp.int32),
      "nonfinite_rewards": jnp.sum(~jnp.isfinite(batch.rewards) & has_tokens).astype(jnp.int32),
      "advantage/abs_mean": adv_sum / jnp.maximum(adv_n, 1.0),
  }
  return new_state, metrics


def check_batch(batch: TrainBatch, cfg: StepConfig) -> None:
  """Host-side checks before the jitted step: a missing field fails here, with its name."""
  users = cfg.rollout_logprob_users()
  if users and batch.rollout_logprobs is None:
    raise ValueError(f"TrainBatch.rollout_logprobs is None, but {', '.join(users)} needs the "
                     "sampler's log-probs")


def build_train_step(graphdef, optimizer, cfg: StepConfig, mesh: Mesh, params, *,
                     teacher=None) -> tuple[Callable, Callable]:
  """Jits the step for `mesh`. Returns (step_fn, init_state_fn(params) -> TrainState).

  The optimizer state is created directly with its sharding: `jit(optimizer.init)` alone would
  put it on one device. `teacher`: `(graphdef, params)` of a frozen distillation teacher on
  `mesh` (not part of the train state, so not in checkpoints: it is loaded from its source);
  the jitted step takes its params as a third argument (`step.extra_args`).

  LoRA (`params` holding `nnx.LoRAParam` adapters, `jaxrl.models.lora`): the state's params are
  the adapters alone (their gradients and optimizer state only) and the base goes to
  `TrainState.frozen`, which the step reads but neither updates nor donates; `init_state` takes
  the whole model (base and adapters) and the reference, if any, is a copy of the adapters.
  """
  adapters, base = lora_lib.split(params) if isinstance(params, nnx.State) else ({}, None)
  lora = bool(jax.tree.leaves(adapters))
  trained = adapters if lora else params
  p_sh = parallel.param_shardings(trained, mesh)
  frozen_sh = parallel.param_shardings(base, mesh) if lora else None
  rep = parallel.replicated(mesh)
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, trained),
                                 p_sh, transform_non_params=lambda _: rep)
  row = parallel.batch_sharding(mesh)

  ref_sh = p_sh if cfg.needs_reference() else None
  state_sh = TrainState(p_sh, opt_sh, rep, ref_sh)

  def make_state(p, ref):
    return TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32), ref)

  init_jit = jax.jit(make_state, in_shardings=(p_sh, ref_sh), out_shardings=state_sh)

  def init_state(p, ref_params=None):
    frozen = None
    if lora:
      p, frozen = lora_lib.split(p)
    if cfg.needs_reference():
      # The frozen reference defaults to the starting policy (a copy: params get donated).
      ref_params = jax.tree.map(jnp.copy, p) if ref_params is None else ref_params
    else:
      ref_params = None
    state = init_jit(p, ref_params)
    return state if frozen is None else state._replace(frozen=jax.device_put(frozen, frozen_sh))

  if teacher is None:
    extra, extra_sh, t_graphdef = (), (), None
  else:
    t_graphdef, t_params = teacher
    extra, extra_sh = (t_params,), (parallel.param_shardings(t_params, mesh),)
  def jitted(s, b, *rest, widths=None):
    frozen, t = (rest[0], rest[1:]) if lora else (None, rest)
    b = b if widths is None else widths_lib.trim(b, *widths)
    new, metrics = train_step(s._replace(frozen=frozen), b, graphdef=graphdef,
                              optimizer=optimizer, cfg=cfg, row_sharding=row,
                              teacher=(t_graphdef, t[0]) if t else None)
    return new._replace(frozen=None), metrics

  def program(widths=None):
    return jax.jit(functools.partial(jitted, widths=widths),
                   in_shardings=(state_sh, row, *((frozen_sh,) if lora else ()), *extra_sh),
                   out_shardings=(state_sh, rep), donate_argnums=(0,))

  step_jit = program()  # full widths: the program `compile_step` compiles ahead
  narrow = functools.lru_cache(maxsize=None)(program)  # one per (prompt, completion) widths

  def step(state, batch):
    check_batch(batch, cfg)
    widths = widths_lib.step_widths(batch, cfg.length_buckets, rep)
    fn = step_jit if widths is None else narrow(widths)
    if not lora:
      new, metrics = fn(state, batch, *extra)
    else:
      new, metrics = fn(state._replace(frozen=None), batch, state.frozen, *extra)
      new = new._replace(frozen=state.frozen)
    if cfg.length_buckets > 1:
      metrics["train/prompt_width"], metrics["train/completion_width"] = (
          widths or (batch.prompt_tokens.shape[1], batch.tokens.shape[1]))
    return new, metrics

  step.extra_args = extra
  step.lora = lora
  step.frozen_shardings = frozen_sh
  step.jitted = step_jit  # for compile counting and lowering
  step.state_shardings = state_sh
  step.batch_sharding = row
  return step, init_state


def compile_step(step, init_state, params, batch: TrainBatch) -> None:
  """Compiles `step` (from `build_train_step`) ahead of its first call, for the state
  `init_state(params)` would make and a batch of `batch`'s shapes and dtypes (any arrays or
  `jax.ShapeDtypeStruct`s; None fields stay None). The program lands in JAX's compilation cache,
  so the first real call runs at once; the trainer does this on a thread while the warm-up runs.
  Nothing is computed or allocated on the devices.
  """
  lower_step(step, init_state, params, batch).compile()


def lower_step(step, init_state, params, batch: TrainBatch) -> jax.stages.Lowered:
  """`step`'s full-width program lowered for the state `init_state(params)` would make and a
  batch like `batch` (`compile_step`); `params` may be `jax.ShapeDtypeStruct`s on any devices,
  e.g. a TPU topology's (`jaxrl.aot`), so the run's own step is what a plan compiles."""
  spec = lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                                  weak_type=getattr(a, "weak_type", False))
  state = jax.eval_shape(init_state, params)
  frozen = ()
  if getattr(step, "lora", False):
    frozen = (jax.tree.map(spec, state.frozen, step.frozen_shardings),)
    state = state._replace(frozen=None)
  state = jax.tree.map(spec, state, step.state_shardings)
  batch = jax.tree.map(lambda a: spec(a, step.batch_sharding), batch)
  extra = jax.tree.map(lambda a: spec(a, a.sharding), getattr(step, "extra_args", ()))
  return step.jitted.lower(state, batch, *frozen, *extra)


def model_params(state: TrainState):
  """The whole model's params of a train state: `params` itself, or with LoRA the frozen base
  joined with the adapters (`jaxrl.models.lora.join`)."""
  return state.params if state.frozen is None else lora_lib.join(state.frozen, state.params)


def shard_params(params, mesh: Mesh):
  """Places params by the logical-axis rules."""
  return jax.device_put(params, parallel.param_shardings(params, mesh))


def to_rows(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
  """Host arrays -> device arrays with rows split over ('data', 'fsdp')."""
  return jax.device_put(batch, parallel.batch_sharding(mesh))
