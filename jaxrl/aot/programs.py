"""Every program a run executes, built for a target's devices by the run's own builders (no copy
of a step or a sampler): `build_programs(plan_cfg, devices)`.

- `train_step`: `learner.rl.build_rl_step` on the train mesh (micro-batches, packing, remat,
  LoRA, MoE dispatch, routing replay and the reference model as configured), lowered by
  `learner.step.lower_step` on the run's batch spec (`learner.rl.rl_batch_spec`);
- `publish`: the sampler's copy of a version (`rollout.precision.cast_program`: the cast or
  copy a colocated publisher runs);
- `prefill` and `decode`: the static sampler (`rollout.static_sampler.make_sampler`, as
  `rollout.samplers.build_samplers` makes it: G samples per prompt, rows over the rollout mesh's
  'data' axis where it divides them, the KV cache pinned as the run pins it);
- `val_prefill` and `val_decode`: the same for validation's k samples of `val.batch_size` rows.

Everything is traced inside `core.platform.building_for(devices)`, so each `"auto"` resolves as
it would on the target (attention, decode attention, KV cache dtype, MoE dispatch, fused
sampling, Pallas compiled rather than interpreted). Nothing is allocated: every argument is a
`jax.ShapeDtypeStruct` with the sharding the run gives it.

Not built yet (the plan says so): the continuous engine's programs, a disaggregated run's
reshard onto other devices, and a distillation teacher's pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import config as config_lib
from jaxrl import parallel
from jaxrl.core import platform
from jaxrl.learner.rl import build_rl_step, lora_model, rl_batch_spec
from jaxrl.learner.step import lower_step
from jaxrl.models import abstract_model
from jaxrl.models import hf_checkpoint as hf_lib
from jaxrl.models.model_config import ModelConfig
from jaxrl.parallel.sharding import ROLLOUT_ROW_AXES, kv_cache_shardings
from jaxrl.rollout.precision import cast_program, rollout_dtype, rollout_model
from jaxrl.rollout.static_sampler import make_sampler
from jaxrl.run.parts import with_run_settings

SHAPES_DIR = os.path.join(os.path.dirname(__file__), "shapes")
# Every program a plan may compile, in the order it compiles them (`--programs` names some).
PROGRAM_NAMES = ("train_step", "publish", "prefill", "decode", "val_prefill", "val_decode")


@dataclasses.dataclass(frozen=True)
class Program:
  """One program of the run: `lower()` traces and lowers it for the target (nothing compiled
  yet). `side`: "train" (the train mesh's devices) or "rollout" (the rollout mesh's)."""
  name: str
  side: str
  lower: Callable[[], jax.stages.Lowered]
  what: str  # one line: what it is, with its shapes


@dataclasses.dataclass(frozen=True)
class Built:
  """The programs of a config on a target, with what the plan's arithmetic needs."""
  programs: list[Program]
  model_cfg: ModelConfig
  rollout_cfg: ModelConfig
  mesh: jax.sharding.Mesh
  rollout_mesh: jax.sharding.Mesh
  colocated: bool  # the rollout on the train chips (the train mesh, or each host's own of them)
  params: int  # the model's parameters
  rollout_param_bytes: int  # one published copy, per device of the rollout mesh
  batch_bytes: int  # one train batch, per device of the train mesh
  not_built: tuple[str, ...]


def shipped_shapes() -> list[str]:
  """The model shapes shipped with jaxrl (`shapes/<name>/config.json`): published config.json
  files, enough to plan a recipe whose weights are not on this machine."""
  if not os.path.isdir(SHAPES_DIR):
    return []
  return sorted(d for d in os.listdir(SHAPES_DIR)
                if os.path.isfile(os.path.join(SHAPES_DIR, d, hf_lib.CONFIG_FILE)))


def model_dir(hf_path: str) -> str | None:
  """Where a plan reads `model.hf_path`'s config.json: the directory itself when it has one,
  else the shipped shape of the same name (its last path component), else None."""
  if os.path.isfile(os.path.join(hf_path, hf_lib.CONFIG_FILE)):
    return hf_path
  name = os.path.basename(os.path.normpath(hf_path))
  return os.path.join(SHAPES_DIR, name) if name in shipped_shapes() else None


def eos_and_pad(cfg) -> tuple[tuple[int, ...], int]:
  """The end-of-sequence ids and padding id the samplers are built with: the model directory's
  config.json `eos_token_id` (int or list) and `pad_token_id` where it has them, else the
  built-in character tokenizer's (0 and 0); values only the compiled program's constants use."""
  if not cfg.model.hf_path:
    return (0,), 0
  with open(os.path.join(cfg.model.hf_path, hf_lib.CONFIG_FILE)) as f:
    hf = json.load(f)
  eos = hf.get("eos_token_id")
  eos = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else (0,))
  pad = hf.get("pad_token_id")
  return eos, pad if isinstance(pad, int) else eos[0]


def model_config(cfg, vocab: int) -> ModelConfig:
  """The train step's model config as `run.parts.build_parts` makes it: a model directory's
  config.json (shape only; no weights are read) with the run's dtypes, remat and kernels, or the
  config's own `model` section."""
  if cfg.model.hf_path:
    path = os.path.join(cfg.model.hf_path, hf_lib.CONFIG_FILE)
    with open(path) as f:
      base = hf_lib.config_from_hf(json.load(f), param_dtype=cfg.model.param_dtype,
                                   scan_layers=cfg.model.scan_layers, config_path=path)
    return with_run_settings(base, cfg)
  return ModelConfig.from_config(cfg.model, vocab)


def _spec(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def per_device_bytes(tree) -> int:
  """Bytes of `tree`'s leaves on one device: each leaf's shard (all of it when replicated)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
  return total


def _meshes(cfg, mesh_shape: config_lib.MeshShape, devices: Sequence, host_devices=None):
  """(train mesh, rollout mesh, whether each process generates its own share). On several
  processes (hosts) a colocated run generates on each process's own devices
  (`parallel.distributed.local_mesh`, as `pipeline.producer.split_by_process` lays it out when
  each process gets whole groups); the plan compiles one host's programs for `host_devices`
  (one host's slice, `targets.host_target`: a host's device ids within the whole slice are not
  a program's own 0..n-1, which XLA:TPU's deviceless compile refuses for collectives), laid out
  as `local_mesh` lays a process's devices out."""
  mesh = parallel.make_mesh(mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor,
                            list(devices[:mesh_shape.train_devices or len(devices)]))
  if mesh_shape.disaggregated:
    first = mesh_shape.train_devices
    return mesh, parallel.make_mesh(*mesh_shape.rollout_shape,
                                    list(devices[first:first + mesh_shape.rollout_devices])), False
  hosts = len({d.process_index for d in devices})
  if hosts > 1 and cfg.rollout.num_prompts % hosts == 0:
    if host_devices is None:
      return mesh, parallel.distributed.local_mesh(mesh, mesh_shape.rollout_tensor), True
    rt = mesh_shape.rollout_tensor
    grid = np.asarray(list(host_devices), dtype=object).reshape(len(host_devices) // rt, 1, rt)
    return mesh, jax.sharding.Mesh(grid, mesh.axis_names), True
  return mesh, mesh, False


def _sampler_programs(prefix: str, graphdef, params, mesh, rows: int, samples: int,
                      prompt_len: int, new_tokens: int, eos, pad) -> list[Program]:
  """Prefill and decode of the static sampler for `rows` prompts x `samples` on `mesh`, with its
  arguments as `rows_over` and the sampler place them."""
  sample = make_sampler(graphdef, num_samples=samples, max_new_tokens=new_tokens, eos_id=eos,
                        pad_id=pad)
  over = mesh.shape["data"]
  by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  rep = parallel.replicated(mesh)
  row_sh = lambda n: by_rows if over > 1 and n % over == 0 else rep
  prompts = (jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=row_sh(rows)),
             jax.ShapeDtypeStruct((rows, prompt_len), jnp.bool_, sharding=row_sh(rows)))
  n = rows * samples

  def lower_prefill():
    return sample.prefill.lower(params, *prompts, mesh=mesh)

  def lower_decode():
    cache, logits, lens = jax.eval_shape(lambda p, a, b: sample.prefill(p, a, b, mesh=mesh),
                                         params, *prompts)
    # Prefill's outputs as it places them: the cache pinned (rows over 'data', kv heads over
    # 'tensor'), the first logits and lengths by row like the prompts.
    cache = _spec(cache, kv_cache_shardings(cache, mesh, ROLLOUT_ROW_AXES))
    logits, lens = (_spec(x, jax.tree.map(lambda _: row_sh(n), x)) for x in (logits, lens))
    s = lambda shape, dt, sh=rep: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    return sample.decode.lower(params, cache, logits, lens, jax.random.key(0),
                               s((n,), jnp.int32, row_sh(n)), s((n,), jnp.float32, row_sh(n)),
                               s((), jnp.int32), s((), jnp.float32), mesh=mesh)

  what = f"{rows} prompts x {samples} samples, {prompt_len} + {new_tokens} tokens"
  return [Program(f"{prefix}prefill", "rollout", lower_prefill, f"sampler prefill: {what}"),
          Program(f"{prefix}decode", "rollout", lower_decode, f"sampler decode loop: {what}")]


def build_programs(cfg, mesh_shape: config_lib.MeshShape, devices: Sequence,
                   vocab: int = 0, only: Sequence[str] = (), host_devices=None) -> Built:
  """The programs of validated run config `cfg` (its `model.hf_path`, if any, a directory with a
  config.json) on `devices` (a target's, `jaxrl.aot.targets.devices`) laid out by `mesh_shape`.
  `vocab`: the tokenizer's size where `model.vocab_size` is 0. `only`: program names to keep
  (empty: all). `host_devices`: one host's slice, for the programs each host runs alone on
  several hosts (`_meshes`)."""
  with platform.building_for(devices):
    mesh, rollout_mesh, per_process = _meshes(cfg, mesh_shape, devices, host_devices)
    model_cfg = model_config(cfg, vocab)
    graphdef, abstract = abstract_model(model_cfg)
    params = _spec(abstract, parallel.param_shardings(abstract, mesh))
    parts = types.SimpleNamespace(cfg=cfg, graphdef=graphdef, mesh=mesh, model_cfg=model_cfg,
                                  teacher=None)
    step, init_state = build_rl_step(parts, params)
    batch = rl_batch_spec(cfg)
    row = parallel.batch_sharding(mesh)
    batch_bytes = per_device_bytes(_spec(batch, jax.tree.map(lambda _: row, batch)))
    rollout_cfg = rollout_model(cfg, model_cfg, platform.current())
    r_graphdef, r_abstract = abstract_model(rollout_cfg)
    r_params = _spec(r_abstract, parallel.param_shardings(r_abstract, rollout_mesh))
    eos, pad = eos_and_pad(cfg)
    r = cfg.rollout
    lora = lora_model(parts) is not None

  def within(fn):
    def lower():
      with platform.building_for(devices):
        return fn()
    return lower

  lp, new = r.max_prompt_len, r.max_new_tokens
  programs = [Program(
      "train_step", "train", within(lambda: lower_step(step, init_state, params, batch)),
      f"RL train step: {r.num_prompts * r.group_size} rows of {lp} + "
      f"{r.max_total_tokens or new} tokens"
      + (f", packed in {cfg.train.microbatch_tokens}-position rows" if cfg.train.packing else
         f", {config_lib.run_microbatches(cfg, mesh.shape['data'] * mesh.shape['fsdp'])} "
         "micro-batch(es)") + (", LoRA adapters" if lora else ""))]
  not_built = []
  dtype = rollout_dtype(cfg)
  leaves = jax.tree.leaves(params)
  if rollout_mesh is mesh:
    shardings = tuple(x.sharding for x in leaves)
    programs.append(Program(
        "publish", "rollout",
        within(lambda: cast_program(shardings, dtype).lower(list(leaves))),
        f"publish a version: the sampler's copy in {dtype or model_cfg.param_dtype}"))
  elif per_process:
    # `ProcessShare.publish`: the cast on the train mesh (a narrower dtype first), then one
    # global copy onto every process's rollout devices (`publish_local`).
    stacked = parallel.distributed.every_local_mesh(
        mesh, rollout_mesh.shape["tensor"], len({d.process_index for d in devices}))
    onto = tuple(jax.tree.leaves(parallel.param_shardings(r_abstract, stacked)))
    r_leaves = [jax.ShapeDtypeStruct(x.shape, y.dtype, sharding=x.sharding)
                for x, y in zip(leaves, jax.tree.leaves(r_abstract))]
    programs.append(Program(
        "publish", "rollout",
        within(lambda: jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                               out_shardings=list(onto)).lower(r_leaves)),
        f"publish a version: every host's copy on its own chips, in "
        f"{dtype or model_cfg.param_dtype}"))
  else:
    not_built.append("publish (a reshard onto the rollout devices)")
  hosts = len({d.process_index for d in devices}) if per_process else 1
  with platform.building_for(devices):
    programs += [dataclasses.replace(p, lower=within(p.lower)) for p in _sampler_programs(
        "", r_graphdef, r_params, rollout_mesh, r.num_prompts // hosts, r.group_size, lp,
        new, eos, pad)]
    if cfg.val.every:
      # Validation generates inline on the train mesh when it spans processes
      # (`rollout.samplers.build_samplers`).
      v_mesh = mesh if per_process else rollout_mesh
      v_params = _spec(r_abstract, parallel.param_shardings(r_abstract, v_mesh))
      programs += [dataclasses.replace(p, lower=within(p.lower)) for p in _sampler_programs(
          "val_", r_graphdef, v_params, v_mesh, cfg.val.batch_size,
          cfg.val.samples_per_prompt, lp, new, eos, pad)]
  if r.engine == "continuous":
    not_built.append("the continuous engine's programs (planned as the static sampler's)")
  if cfg.distill.teacher:
    not_built.append("the distillation teacher's pass")
  if only:
    programs = [p for p in programs if p.name in only]
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  return Built(programs, model_cfg, rollout_cfg, mesh, rollout_mesh,
               not mesh_shape.disaggregated, count,
               per_device_bytes(r_params), batch_bytes, tuple(not_built))
