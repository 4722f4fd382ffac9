"""Mesh construction and parameter/batch shardings by logical-axis rules.

Each parameter name maps to one logical axis per dimension; logical axes map to mesh axes. A
dimension that the mesh axis does not divide (e.g. 2 kv heads on a tensor axis of 4) stays
replicated rather than failing, so one rule table serves every mesh. The KV cache follows the
same rule (`kv_cache_spec`): rows over the batch axes ('data' only for rollouts), kv heads over
'tensor'.

The mesh uses `Mesh(devices, names)`, whose axes are Auto: `jax.make_mesh` defaults to Explicit
axes in this JAX, which changes sharding-constraint semantics.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # rows are split over both; fsdp also shards parameters

# Parameter name -> logical axis of each dimension (layer-stacked weights lead with "layers").
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": (None,),
    "attn_norm": ("layers", None),
    "mlp_norm": ("layers", None),
    "wq": ("layers", "embed", "heads", None),
    "wk": ("layers", "embed", "kv_heads", None),
    "wv": ("layers", "embed", "kv_heads", None),
    "wo": ("layers", "heads", None, "embed"),
    "bq": ("layers", "heads", None),
    "bk": ("layers", "kv_heads", None),
    "bv": ("layers", "kv_heads", None),
    "q_norm": ("layers", None),
    "k_norm": ("layers", None),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    # Mixture of experts (`jaxrl.models.moe`): the router replicated, the experts split over
    # 'fsdp' (expert parallelism on the axis that already splits parameters), their width over
    # 'tensor'.
    "router": ("layers", None, None),
    "we_gate": ("layers", "experts", None, "mlp"),
    "we_up": ("layers", "experts", None, "mlp"),
    "we_down": ("layers", "experts", "mlp", None),
    # LoRA adapters (A [layers, din, rank], B [layers, rank, dout]): small, replicated.
    "lora_a": ("layers", None, None),
    "lora_b": ("layers", None, None),
}
LOGICAL_TO_MESH = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
                   "mlp": "tensor", "layers": None, "experts": "fsdp"}


def make_mesh(data: int, fsdp: int, tensor: int, devices=None) -> Mesh:
  """A mesh over the first data*fsdp*tensor devices (shape already validated by the config)."""
  devices = jax.devices() if devices is None else devices
  n = data * fsdp * tensor
  return Mesh(np.asarray(devices[:n]).reshape(data, fsdp, tensor), AXES)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Row axis over ('data', 'fsdp'); trailing axes replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def constrain_rows(x: jax.Array, trailing=None) -> jax.Array:
  """Pins an activation's leading (row) axis to the batch axes of the mesh being traced under.

  Under FSDP the partitioner otherwise follows the weights, which are split over 'fsdp' along
  d_model: it keeps activations split over d_model for every row of the micro-batch (or whole),
  not split by rows. `trailing` is the spec of the other dims: `None` replicates them (the
  residual stream, as every FSDP layer all-gathers its weights), `P.UNCONSTRAINED` leaves them
  to XLA (e.g. heads or MLP columns over 'tensor').

  A no-op unless traced under a mesh (`jax.sharding.use_abstract_mesh`, as `train_step` does)
  that has both batch axes, more than one shard over them, and a row count they divide: callers
  without a mesh (tests, the sampler) and one-device runs trace exactly the same program.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
    return x
  shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
  if shards == 1 or x.ndim == 0 or x.shape[0] % shards:
    return x
  return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *[trailing] * (x.ndim - 1)))


# Rollouts split rows over 'data' only: splitting them over 'fsdp' too, the axis that splits the
# weights, would all-gather every layer's weights at every decode step (see
# `rollout.samplers.rows_over`). The trainer splits rows over both (`BATCH_AXES`).
ROLLOUT_ROW_AXES = ("data",)
KV_HEAD_AXIS = "tensor"  # as the 'kv_heads' of wk/wv, so each device keeps the heads it computes


def kv_cache_spec(shape: tuple[int, ...], axis_sizes, row_axes=BATCH_AXES) -> P:
  """The spec of one KV cache leaf: keys [.., B, K, Dh, S] and values [.., B, K, S, Dh] (a
  leading layer axis when stacked) or the validity mask [B, S].

  Rows over `row_axes`, kv heads over 'tensor', everything else replicated. A dim the axes do not
  divide (3 rows on 'data' of 2, 2 kv heads on 'tensor' of 4) stays replicated, like the
  parameter rules; axes the mesh lacks or of size 1 are left out, so a one-device mesh gives
  `P()` (fully replicated).
  """
  ndim = len(shape)
  batch = ndim - 4 if ndim >= 4 else 0
  out: list = [None] * ndim
  rows = tuple(a for a in row_axes if axis_sizes.get(a, 1) > 1)
  if rows and shape[batch] % math.prod(axis_sizes[a] for a in rows) == 0:
    out[batch] = rows[0] if len(rows) == 1 else rows
  t = axis_sizes.get(KV_HEAD_AXIS, 1)
  if ndim >= 4 and t > 1 and shape[batch + 1] % t == 0:
    out[batch + 1] = KV_HEAD_AXIS
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def kv_cache_shardings(cache, mesh: Mesh, row_axes=ROLLOUT_ROW_AXES):
  """A NamedSharding per leaf of a KV cache (`models.KVCache` of arrays or ShapeDtypeStructs, k/v
  stacked or one per layer), by `kv_cache_spec`. Rollouts' rows go over 'data' by default."""
  sizes = dict(mesh.shape)
  return jax.tree.map(lambda x: NamedSharding(mesh, kv_cache_spec(x.shape, sizes, row_axes)),
                      cache)


def constrain_kv_cache(cache, mesh: Mesh | None = None, row_axes=None):
  """Pins a KV cache's layout inside jit: rows over `row_axes`, kv heads over 'tensor'
  (`kv_cache_spec`), so that each device holds only its rows' and heads' keys and values instead
  of wherever XLA's propagation puts them (often the whole cache on every device).

  `mesh` given: rows over `row_axes` (default `ROLLOUT_ROW_AXES`) of that mesh; the sampler and
  the engine pass the mesh of the params they generate with. `mesh` None: the mesh being traced
  under (`jax.sharding.use_abstract_mesh`, as `train_step` does) with rows over `row_axes`
  (default `BATCH_AXES`, as `constrain_rows`), and a no-op without one. One-device meshes are a
  no-op too, so those programs stay exactly as they were.
  """
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return cache
    row_axes = BATCH_AXES if row_axes is None else row_axes
    place = lambda spec: spec  # resolved against the mesh being traced under
  else:
    row_axes = ROLLOUT_ROW_AXES if row_axes is None else row_axes
    place = lambda spec: NamedSharding(mesh, spec)
  if mesh.size == 1:
    return cache
  sizes = dict(mesh.shape)
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, place(kv_cache_spec(x.shape, sizes, row_axes))), cache)


def mesh_of(tree) -> Mesh | None:
  """The mesh the leaves of `tree` (e.g. params) are placed on: that of the first leaf with a
  NamedSharding over more than one device; None for one-device or host arrays."""
  for x in jax.tree.leaves(tree):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and isinstance(sh.mesh, Mesh) and sh.mesh.size > 1:
      return sh.mesh
  return None


def _spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  logical = PARAM_AXES.get(name)
  if logical is None or len(logical) != len(shape):
    raise ValueError(f"no sharding rule for parameter {name!r} of shape {shape}")
  out = []
  for dim, ax in zip(shape, logical):
    mesh_ax = LOGICAL_TO_MESH.get(ax) if ax else None
    out.append(mesh_ax if mesh_ax and dim % mesh.shape[mesh_ax] == 0 else None)
  return P(*out)


def param_shardings(params, mesh: Mesh):
  """A NamedSharding per parameter leaf, by the leaf's attribute name."""

  def leaf(path, x):
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return NamedSharding(mesh, _spec(str(names[-1]), tuple(x.shape), mesh))

  return jax.tree_util.tree_map_with_path(leaf, params)
