"""Pure KV-cache sampler: prefill once per prompt, decode G samples per prompt.

`make_sampler(graphdef, ...)` returns `generate(params, prompts, prompt_valid, key, request_ids,
temperature, top_k, top_p) -> SampleOutput`, built from two jitted pure functions:

- prefill runs the P prompts once and repeats the cache G times, so a group shares one prefill;
- decode is a `lax.while_loop` over at most `max_new_tokens` steps that stops when every row has
  emitted EOS; its KV cache argument is donated, so the loop updates it in place.

Shapes are fixed by (P, prompt length, G, max_new_tokens); temperature, top-k and top-p are array
arguments, so changing them never recompiles.

On a mesh (the rollout mesh, or the train mesh when colocated: `generate` takes the mesh its
params are placed on) the KV cache is pinned inside both programs: rows over 'data', as the
sampler's rows are split (`samplers.rows_over`), and kv heads over 'tensor'
(`parallel.sharding.constrain_kv_cache`), so each device holds 1/(data x tensor) of it. Rows or
heads those axes do not divide stay replicated. Placement only: the tokens are the same.

Log-probs follow the one contract of `jaxrl.models.token_logprobs`: `log_softmax(logits / T)`
over the full vocabulary, whatever top-k/top-p truncation was used to *draw* the token.

RNG: row i draws token t with `fold_in(fold_in(key, request_ids[i]), t)`, so a sample depends only
on (key, request id, step) and not on batch composition; group members have distinct request ids.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.core import platform
from jaxrl.models import moe
from jaxrl.models.logprobs import left_positions, scale_logits, token_logprobs
from jaxrl.models.model_config import KVCache
from jaxrl.parallel.sharding import ROLLOUT_ROW_AXES, constrain_kv_cache, mesh_of


class _DecodeState(NamedTuple):
  cache: KVCache
  t: jax.Array  # index of the next token to draw
  last: jax.Array  # [B] the token drawn last
  done: jax.Array  # [B] row has emitted EOS
  tokens: jax.Array  # [B, N]
  logprobs: jax.Array  # [B, N]
  mask: jax.Array  # [B, N]
  routing: jax.Array | None  # [B, N, L, k] (mixture of experts; None for a dense model)


class SampleOutput(NamedTuple):
  tokens: jax.Array  # [B, N] int32, pad_id after EOS
  logprobs: jax.Array  # [B, N] float32, 0 where mask is False
  mask: jax.Array  # [B, N] bool: generated tokens up to and including the first EOS
  lengths: jax.Array  # [B] int32, mask.sum(-1)
  # Mixture-of-experts models: [B, N, L, k] the experts each generated token went to in every
  # layer when the sampler fed it (routing replay), -1 where none (the last token, padding).
  routing: jax.Array | None = None


# Rows of scaled logits one top-k / top-p sort works on at a time (`filter_logits`).
FILTER_ROWS = 64


def filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Top-k then top-p (nucleus) truncation of scaled logits z [B, V]; off when k=0 and p=1.

  The truncation sorts `FILTER_ROWS` rows at a time (a `lax.map` over row blocks when B is a
  larger multiple of it): each row's result is its own, so the values are the same, and the
  sort's [rows, V] buffers (the sorted copy, its softmax, cumulative sums, masks; about eleven
  [B, V] f32 arrays on XLA:TPU for the whole batch at once, held even in steps that do not
  truncate) are a block's. Measured by the decode program of the 0.5B recipe compiled for v5p-8
  (`python -m jaxrl.plan`; docs/plan.md)."""

  def truncate_blocks(z):
    b, v = z.shape
    if b <= FILTER_ROWS or b % FILTER_ROWS:
      return truncate(z)
    return jax.lax.map(truncate, z.reshape(b // FILTER_ROWS, FILTER_ROWS, v)).reshape(b, v)

  def truncate(z):
    v = z.shape[-1]
    sorted_z = jnp.sort(z, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_k = jnp.arange(v) < k
    sorted_z = jnp.where(in_k, sorted_z, -jnp.inf)
    probs = jax.nn.softmax(sorted_z, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it is
    # still short of top_p. The top token always stays.
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    keep = keep.at[:, 0].set(True) & in_k
    threshold = jnp.min(jnp.where(keep, sorted_z, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(z >= threshold, z, -jnp.inf)

  # The sort costs O(V log V) per step; skip it entirely when nothing is truncated.
  return jax.lax.cond((top_k > 0) | (top_p < 1.0), truncate_blocks, lambda z: z, z)


def eos_tuple(eos_id: int | Sequence[int], who: str) -> tuple[int, ...]:
  """One EOS id or several, as a non-empty tuple of ints (`who` names the caller in the error)."""
  eos_ids = tuple(int(e) for e in ((eos_id,) if isinstance(eos_id, int) else eos_id))
  if not eos_ids:
    raise ValueError(f"{who}: eos_id names no token")
  return eos_ids


def is_eos(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  """Where `tok` is any of `eos_ids` (a row ends at the first such token)."""
  return functools.reduce(jnp.logical_or, [tok == e for e in eos_ids])


def resolve_fused_sampling(choice: bool | None, backend: str | None = None) -> bool:
  """Whether `pick_tokens` takes its fused form: `choice` itself, or for None ("auto") off on
  CPU (the default run's sampler keeps its exact log-probs, bit for bit) and on elsewhere.
  `backend` None: JAX's default, read when the decode step is traced."""
  if choice is not None:
    return bool(choice)
  return (platform.current() if backend is None else backend) != "cpu"


def _logsumexp_one_pass(z: jax.Array) -> jax.Array:
  """`logsumexp(z, -1)` of z [B, V] as one reduction over (running max, rescaled sum) pairs, so
  z and `exp(z - max)` stay inside the reduction's loop instead of becoming [B, V] arrays (a
  sum of exponentials is otherwise split into a windowed pre-reduction that reads a
  materialised input)."""

  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    rescale = lambda mi, si: jnp.where(mi == m, si, si * jnp.exp(mi - m))
    return m, rescale(m1, s1) + rescale(m2, s2)

  m, total = jax.lax.reduce((z, jnp.ones_like(z)), (jnp.float32(-jnp.inf), jnp.float32(0.0)),
                            combine, (z.ndim - 1,))
  return m + jnp.log(total)


def _pick_untruncated(logits, keys, temperature):
  """`pick_tokens` without top-k/top-p, in one pass's worth of [B, V] arrays: the f32 logits
  are the only one; the scaled logits, the Gumbel draw, the argmaxes and the log-sum-exp are
  each computed inside a reduction over them, and the token's log-prob is `z[tok] - lse`."""
  z = scale_logits(logits, temperature)
  drawn = jax.vmap(jax.random.categorical)(keys, z)
  tok = jnp.where(temperature <= 0, jnp.argmax(logits, -1), drawn).astype(jnp.int32)
  picked = scale_logits(jnp.take_along_axis(logits, tok[:, None], axis=-1), temperature)[:, 0]
  return tok, picked - _logsumexp_one_pass(z)


def pick_tokens(logits: jax.Array, t: jax.Array | int, request_keys: jax.Array,
                temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                fused: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Draws token t of each row from logits [B, V] -> (tokens [B] int32, log-probs [B] f32).

  Shared by the static sampler and the slot engine so that both draw the same token from the
  same logits: row i uses `fold_in(request_keys[i], t)` (t a scalar or one per row), greedy
  where `temperature <= 0`, top-k/top-p truncation only for the draw, and the log-prob contract
  of `token_logprobs` over the full vocabulary. Temperature, top-k and top-p are scalars (one
  setting for the batch) or one per row (the engine's slots each hold their own request).

  `fused` (`resolve_fused_sampling`; None: on off CPU): a step without truncation makes no
  [B, V] float32 array beyond `logits` (`_pick_untruncated`); the same tokens, log-probs within
  float32 rounding of the separate form (a sum in another order). With top-k or top-p on, both
  forms sort each row as before.
  """
  if resolve_fused_sampling(fused):
    t = jnp.broadcast_to(jnp.asarray(t, jnp.int32), request_keys.shape)
    keys = jax.vmap(jax.random.fold_in)(request_keys, t)
    temperature = jnp.asarray(temperature, jnp.float32)
    truncating = jnp.any((jnp.asarray(top_k) > 0) | (jnp.asarray(top_p) < 1.0))
    separate = lambda logits, keys, temp: _pick_separate(logits, keys, temp, top_k, top_p)
    return jax.lax.cond(truncating, separate, _pick_untruncated, logits, keys, temperature)
  t = jnp.broadcast_to(jnp.asarray(t, jnp.int32), request_keys.shape)
  return _pick_separate(logits, jax.vmap(jax.random.fold_in)(request_keys, t), temperature,
                        top_k, top_p)


def _pick_separate(logits, keys, temperature, top_k, top_p):
  """`pick_tokens`'s separate form, given each row's key for this token."""
  greedy = temperature <= 0
  z = scale_logits(logits, temperature)
  if jnp.ndim(top_k) == 0 and jnp.ndim(top_p) == 0:
    z = filter_logits(z, top_k, top_p)
  else:
    b = z.shape[0]
    top_k, top_p = jnp.broadcast_to(top_k, (b,)), jnp.broadcast_to(top_p, (b,))
    per_row = jax.vmap(lambda z, k, p: filter_logits(z[None], k, p)[0])
    # Under vmap the inner cond becomes a select that always sorts; skip it when no row
    # truncates, as the scalar path does.
    z = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), per_row, lambda z, k, p: z,
                     z, top_k, top_p)
  drawn = jax.vmap(jax.random.categorical)(keys, z)
  tok = jnp.where(greedy, jnp.argmax(logits, -1), drawn).astype(jnp.int32)
  return tok, token_logprobs(logits, tok, temperature)


def _no_routing(cfg, rows: int, n: int) -> jax.Array | None:
  """[rows, n, L, k] of -1: no token's experts recorded yet (None for a dense model)."""
  return (jnp.full((rows, n, cfg.num_layers, cfg.num_experts_per_tok), -1, moe.ROUTING_DTYPE)
          if cfg.num_experts else None)


def _feed(model, s: _DecodeState, *args, **kwargs):
  """`model(*args, **kwargs)` feeding token `s.t - 1` -> (the next logits [B, V], cache, `s`
  with that token's experts recorded for the rows that fed it: a mixture-of-experts model's
  routing replay)."""
  m = model if s.routing is None else moe.fresh(model)  # owned by this trace: it can record
  hidden, cache = m(*args, **kwargs)
  logits = model.logits(hidden[:, 0])
  if s.routing is None:
    return logits, cache, s
  fed = jnp.swapaxes(moe.recorded_experts(m)[:, :, 0], 0, 1)  # [B, L, k]
  at = s.routing[:, s.t - 1]
  return logits, cache, s._replace(routing=s.routing.at[:, s.t - 1].set(
      jnp.where(s.done[:, None, None], at, fed)))


def make_sampler(
    graphdef: nnx.GraphDef,
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_id: int | Sequence[int],
    pad_id: int,
    fused_sampling: bool | None = None,
) -> Callable[..., SampleOutput]:
  """Returns `generate(params, prompts [P, Lp], prompt_valid [P, Lp], key, request_ids [P*G],
  temperature, top_k, top_p) -> SampleOutput` over P*G rows (prompt-major: row = p*G + g).

  `eos_id` is one id or several (e.g. a chat model's end-of-turn and end-of-text): a row ends at
  the first token that is any of them, and that token is kept in the mask.

  `generate.prefill(params, prompts, prompt_valid, mesh=None)` and `generate.decode(...,
  mesh=None)` are the two jitted programs; `mesh` (static) is the mesh whose 'data' and 'tensor'
  axes split the KV cache (None: no placement of its own, e.g. one device).

  `fused_sampling`: `pick_tokens`'s `fused` (None: on off CPU). The KV cache is of the model's
  `kv_cache_dtype` (`KVCache.zeros`): `generate.prefill`'s first result is that cache.
  """
  G, N = num_samples, max_new_tokens
  eos_ids = eos_tuple(eos_id, "make_sampler")
  place = lambda cache, mesh: (cache if mesh is None
                               else constrain_kv_cache(cache, mesh, ROLLOUT_ROW_AXES))

  @functools.partial(jax.jit, static_argnames=("mesh",))
  def prefill(params, prompts, prompt_valid, mesh=None):
    model = nnx.merge(graphdef, params)
    P, Lp = prompts.shape
    cache = place(KVCache.zeros(model.cfg, P, Lp + N), mesh)
    positions = left_positions(prompt_valid)
    hidden, cache = model(prompts, positions, prompt_valid, cache, 0)
    # Left padding puts every prompt's last real token in the last slot.
    last_logits = model.logits(hidden[:, -1])
    rep = lambda x, axis: jnp.repeat(x, G, axis=axis)
    # The batch axis is 4th from the end in both cache layouts (stacked or per layer).
    cache = jax.tree.map(lambda x: rep(x, x.ndim - 4) if x.ndim >= 4 else rep(x, 0),
                         place(cache, mesh))
    prompt_lens = prompt_valid.sum(-1).astype(jnp.int32)
    return place(cache, mesh), rep(last_logits, 0), rep(prompt_lens, 0)

  def decode(params, cache, first_logits, prompt_lens, key, request_ids, temperature, top_k, top_p,
             mesh=None):
    model = nnx.merge(graphdef, params)
    # The loop carries the cache in the layout prefill gave it (pinned again in the body, so the
    # carry's layout is ours, not propagation's).
    cache = place(cache, mesh)
    # Unrolled models: per-layer weights prepared once here rather than sliced in every step.
    layers = None if model.cfg.scan_layers else model.layer_weights()
    B = first_logits.shape[0]
    Lp = cache.valid.shape[1] - N
    request_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, request_ids)

    def emit(s: _DecodeState, tok, lp) -> _DecodeState:
      """Records token t for rows still live; rows that already ended get padding."""
      live = ~s.done
      return s._replace(
          t=s.t + 1, last=tok, done=s.done | is_eos(tok, eos_ids),
          tokens=s.tokens.at[:, s.t].set(jnp.where(live, tok, pad_id)),
          logprobs=s.logprobs.at[:, s.t].set(jnp.where(live, lp, 0.0)),
          mask=s.mask.at[:, s.t].set(live))

    def body(s: _DecodeState) -> _DecodeState:
      # Feed token t-1 into slot Lp + t - 1 at its row's own position, then draw token t.
      logits, cache, s = _feed(model, s, s.last[:, None], (prompt_lens + s.t - 1)[:, None],
                               ~s.done[:, None], s.cache, Lp + s.t - 1, layers=layers)
      return emit(s._replace(cache=place(cache, mesh)),
                  *pick_tokens(logits, s.t, request_keys, temperature, top_k, top_p,
                               fused_sampling))

    empty = _DecodeState(cache, jnp.int32(0), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool),
                         jnp.full((B, N), pad_id, jnp.int32), jnp.zeros((B, N), jnp.float32),
                         jnp.zeros((B, N), bool), _no_routing(model.cfg, B, N))
    # Token 0 comes from prefill's logits; the loop draws tokens 1.. until all rows ended.
    s = emit(empty, *pick_tokens(first_logits, 0, request_keys, temperature, top_k, top_p,
                                 fused_sampling))
    s = jax.lax.while_loop(lambda s: (s.t < N) & ~jnp.all(s.done), body, s)
    return SampleOutput(s.tokens, s.logprobs, s.mask, s.mask.sum(-1).astype(jnp.int32),
                        s.routing), s.cache

  # The cache is donated and returned: the loop updates prefill's buffer in place instead of
  # first copying it (an undonated input must stay intact).
  decode = jax.jit(decode, donate_argnums=(1,), static_argnames=("mesh",))

  def generate(params, prompts, prompt_valid, key, request_ids, temperature, top_k=0, top_p=1.0,
               version=0):
    del version  # a static batch decodes on the one params version it was given
    # Generation runs where its params are: the rollout mesh (the train mesh when colocated).
    mesh = mesh_of(params)
    cache, first_logits, prompt_lens = prefill(params, prompts, prompt_valid, mesh=mesh)
    out, _ = decode(params, cache, first_logits, prompt_lens, key,
                  jnp.asarray(request_ids, jnp.int32), jnp.asarray(temperature, jnp.float32),
                  jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32), mesh=mesh)
    return out

  generate.prefill = prefill
  generate.decode = decode
  return generate
