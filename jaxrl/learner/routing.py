"""The train step's mixture-of-experts terms: the load-balancing loss, and routing replay's
input and metrics (docs/moe.md).

A batch of a mixture-of-experts run carries the sampler's experts of every generated token
(`TrainBatch.routing`, [B, N, L, k], -1 where none was recorded). `model_routing` lays them out
for a forward pass over the prompt and the completion (prompt tokens get -1: the trainer routes
them itself); the model uses them instead of its own top-k when the step replays
(`StepConfig.routing_replay`) and compares them with its own top-k in every case, and
`with_moe_terms` turns the router statistics into the loss term and the metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models import moe


def model_routing(routing: jax.Array, prompt_len: int = 0) -> jax.Array:
  """A batch's recorded experts [B, N, L, k] as the model takes them, [L, B, prompt_len + N, k]
  (the first `prompt_len` positions, the prompt, with none recorded)."""
  r = jnp.moveaxis(routing, 2, 0)
  if not prompt_len:
    return r
  lead = jnp.full((r.shape[0], r.shape[1], prompt_len, r.shape[3]), -1, r.dtype)
  return jnp.concatenate([lead, r], axis=2)


def mismatch_means(router: list[moe.RouterStats]) -> dict:
  """Routing-replay metrics as (sum, count) means over the generated tokens with recorded
  experts and the layers, pooled over the passes `router`:

  - `moe/routing_mismatch`: the experts the step used differ, as a set, from the sampler's
    (the trainer's own top-k without replay; 0 with it);
  - `moe/routing_mismatch/own`: the trainer's own router's top-k differs from the sampler's,
    replay or not, and per layer i `moe/routing_mismatch/layer_<i>`."""
  total = lambda f: sum(jnp.sum(getattr(s, f)) for s in router)
  per_layer = lambda f: sum(getattr(s, f).reshape(-1) for s in router)
  rec = total("recorded")
  out = {"moe/routing_mismatch": (total("used_mismatched"), rec),
         "moe/routing_mismatch/own": (total("mismatched"), rec)}
  own, count = per_layer("mismatched"), per_layer("recorded")
  for i in range(own.shape[0]):
    out[f"moe/routing_mismatch/layer_{i}"] = (own[i], count[i])
  return {k: jax.tree.map(jax.lax.stop_gradient, v) for k, v in out.items()}


def with_moe_terms(loss, stats, router: list, cfg, recorded: bool):
  """`(loss, stats)` of a micro-batch plus a mixture-of-experts model's load-balancing loss over
  `router` (its passes' `moe.RouterStats`), weighted by `cfg.moe_aux_coef` and logged as the
  mean `moe/aux_loss`, the fraction of assignments the capacity dropped (`moe/dropped`), and
  with `recorded` (the batch carries the sampler's experts) the
  routing-replay metrics (`mismatch_means`); unchanged for a dense model (no statistics)."""
  if not router:
    return loss, stats
  aux = moe.pooled_aux_loss(router)
  if cfg.moe_aux_coef:
    loss = loss + cfg.moe_aux_coef / cfg.num_microbatches * aux
  means = {**stats.means, "moe/aux_loss": (jax.lax.stop_gradient(aux), jnp.ones((), aux.dtype))}
  # Assignments the capacity dropped, per valid token-expert assignment (0 when dropless).
  k = router[0].experts.shape[-1]
  means["moe/dropped"] = (sum(jnp.sum(s.dropped) for s in router),
                          k * sum(jnp.sum(s.tokens) for s in router))
  if recorded:
    means.update(mismatch_means(router))
  return loss, stats._replace(means=means)
