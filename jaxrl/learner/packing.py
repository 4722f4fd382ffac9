"""Token-budget packing of a train batch: rows of different lengths laid end to end in packed
rows ("streams") of `budget` positions each, with no padding to the longest row.

Pure and jittable (static shapes throughout; only the number of streams used is data). The unit
of packing is a group's prompt followed by some of its continuations: with prompts shared
(`group` > 1), each group's prompt runs once per unit, and a group longer than one stream is cut
into several units, each with its own copy of the prompt (its gradient sums over the copies, as
the shared prompt's sums over the group). Without sharing each row is its own unit.

Layout, per unit u placed at offset `o` of stream `s`: its prompt's tokens from the first real
one (`p` positions), then each continuation's first `c` positions (`c` = one past its last real
or trained token). Token `(s, o + i)` carries:

    segment  = (u + 1) << UNIT_SHIFT | member     member 0: the prompt, k: the unit's k-th row
             = -1 for padding (and for holes inside a span, which the unpacked rows mask too)
    shared   = prompt token (seen by every continuation of its unit, `jaxrl.kernels.attention`)
    position = as in the unpacked rows (`left_positions`, then on from the prompt's count)

so attention inside a stream is exactly the unpacked rows' attention. Units go to streams by
first fit in decreasing length (first fit leaves at most one stream under half full, so
`capacity` streams always suffice). Hidden state `(s, t)` predicts the next token of its
sequence (`target`); a prompt's last position predicts the first token of each of its unit's
continuations (`first`), which the step scores separately.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.kernels import fused_logprob
from jaxrl.kernels.attention.reference import UNIT_SHIFT
from jaxrl.models.logprobs import segment_positions


class PackedBatch(NamedTuple):
  """Streams `[S, W]` (S = capacity, W = budget) and the map back to the rows `[B, N]`."""

  tokens: jax.Array  # [S, W] int32
  positions: jax.Array  # [S, W] int32
  segment: jax.Array  # [S, W] int32, -1 = padding
  shared: jax.Array  # [S, W] bool: a prompt token
  target: jax.Array  # [S, W] int32: the completion token this position predicts (0: none)
  temperature: jax.Array  # [S, W] float32: its row's sampling temperature
  slot: jax.Array  # [B, N] int32: flat position (s W + t) of completion token (b, j); -1 beyond
  first: jax.Array  # [B] int32: flat position of the prompt's last token, predicting (b, 0)
  stream: jax.Array  # [B] int32: the stream row b is in
  used: jax.Array  # int32: streams holding a token (a prefix of the S)
  overflow: jax.Array  # int32: units that found no stream (0 when `capacity` is from `capacity`)
  # [S, W, L, k]: the sampler's experts of each completion token (`TrainBatch.routing`), -1 on
  # prompt tokens and padding; None without them.
  routing: jax.Array | None = None


def capacity(rows: int, prompt_len: int, new_tokens: int, budget: int, shards: int = 1) -> int:
  """Streams that always suffice for `rows` rows of `prompt_len + new_tokens` positions in
  streams of `budget`: every row its own unit at worst (`rows`), and first fit fills all but one
  stream more than half (`2 ceil(positions / budget) + 1`); rounded up to whole micro-batches of
  `shards` streams."""
  if prompt_len + new_tokens > budget:
    raise ValueError(f"a row of {prompt_len} + {new_tokens} positions does not fit a packed row "
                     f"of {budget}")
  worst = rows * (prompt_len + new_tokens)
  s = min(rows, 2 * -(-worst // budget) + 1)
  return -(-s // shards) * shards


def _units(group_of_row, need, prompt_len_of_row, budget):
  """Each row's unit (consecutive rows of one group while they fit `budget` with the prompt) and
  its offset in the unit; the unit's first row."""
  def body(carry, x):
    prev_group, fill, unit = carry
    g, c, p = x
    new = (g != prev_group) | (p + fill + c > budget)
    unit = unit + new.astype(jnp.int32)
    fill = jnp.where(new, 0, fill)
    return (g, fill + c, unit), (unit, p + fill)
  init = (jnp.int32(-1), jnp.int32(0), jnp.int32(-1))
  _, (unit, offset) = jax.lax.scan(body, init, (group_of_row, need, prompt_len_of_row))
  return unit, offset


def _first_fit(lengths, streams: int, budget: int):
  """(stream, offset) of each unit, placed by first fit in decreasing length; a unit of length 0
  is not placed (stream -1). Also the count of units that fit nowhere."""
  order = jnp.argsort(-lengths, stable=True)

  def body(fills, u):
    n = lengths[u]
    fits = fills + n <= budget
    s = jnp.argmax(fits)
    place = (n > 0) & fits[s]
    offset = fills[s]
    fills = jnp.where(place, fills.at[s].add(n), fills)
    return fills, (jnp.where(place, s, -1), offset, (n > 0) & ~place)
  _, (s, off, missed) = jax.lax.scan(body, jnp.zeros(streams, jnp.int32), order)
  unplace = lambda x: jnp.zeros_like(x).at[order].set(x)
  return unplace(s), unplace(off), jnp.sum(missed, dtype=jnp.int32)


def pack(prompt_tokens, prompt_valid, tokens, seen, temperature, *, group: int, budget: int,
         streams: int, routing=None, segment=None) -> PackedBatch:
  """Packs rows (`prompt_tokens`/`prompt_valid` [B, Lp] left-padded, `tokens` [B, N] with
  `seen` [B, N]: the real completion tokens, trained or not) into `streams` streams of `budget`
  positions. `group` > 1: every `group` consecutive rows share the first row's prompt.
  `routing` [B, N, L, k] (or None): the completion tokens' recorded experts, carried along.
  `segment` [B, N] (or None; `TrainBatch.completion_segment`): rows of several causal
  sequences, packed with no prompt sharing (`group` must be 1 or less): the row's prompt and its
  sequence 0 are member 1 of the row's unit, sequence k member k + 1, each with positions of its
  own and no shared key, so a later sequence sees only its own tokens."""
  if segment is not None and group > 1:
    raise ValueError(f"rows of several causal sequences share no prompt; got group={group}")
  b, lp = prompt_tokens.shape
  n = tokens.shape[1]
  group = max(int(group), 1)
  i32 = lambda x: x.astype(jnp.int32)
  idx_n = jnp.arange(n)
  # Positions a row needs: up to its last real token (the rest is right padding).
  need = jnp.max(jnp.where(seen, idx_n + 1, 0), axis=1)
  first_real = jnp.argmax(prompt_valid, axis=1)
  p = jnp.where(jnp.any(prompt_valid, axis=1), lp - first_real, 1)
  unit, offset = _units(jnp.arange(b) // group, need, p, budget)
  unit_len = jnp.zeros(b, jnp.int32).at[unit].max(p).at[unit].add(need)
  unit_row = jnp.full(b, b, jnp.int32).at[unit].min(jnp.arange(b))  # the unit's first row
  u_stream, u_off, overflow = _first_fit(unit_len, streams, budget)
  total = streams * budget

  # Completion token (b, j): flat slot, or `total` (dropped) past the row's need or unplaced.
  row_base = u_stream[unit] * budget + u_off[unit] + offset  # [B]
  placed = u_stream[unit] >= 0
  in_row = (idx_n[None, :] < need[:, None]) & placed[:, None]
  slot = jnp.where(in_row, row_base[:, None] + idx_n[None, :], total)
  member = i32(jnp.arange(b) - unit_row[unit] + 1)
  unit_id = ((unit + 1) << UNIT_SHIFT)[:, None]
  if segment is None:
    seg_c = jnp.where(seen, unit_id | member[:, None], -1)
    seg_p = jnp.where(prompt_valid, unit_id, -1)
    pos_p = jnp.maximum(jnp.cumsum(i32(prompt_valid), axis=1) - 1, 0)
    pos_c = jnp.maximum(jnp.sum(i32(prompt_valid), axis=1, keepdims=True)
                        + jnp.cumsum(i32(seen), axis=1) - 1, 0)
  else:
    seg_c = jnp.where(seen, unit_id | (i32(segment) + 1), -1)
    seg_p = jnp.where(prompt_valid, unit_id | 1, -1)
    positions = segment_positions(jnp.concatenate([seg_p, seg_c], axis=1))
    pos_p, pos_c = positions[:, :lp], positions[:, lp:]
  nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
  nxt_ok = jnp.concatenate([idx_n[None, 1:] < need[:, None], jnp.zeros((b, 1), bool)], axis=1)

  # Prompt token i of unit u (rows holding a unit's first row carry it): flat slot or dropped.
  heads = (unit_row[unit] == jnp.arange(b)) & placed
  idx_p = jnp.arange(lp)
  in_prompt = (idx_p[None, :] >= lp - p[:, None]) & heads[:, None]
  p_base = u_stream[unit] * budget + u_off[unit] - (lp - p)
  slot_p = jnp.where(in_prompt, p_base[:, None] + idx_p[None, :], total)

  def scatter(fill, dtype, prompt_values, completion_values):
    flat = jnp.full(total, fill, dtype)
    flat = flat.at[slot_p.reshape(-1)].set(prompt_values.reshape(-1).astype(dtype), mode="drop")
    flat = flat.at[slot.reshape(-1)].set(completion_values.reshape(-1).astype(dtype),
                                         mode="drop")
    return flat.reshape(streams, budget)

  temp_p = jnp.broadcast_to(temperature[:, None], (b, lp))
  temp_c = jnp.broadcast_to(temperature[:, None], (b, n))
  stream = jnp.where(placed, u_stream[unit], -1)
  return PackedBatch(
      tokens=scatter(0, jnp.int32, prompt_tokens, tokens),
      positions=scatter(0, jnp.int32, pos_p, pos_c),
      segment=scatter(-1, jnp.int32, seg_p, seg_c),
      shared=scatter(False, bool, prompt_valid & (segment is None), jnp.zeros_like(seen)),
      target=scatter(0, jnp.int32, jnp.zeros_like(prompt_tokens), jnp.where(nxt_ok, nxt, 0)),
      temperature=scatter(1.0, jnp.float32, temp_p, temp_c),
      slot=jnp.where(slot < total, slot, -1).astype(jnp.int32),
      first=(u_stream[unit] * budget + u_off[unit] + p - 1).astype(jnp.int32),
      stream=stream.astype(jnp.int32),
      used=(jnp.max(u_stream) + 1).astype(jnp.int32),
      overflow=overflow,
      routing=None if routing is None else jnp.full(
          (total, *routing.shape[2:]), -1, routing.dtype).at[slot.reshape(-1)].set(
              routing.reshape(b * n, *routing.shape[2:]), mode="drop").reshape(
                  streams, budget, *routing.shape[2:]))


def segmented_hidden(model, batch, seen, **kw) -> jax.Array:
  """Final hidden states [B, N, D] that predict each completion token of rows holding several
  causal sequences (`batch.completion_segment`; `seen` [B, N]: the real completion tokens):
  each row is one packed row, its prompt and sequence 0 one segment, each later sequence
  another, with positions of its own. `kw`: `Transformer.packed_forward`'s options."""
  lp = batch.prompt_tokens.shape[1]
  tokens = jnp.concatenate([batch.prompt_tokens, batch.tokens], axis=1)
  segment = jnp.concatenate([jnp.where(batch.prompt_valid, 0, -1),
                             jnp.where(seen, batch.completion_segment, -1)], axis=1)
  hidden = model.packed_forward(tokens, segment_positions(segment), segment, None, **kw)
  return hidden[:, lp - 1 : -1]  # position lp - 1 + j predicts completion token j


def packed_logprobs(model, packed: PackedBatch, k: jax.Array, shards: int, batch, *,
                    with_entropy: bool = True, impl: str | None = None, chunk: int | None = None,
                    lora_dropout_key: jax.Array | None = None, replay: bool = False
                    ) -> tuple[jax.Array, jax.Array | None]:
  """`(logp, entropy)` [B, N] of micro-batch `k` (streams `k shards .. (k + 1) shards - 1`) in
  the rows' frame: rows outside the micro-batch get 0 (the step masks them out of its loss).
  `batch`: the `TrainBatch` that was packed (its completion tokens and temperatures; with its
  `routing`, the packed experts go to the model, used with `replay`, else compared)."""
  r, w = shards, packed.tokens.shape[1]
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, k * r, r, axis=0)
  route = {} if packed.routing is None or batch.routing is None else {
      "routing": jnp.moveaxis(take(packed.routing), 2, 0), "use_routing": replay}
  hidden = model.packed_forward(take(packed.tokens), take(packed.positions),
                                take(packed.segment), take(packed.shared),
                                lora_dropout_key=lora_dropout_key, **route)
  hidden = hidden.reshape(r * w, hidden.shape[-1])
  unembed = model.unembedding().astype(hidden.dtype)
  score = lambda h, t, temp: fused_logprob(h, unembed, t, temperature=temp,
                                           with_entropy=with_entropy, impl=impl, chunk_size=chunk)
  # Each position predicts its sequence's next token; a prompt's last one predicts the first
  # token of every continuation of its unit, scored once per row here.
  out = score(hidden, take(packed.target).reshape(-1), take(packed.temperature).reshape(-1))
  base = k * r * w
  local = lambda x: jnp.clip(x - base, 0, r * w - 1)
  first = score(hidden[local(packed.first)], batch.tokens[:, 0], batch.temperature)
  in_mb = (packed.stream // r == k)[:, None]

  def to_rows(per_position, per_first):
    rest = per_position[local(packed.slot[:, :-1])]  # token j >= 1 from position of j - 1
    x = jnp.concatenate([per_first[:, None], rest], axis=1)
    return jnp.where(in_mb, x, 0.0)
  entropy = None if out.entropy is None else to_rows(out.entropy, first.entropy)
  return to_rows(out.logp, first.logp), entropy


def first_fit_fills(lengths, budget: int) -> list[int]:
  """Host-side first fit decreasing of sequences of `lengths` positions into rows of `budget`
  (each length at most `budget`): the fill of each row used, as `pack` places units."""
  fills: list[int] = []
  for n in sorted((int(x) for x in lengths), reverse=True):
    for i, f in enumerate(fills):
      if f + n <= budget:
        fills[i] += n
        break
    else:
      fills.append(n)
  return fills


def padding_fraction(lengths, budget: int) -> float:
  """Host-side: the fraction of positions that are padding when sequences of `lengths`
  positions are packed by first fit decreasing into rows of `budget` (`first_fit_fills`).
  Padding to the longest instead costs `1 - mean / max`."""
  fills = first_fit_fills(lengths, budget)
  return 1.0 - sum(fills) / (len(fills) * budget) if fills else 0.0


def micro_batches(batch, advantages, budget: int, shared_prompts: int, shards: int,
                  micro_grads, add, start):
  """Gradients and stats of a train step summed over token-budget micro-batches of `budget`
  positions per packed row: `shards` packed rows each, as many as the batch's tokens fill (a
  `while` loop over the count the packing reports, so a short batch runs fewer). Micro-batch k
  sees every row, its mask cut to the rows packed into it: the objective's sums then take exactly
  those rows, over the global counts. `micro_grads(batch, advantages, k, packed)`, `add(acc,
  grads, stats)` and `start(stats shapes)` are the step's."""
  b, lp = batch.prompt_tokens.shape
  n = batch.tokens.shape[1]
  seen = batch.mask if batch.completion_valid is None else batch.completion_valid | batch.mask
  streams = capacity(b, lp, n, budget, shards)
  group = shared_prompts if b % max(shared_prompts, 1) == 0 else 0
  packed = pack(batch.prompt_tokens, batch.prompt_valid, batch.tokens, seen, batch.temperature,
                group=group, budget=budget, streams=streams, routing=batch.routing,
                segment=batch.completion_segment)

  def micro(k):
    in_mb = (packed.stream // shards == k)[:, None]
    return micro_grads(batch._replace(mask=batch.mask & in_mb), advantages, k,
                       (packed, k, shards))

  _, stats0 = jax.eval_shape(micro, jnp.int32(0))
  count = (packed.used + shards - 1) // shards
  return jax.lax.fori_loop(0, count, lambda k, acc: add(acc, *micro(k)), start(stats0))
