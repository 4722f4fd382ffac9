"""The pure training step: `step(state, batch) -> (state, metrics)`, one jitted function.

- The loss is a `(sum, count)` function from `jaxrl.losses.LOSSES`; gradients of the per-micro-
  batch sums are accumulated through `lax.scan` over a fixed number of micro-batches and divided
  once by the global token count, so M micro-batches give the single-batch gradient exactly.
- Advantages are computed over the whole batch before it is split, so a group may straddle
  micro-batches.
- A non-finite gradient skips the update (params and optimizer state unchanged, `step` not
  advanced) and sets `skipped_nonfinite`; nothing raises inside jit.
- Shardings are explicit: params and optimizer state by the logical-axis rules, batch rows over
  ('data', 'fsdp'), metrics replicated. Params and optimizer state are donated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxrl import parallel
from jaxrl.losses import LOSSES, group_advantages
from jaxrl.models.transformer import scale_logits, token_logprobs
from jaxrl.rollout.sampler import left_positions
from jaxrl.types import TrainBatch, TrainState


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of a train step (hashable; changing one recompiles, by design)."""

  loss: str = "grpo"  # key of jaxrl.losses.LOSSES
  clip_eps: float = 0.2
  adv_eps: float = 1e-4
  num_microbatches: int = 1


def make_optimizer(learning_rate: float, *, b1: float = 0.9, b2: float = 0.999,
                   weight_decay: float = 0.0, grad_clip: float = 1.0, warmup_steps: int = 0
                   ) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW, with an optional linear learning-rate warm-up.

  A fresh Adam's first updates are sign-like (m / sqrt(v) = +-1) at the full rate; ramping the
  rate over the first steps keeps them from undoing a warm-started policy.
  """
  lr = learning_rate
  if warmup_steps > 0:
    lr = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))


def completion_logits(graphdef: nnx.GraphDef, params, batch: TrainBatch) -> jax.Array:
  """float32 logits [B, N, V] that predict each completion token (trainer-side recompute)."""
  model = nnx.merge(graphdef, params)
  lp = batch.prompt_tokens.shape[1]
  seq = jnp.concatenate([batch.prompt_tokens, batch.tokens], axis=1)
  valid = jnp.concatenate([batch.prompt_valid, batch.mask], axis=1)
  hidden, _ = model(seq, left_positions(valid), valid)
  # Position lp - 1 + j holds the state that predicts completion token j.
  return model.logits(hidden[:, lp - 1 : -1])


def _loss_and_metrics(params, graphdef, batch: TrainBatch, advantages, cfg: StepConfig):
  logits = completion_logits(graphdef, params, batch)
  logp = token_logprobs(logits, batch.tokens, batch.temperature[:, None])
  loss_sum, count, extra = LOSSES[cfg.loss](logp, jax.lax.stop_gradient(logp), advantages,
                                            batch.mask, cfg.clip_eps)
  m = batch.mask
  logz = jax.nn.log_softmax(scale_logits(logits, batch.temperature[:, None]))
  entropy = -jnp.sum(jnp.exp(logz) * logz, axis=-1)
  diff = jnp.abs(jax.lax.stop_gradient(logp) - batch.rollout_logprobs)
  sums = {
      "entropy": jnp.sum(jnp.where(m, entropy, 0.0)),
      "mismatch/abs_diff/mean": jnp.sum(jnp.where(m, diff, 0.0)),
      **extra,
  }
  maxes = {"mismatch/abs_diff/max": jnp.max(jnp.where(m, diff, 0.0))}
  return loss_sum, (count, sums, maxes)


def _split(x: jax.Array, m: int) -> jax.Array:
  # Micro-batch k takes rows k, k+m, k+2m, ...: with rows sharded in contiguous blocks, every
  # device contributes equally to every micro-batch.
  return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def train_step(state: TrainState, batch: TrainBatch, *, graphdef, optimizer, cfg: StepConfig,
               row_sharding: NamedSharding | None = None) -> tuple[TrainState, dict]:
  """Pure step; see the module docstring. `row_sharding` constrains each micro-batch's rows."""
  m = cfg.num_microbatches
  advantages = group_advantages(batch.rewards, batch.group_id, cfg.adv_eps)
  micro = jax.tree.map(lambda x: _split(x, m), (batch, advantages))
  grad_fn = jax.value_and_grad(_loss_and_metrics, has_aux=True)

  def body(acc, mb):
    mb_batch, mb_adv = mb
    if row_sharding is not None:
      mb_batch, mb_adv = jax.lax.with_sharding_constraint((mb_batch, mb_adv), row_sharding)
    (loss_sum, (count, sums, maxes)), grads = grad_fn(state.params, graphdef, mb_batch, mb_adv, cfg)
    g_acc, l_acc, c_acc, s_acc, x_acc = acc
    return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss_sum, c_acc + count,
            jax.tree.map(jnp.add, s_acc, sums), jax.tree.map(jnp.maximum, x_acc, maxes)), None

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  _, (_, sums0, maxes0) = jax.eval_shape(
      lambda: _loss_and_metrics(state.params, graphdef, jax.tree.map(lambda x: x[0], micro[0]),
                                micro[1][0], cfg))
  init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
          jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums0),
          jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), maxes0))
  (grads, loss_sum, count, sums, maxes), _ = jax.lax.scan(body, init, micro)

  denom = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(grad_norm)
  updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  new_state = TrainState(keep(new_params, state.params), keep(new_opt, state.opt_state),
                         state.step + finite.astype(jnp.int32))

  metrics = {
      "loss": loss_sum / denom,
      "grad_norm": grad_norm,
      "tokens": count,
      "skipped_nonfinite": (~finite).astype(jnp.int32),
      "advantage/abs_mean": jnp.mean(jnp.abs(advantages)),
      **{k: v / denom for k, v in sums.items()},
      **maxes,
  }
  return new_state, metrics


def build_train_step(graphdef, optimizer, cfg: StepConfig, mesh: Mesh, params
                     ) -> tuple[Callable, Callable]:
  """Jits the step for `mesh`. Returns (step_fn, init_state_fn(params) -> TrainState).

  The optimizer state is created directly with its sharding: `jit(optimizer.init)` alone would
  put it on one device.
  """
  p_sh = parallel.param_shardings(params, mesh)
  rep = parallel.replicated(mesh)
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params),
                                 p_sh, transform_non_params=lambda _: rep)
  state_sh = TrainState(p_sh, opt_sh, rep)
  row = parallel.batch_sharding(mesh)

  init_state = jax.jit(lambda p: TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32)),
                       in_shardings=(p_sh,), out_shardings=state_sh)
  step = jax.jit(
      lambda s, b: train_step(s, b, graphdef=graphdef, optimizer=optimizer, cfg=cfg,
                              row_sharding=row),
      in_shardings=(state_sh, row), out_shardings=(state_sh, rep),
      donate_argnums=(0,),
  )
  return step, init_state


def shard_params(params, mesh: Mesh):
  """Places params by the logical-axis rules."""
  return jax.device_put(params, parallel.param_shardings(params, mesh))


def to_rows(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
  """Host arrays -> device arrays with rows split over ('data', 'fsdp')."""
  return jax.device_put(batch, parallel.batch_sharding(mesh))
