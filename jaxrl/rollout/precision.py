"""The sampler's precision (`rollout.dtype`), independent of the trainer's.

`rollout_dtype(cfg)` is the dtype the sampler's model runs in, or None where it is the trainer's
("auto", or both `model.param_dtype` and `model.dtype` already that dtype). `rollout_model(cfg,
model_cfg)` is the sampler's model config: params *and* compute in that dtype, and the KV cache
in `rollout.kv_cache_dtype` ("auto": bfloat16 on a GPU or TPU, the compute dtype on CPU, so the
default run computes as before). Log-probs stay float32 whatever they are
(`jaxrl.models.token_logprobs` casts the logits).

`cast_params(params, dtype)` makes the sampler's copy of a params version: a fresh buffer for
every leaf (floating leaves cast, others copied), on the leaf's own sharding, as one jitted
program per tree structure, so a publish is one dispatch. Fresh always, even where nothing is
cast: the train step donates its own buffers, and the published copy must outlive that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl.models import DTYPES, ModelConfig
from jaxrl.models.model_config import resolve_kv_cache_dtype


def rollout_dtype(cfg) -> str | None:
  """The sampler's dtype of run config `cfg` ("float32", "bfloat16"), or None for the trainer's
  own (`rollout.dtype = "auto"`, or equal to both `model.param_dtype` and `model.dtype`)."""
  d = cfg.rollout.dtype
  if d == "auto" or d == cfg.model.param_dtype == cfg.model.dtype:
    return None
  return d


def kv_cache_dtype(cfg, compute_dtype: str, backend: str | None = None) -> str:
  """The sampler's KV cache dtype of run config `cfg` (`rollout.kv_cache_dtype`) for a sampler
  computing in `compute_dtype`, on `backend` (None: JAX's default): "auto" is bfloat16 on a GPU
  or TPU and `compute_dtype` on CPU (`resolve_kv_cache_dtype`)."""
  return resolve_kv_cache_dtype(cfg.rollout.get("kv_cache_dtype", "auto"), compute_dtype,
                                backend)


def rollout_model(cfg, model_cfg: ModelConfig, backend: str | None = None) -> ModelConfig:
  """The sampler's model config: `model_cfg` itself for the trainer's precision and a KV cache in
  its compute dtype, else with params and compute in `rollout_dtype(cfg)` and the cache in
  `kv_cache_dtype(cfg, ...)` (`backend`: as there)."""
  d = rollout_dtype(cfg)
  out = model_cfg if d is None else dataclasses.replace(model_cfg, param_dtype=d, dtype=d)
  kv = kv_cache_dtype(cfg, out.dtype, backend)
  return out if kv == out.dtype else dataclasses.replace(out, kv_cache_dtype=kv)


def cast_first(params, dtype: str | None) -> bool:
  """Whether to cast `params` before moving them to other devices rather than after: `dtype` is
  narrower than some floating leaf, so the move carries fewer bytes (and the destination never
  holds the wide copy)."""
  if dtype is None:
    return False
  size = jnp.dtype(DTYPES[dtype]).itemsize
  return any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > size
             for x in jax.tree.leaves(params))


def needs_cast(params, dtype: str | None) -> bool:
  """Whether some floating leaf of `params` is not of `dtype` (None: never)."""
  return dtype is not None and any(
      jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != DTYPES[dtype]
      for x in jax.tree.leaves(params))


def moved_copy(params, dtype: str | None, move):
  """The samplers' own copy of `params`: `move(params)` (a reshard, a copy onto each process's
  devices, or the identity when colocated) in `dtype`, with new buffers however it moves.

  The one rule for where the cast goes: before the move when `dtype` is narrower than the
  params (the move carries fewer bytes, and the destination never holds the wide copy), after it
  otherwise; a move that returns its input (colocated) is followed by a copy, so the result
  survives the train step's donation of `params`."""
  if cast_first(params, dtype):
    return move(cast_params(params, dtype))
  moved = move(params)
  return cast_params(moved, dtype) if needs_cast(moved, dtype) or moved is params else moved


def cast_params(params, dtype: str | None):
  """A fresh copy of `params` (a pytree of `jax.Array`s, e.g. an `nnx.State`) with every floating
  leaf cast to `dtype` (None: kept as it is) and every leaf on its own sharding.

  Never returns an input buffer, so the copy survives the donation of `params`. One jitted
  program per (tree structure, shardings, dtype) and set of devices the leaves are on (one for
  params on one mesh); on several processes it is a global program, to be launched at the same
  point on every process.
  """
  leaves, treedef = jax.tree.flatten(params)
  groups: dict[frozenset, list[int]] = {}
  for i, x in enumerate(leaves):
    groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
  out = list(leaves)
  for idx in groups.values():
    program = cast_program(tuple(leaves[i].sharding for i in idx), dtype)
    for i, y in zip(idx, program([leaves[i] for i in idx])):
      out[i] = y
  return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=64)
def cast_program(shardings: tuple, dtype: str | None):
  """The jitted copy `cast_params` runs for leaves on `shardings`: every floating leaf cast to
  `dtype` (None: copied), each output on its leaf's sharding. What a publish compiles to."""
  to = None if dtype is None else DTYPES[dtype]

  def cast(leaves):
    # A copy where nothing is cast: a jitted output is a new buffer, never the argument's.
    return [x.astype(to) if to is not None and jnp.issubdtype(x.dtype, jnp.floating)
            else jnp.copy(x) for x in leaves]

  return jax.jit(cast, out_shardings=list(shardings))
