"""LoRA: low-rank adapters on a frozen base model, with Flax NNX's own `nnx.LoRA`.

Why NNX's LoRA and not qwix's: jaxrl's model (`models.transformer`) keeps each projection as one
weight stacked over layers and runs the layers in a `lax.scan` (q/k/v and gate/up fused into one
matmul when unrolled); qwix finds what to adapt by intercepting `dot_general`/`einsum` calls of
named submodules, so it would see one anonymous matmul per fused projection inside a scan body,
with no module path per q/k/v/o/gate/up/down to target. `nnx.LoRA` is the adapter as a module: A
[din, rank] (He-uniform) and B [rank, dout] (zeros) as `nnx.LoRAParam`s, a `Param` subtype, so
`nnx.split(model, nnx.LoRAParam, ...)` separates what trains from what stays frozen with NNX's
own filters. The model stacks one per layer and target (`nnx.vmap`) and adds
`x @ A @ B * alpha / rank` to the projection it adapts (`ModelConfig.lora_*`), PEFT's layout
and scaling, so an adapter exports to PEFT unchanged (`jaxrl.export --adapter`).

A run's params with LoRA are one `nnx.State` holding both (`join`); the train state keeps the
adapters as its params (gradients and optimizer state for them alone) and the base as frozen
(`TrainState.frozen`, never donated). The sampler gets `merge(params)`: the base's weights with
each adapter's product added, in the base model's layout (computed where the sampler's base copy
lives, so a published version moves adapter bytes only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.layers import lora_dims
from jaxrl.models.model_config import DTYPES, ModelConfig
from jaxrl.models.transformer import Transformer

# LoRA target -> the base weight it adapts.
WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
           "down": "w_down"}


def with_lora(model_cfg: ModelConfig, lora_cfg) -> ModelConfig:
  """`model_cfg` with the `model.lora` section of a run config (rank 0: unchanged)."""
  if not lora_cfg.rank:
    return model_cfg
  targets = tuple(t.strip() for t in lora_cfg.targets.split(",") if t.strip())
  return dataclasses.replace(model_cfg, lora_rank=lora_cfg.rank, lora_alpha=float(lora_cfg.alpha),
                             lora_targets=targets, lora_dropout=float(lora_cfg.dropout))


def base_config(model_cfg: ModelConfig) -> ModelConfig:
  """The model without adapters."""
  return dataclasses.replace(model_cfg, lora_rank=0, lora_targets=(), lora_dropout=0.0)


def has_adapters(params) -> bool:
  """Whether `params` (an `nnx.State`) holds LoRA adapters."""
  return isinstance(params, nnx.State) and bool(jax.tree.leaves(split(params)[0]))


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, base) of a LoRA model's params (adapters empty without LoRA)."""
  return nnx.split_state(params, nnx.LoRAParam, ...)


def join(base: nnx.State, adapters: nnx.State) -> nnx.State:
  """One `nnx.State` of base and adapters (the LoRA model's params)."""
  return nnx.merge_state(base, adapters)


def abstract_adapters(model_cfg: ModelConfig) -> nnx.State:
  """Shapes (`jax.ShapeDtypeStruct`) of the adapters of `model_cfg`."""
  state = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(params=0))))[1]
  return split(state)[0]


def init_adapters(model_cfg: ModelConfig, seed: int, shardings=None) -> nnx.State:
  """Fresh adapters of `model_cfg` (A random, B zero: the adapted model equals its base), as
  `init_model` makes them for `seed`; one jitted program whose base weights XLA drops unused.
  `shardings`: one per adapter leaf (e.g. `parallel.param_shardings` of `abstract_adapters`)."""
  make = lambda: split(nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(params=seed)))[1])[0]
  return jax.jit(make, out_shardings=shardings)()


def counts(params: nnx.State) -> tuple[int, int]:
  """(adapter parameters, base parameters) of a LoRA model's params."""
  adapters, base = split(params)
  size = lambda s: sum(int(x.size) for x in jax.tree.leaves(s))
  return size(adapters), size(base)


def merged_weight(model_cfg: ModelConfig, target: str, w, a, b, dtype=None) -> jax.Array:
  """Base weight `w` of `target` with its adapter folded in, `W + alpha / rank * A @ B` per
  layer (in f32), stored in `dtype` (None: W's)."""
  din, dout = lora_dims(model_cfg, target)
  delta = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32))
  merged = w.reshape(w.shape[0], din, dout).astype(jnp.float32) + delta * (
      model_cfg.lora_alpha / model_cfg.lora_rank)
  return merged.reshape(w.shape).astype(_dtype(dtype) if dtype else w.dtype)


def merged_weights(model_cfg: ModelConfig, base: nnx.State, adapters: nnx.State) -> nnx.State:
  """The base model's params with every adapter folded in (`merged_weight`). Pure; jit it where
  the result should live."""
  out = jax.tree.map(lambda x: x, base)  # a new State; untouched leaves are shared
  for t in model_cfg.lora_targets:
    ad = adapters[f"lora_{t}"]
    out[WEIGHTS[t]] = nnx.Param(merged_weight(model_cfg, t, base[WEIGHTS[t]][...],
                                              ad["lora_a"][...], ad["lora_b"][...]))
  return out


def merge(model_cfg: ModelConfig, params: nnx.State, dtype=None, rest=None) -> nnx.State:
  """`merged_weights` of a LoRA model's params as the base model's params, in `dtype` (None: as
  they are). The adapted weights are computed by one jitted program (fresh buffers on their
  devices); the others are the base's own arrays, cast where `dtype` differs, or `rest`
  (`unadapted(model_cfg, base, dtype)`, made once by a caller that merges many versions)."""
  adapters, base = split(params)
  names = tuple(WEIGHTS[t] for t in model_cfg.lora_targets)
  new = _merge_jit(model_cfg, dtype)({n: base[n][...] for n in names}, adapters)
  out = unadapted(model_cfg, base, dtype) if rest is None else jax.tree.map(lambda x: x, rest)
  for n in names:
    out[n] = nnx.Param(new[n])
  return out


def unadapted(model_cfg: ModelConfig, base: nnx.State, dtype=None) -> nnx.State:
  """The base's params that no adapter touches, in `dtype` (None: the base's own arrays)."""
  names = {WEIGHTS[t] for t in model_cfg.lora_targets}
  out = nnx.State({k: v for k, v in base.items() if k not in names})
  if dtype is None:
    return out
  return _cast_jit(dtype)(out)


_JITS: dict = {}


def _merge_jit(model_cfg: ModelConfig, dtype):
  key = ("merge", model_cfg, dtype)
  if key not in _JITS:
    _JITS[key] = jax.jit(lambda weights, adapters: {
        WEIGHTS[t]: merged_weight(model_cfg, t, weights[WEIGHTS[t]],
                                  adapters[f"lora_{t}"]["lora_a"][...],
                                  adapters[f"lora_{t}"]["lora_b"][...], dtype)
        for t in model_cfg.lora_targets})
  return _JITS[key]


def _dtype(dtype):
  """A dtype given by name ("bfloat16") or as a dtype."""
  return DTYPES[dtype] if isinstance(dtype, str) else jnp.dtype(dtype)


def _cast_jit(dtype):
  key = ("cast", dtype)
  if key not in _JITS:
    to = _dtype(dtype)
    _JITS[key] = jax.jit(lambda tree: jax.tree.map(
        lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree))
  return _JITS[key]


class SeenBase:
  """Whether a LoRA model's frozen base is other arrays than the ones last seen: a publisher
  moves the base to the samplers once, and again only when the train state holds another one
  (e.g. after a restore). Compared by identity: the train step never changes the base's arrays."""

  def __init__(self):
    self._leaves: list | None = None

  def changed(self, base) -> bool:
    """True (and `base` remembered) when `base` is not the base seen last."""
    leaves = jax.tree.leaves(base)
    if self._leaves is not None and len(leaves) == len(self._leaves) and all(
        a is b for a, b in zip(leaves, self._leaves)):
      return False
    self._leaves = leaves
    return True


class AdapterSync:
  """The sampler's copy of each published version of a LoRA model, moving adapter bytes only.

  `move(tree)` puts a tree where the sampler's copy lives and returns it there (the identity
  when colocated; a reshard onto the rollout mesh; on several processes, each process's own
  devices: a global program every process calls in the same order). The frozen base is moved
  the first time it is seen (and again only if the train state's base is another object, e.g.
  after a restore); every version after moves the adapters alone, and the sampler's weights are
  the base's with each adapter's product folded in (`merge`), computed there, in `dtype` (the
  sampler's precision; None: the base's). Weights no adapter touches are the moved base's own
  arrays (nothing reads them but samplers; nothing donates them).

  `last_moved_bytes` is what the last call moved; `base_bytes` what moving the base cost.
  """

  def __init__(self, model_cfg: ModelConfig, move, dtype=None):
    self.model_cfg, self.move, self.dtype = model_cfg, move, dtype
    self._seen = SeenBase()
    self._base = self._rest = None
    self.last_moved_bytes = 0
    self.base_bytes = 0

  def __call__(self, params: nnx.State) -> nnx.State:
    adapters, base = split(params)
    moved = 0
    if self._seen.changed(base):
      self._base = self.move(base)
      self._rest = unadapted(self.model_cfg, self._base, self.dtype)
      self.base_bytes = nbytes(base)
      moved += self.base_bytes
    adapters = self.move(adapters)
    moved += nbytes(adapters)
    self.last_moved_bytes = moved
    return merge(self.model_cfg, join(self._base, adapters), self.dtype, self._rest)


def nbytes(tree) -> int:
  """Bytes of every array of `tree` (one copy of each, however it is sharded)."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
