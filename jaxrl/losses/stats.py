"""Metric accumulators that combine exactly across micro-batches and hosts.

A `Stats` holds four kinds of partial statistics: `means` as `(sum, count)` pairs, plain `sums`,
`maxes` and `mins` (empty selections give -inf / +inf, so a fully masked micro-batch never drags
a max to 0). `merge` combines two partials; `finalize` turns the result into plain numbers,
mapping empty means and empty extrema to 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Stats(NamedTuple):
  """Partial metric statistics of one micro-batch, combinable exactly (`merge`).

  Attributes:
    means: name -> `(sum, count)` pair.
    sums: name -> sum.
    maxes: name -> max (-inf when empty).
    mins: name -> min (+inf when empty).
  """
  means: dict  # name -> (sum, count)
  sums: dict  # name -> sum
  maxes: dict  # name -> max (-inf when empty)
  mins: dict  # name -> min (+inf when empty)


def empty() -> Stats:
  """A `Stats` with no metrics.

  Returns:
    `Stats({}, {}, {}, {})`.
  """
  return Stats({}, {}, {}, {})


def masked_max(x: jax.Array, where: jax.Array) -> jax.Array:
  """Max of `x` over `where`; -inf when `where` selects nothing.

  Args:
    x: values (any shape).
    where: bool, broadcastable to `x`.

  Returns:
    A scalar.
  """
  return jnp.max(jnp.where(where, x, -jnp.inf))


def masked_min(x: jax.Array, where: jax.Array) -> jax.Array:
  """Min of `x` over `where`; +inf when `where` selects nothing.

  Args:
    x: values (any shape).
    where: bool, broadcastable to `x`.

  Returns:
    A scalar.
  """
  return jnp.min(jnp.where(where, x, jnp.inf))


def masked_mean(x: jax.Array, where: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(sum, count)` of `x` over `where`; NaN/inf outside `where` never enters.

  Args:
    x: values (any shape).
    where: bool, the shape of `x`.

  Returns:
    `(sum, count)`: two float32 scalars, for `Stats.means`.
  """
  return (jnp.sum(jnp.where(where, x, 0.0)).astype(jnp.float32),
          jnp.sum(where).astype(jnp.float32))


def union(*parts: Stats) -> Stats:
  """Disjoint names from several partials of the *same* micro-batch into one.

  Args:
    *parts: `Stats` partials; a later one wins on a repeated name.

  Returns:
    One `Stats` holding every name.
  """
  out = empty()
  for p in parts:
    for mine, theirs in zip(out, p):
      mine.update(theirs)
  return out


def merge(a: Stats, b: Stats) -> Stats:
  """Partials of two micro-batches with the same names -> one partial.

  Args:
    a: a `Stats` partial.
    b: a `Stats` partial with the same names.

  Returns:
    A `Stats`: means' sums and counts and the sums added, maxes maxed, mins minned.
  """
  return Stats(
      jax.tree.map(jnp.add, a.means, b.means),
      jax.tree.map(jnp.add, a.sums, b.sums),
      jax.tree.map(jnp.maximum, a.maxes, b.maxes),
      jax.tree.map(jnp.minimum, a.mins, b.mins),
  )


def finalize(s: Stats) -> dict:
  """Flat `{name: value}`: means divided (0 when the count is 0), extrema 0 when empty.

  Args:
    s: the merged `Stats` of a whole batch.

  Returns:
    A dict of scalars, one per metric name.
  """
  out = {k: jnp.where(c > 0, v / jnp.maximum(c, 1e-30), 0.0) for k, (v, c) in s.means.items()}
  out.update(s.sums)
  # Only the empty fill becomes 0: a real +inf max (say, a -inf sampler log-prob on a valid
  # token) stays visible.
  out.update({k: jnp.where(v == -jnp.inf, 0.0, v) for k, v in s.maxes.items()})
  out.update({k: jnp.where(v == jnp.inf, 0.0, v) for k, v in s.mins.items()})
  return out
