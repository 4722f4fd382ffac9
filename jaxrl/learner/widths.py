"""Per-batch widths of the train step (`train.length_buckets`): each batch runs with its prompts
and completions cut to the columns its rows use, rounded up to one of a few widths.

A batch's arrays are padded to the run's budgets (`rollout.max_prompt_len` prompt columns, left
padded; the completion budget, right padded), and the step's dense work is over every column. A
column that no row uses (no valid prompt token; no trained or attended completion token) changes
no loss, gradient or metric: it is masked out of attention and of every sum. Cutting such columns
before the step leaves the update the same function of the batch (equal up to the order of float
sums) at a fraction of the work: a recipe whose replies end well inside their budget trains only
as far as its longest reply.

Each width used is its own compiled step, so widths come from a fixed set: `buckets` evenly spaced
widths up to the budget (`bucket`), at most `buckets` programs per budget (the full-width one is
the one compiled ahead). The widths are a function of the batch alone, so a resumed run cuts every
batch as the uninterrupted one did.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxrl.core.types import TrainBatch

# The fields whose axis 1 is the completion's columns (the prompt fields' axis 1 is the prompt's).
COMPLETION_FIELDS = ("tokens", "mask", "rollout_logprobs", "completion_valid", "routing",
                     "completion_segment")


def bucket(used: int, full: int, buckets: int) -> int:
  """The smallest of the widths `ceil(full k / buckets)`, k = 1..buckets, that holds `used`
  columns (`full` when `buckets` <= 1). E.g. a 64-token budget in 8 buckets: 8, 16, ..., 64,
  so a batch whose longest reply has 41 tokens runs 48 columns."""
  if buckets <= 1 or used >= full:
    return full
  for k in range(1, buckets + 1):
    width = -(-full * k // buckets)
    if width >= used:
      return width
  return full


def used_columns(prompt_valid: jax.Array, mask: jax.Array,
                 completion_valid: jax.Array | None) -> jax.Array:
  """`[prompt columns used, completion columns used]` int32: the prompt's columns from the first
  one any row has a token in (prompts are left padded), the completion's up to the last one any
  row trains on or attends to (0 for none)."""
  def span(any_col):  # columns from the first used one to the end
    n = any_col.shape[0]
    return jnp.where(jnp.any(any_col), n - jnp.argmax(any_col), 0).astype(jnp.int32)

  seen = mask if completion_valid is None else mask | completion_valid
  return jnp.stack([span(jnp.any(prompt_valid, axis=0)), span(jnp.any(seen, axis=0)[::-1])])


@functools.lru_cache(maxsize=16)
def _used_columns_program(out: NamedSharding | None):
  return jax.jit(used_columns, out_shardings=out)  # one program per placement, reused every step


def step_widths(batch: TrainBatch, buckets: int, replicated: NamedSharding | None
                ) -> tuple[int, int] | None:
  """`(prompt width, completion width)` to run `batch` at, or None for its full widths (also
  when `buckets` <= 1: off). Reads two integers of the batch back to the host: one small program
  on the batch's devices, launched by the trainer thread like the step itself, so every process
  of a multi-process run computes the same widths. `replicated`: the step's replicated sharding
  (the integers' placement)."""
  if buckets <= 1:
    return None
  lp, n = batch.prompt_tokens.shape[1], batch.tokens.shape[1]
  used_lp, used_n = (int(x) for x in jax.device_get(_used_columns_program(replicated)(
      batch.prompt_valid, batch.mask, batch.completion_valid)))
  widths = (bucket(max(used_lp, 1), lp, buckets), bucket(max(used_n, 1), n, buckets))
  return None if widths == (lp, n) else widths


def trim(batch: TrainBatch, prompt_width: int, completion_width: int) -> TrainBatch:
  """`batch` with its prompts' leading `lp - prompt_width` columns and its completions' trailing
  columns past `completion_width` cut (static widths; inside or outside jit)."""
  cut = {f: getattr(batch, f)[:, :completion_width] for f in COMPLETION_FIELDS
         if getattr(batch, f) is not None}
  lp = batch.prompt_tokens.shape[1]
  return batch._replace(prompt_tokens=batch.prompt_tokens[:, lp - prompt_width:],
                        prompt_valid=batch.prompt_valid[:, lp - prompt_width:], **cut)
