"""What a run is built from: `build_parts(cfg, mesh_shape)` checks what the config alone could
not (the task's rows, the model directory, the vocabulary), then builds the tokenizer, tasks,
meshes, model and data plane, and returns them as one immutable `Parts` with the initial params.

Params are not part of `Parts`: they live in the train state of the phase running (the warm-up
returns its params, RL starts from them). Environments and the task source can be given instead
of the config's (`envs=`, `source=`): the seam for faulty graders and injected rows.

The samplers may run in another precision than the trainer (`rollout.dtype`): they are built
from `rollout_graphdef` (params and compute, so the KV cache, in that dtype), and every
published version goes through `rollout_copy`, which casts it. Evaluation generates with the
published copy, so it measures the rollout-precision policy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxrl import config as config_lib
from jaxrl import parallel
from jaxrl.data import left_pad
from jaxrl.data.sources import CheckedSource, RowProblem, SkipReport
from jaxrl.envs import make_env
from jaxrl.envs.agent_task import is_agent
from jaxrl.models import ModelConfig, abstract_model, init_model
from jaxrl.models import hf_checkpoint as hf_lib
from jaxrl.pipeline import DataPlane
from jaxrl.rollout.multi_turn import Budget, MultiTurn
from jaxrl.rollout.precision import moved_copy, rollout_dtype, rollout_model
from jaxrl.parallel.sides import sides as remote_sides
from jaxrl.rollout.samplers import NewestParams, build_samplers
from jaxrl.learner.step import shard_params
from jaxrl.run import teacher as teacher_lib
from jaxrl.run.inputs import make_tokenizer, task_source  # noqa: F401  (re-exported)
from jaxrl.serving.agents import agent_loop
from jaxrl.core.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class Parts:
  """Everything a run is built from, before any step runs (see `build_parts`)."""
  cfg: ConfigDict
  task: object | None  # the warm-up's task with demonstrations and a `dev` split, if any
  tok: object
  envs: Mapping[str, object]
  source: CheckedSource
  mesh: jax.sharding.Mesh
  rollout_mesh: jax.sharding.Mesh  # `mesh` itself when colocated
  model_cfg: ModelConfig
  graphdef: object
  # Every sampler's model (training, later turns, evaluation): `graphdef` itself unless
  # `rollout.dtype` asks for another precision (`jaxrl.rollout.precision`).
  rollout_graphdef: object
  rollout_shardings: object
  data: DataPlane  # rows of partitions `train` and `val`: metadata here, arrays on `mesh`
  budget: Budget
  val_loop: MultiTurn  # evaluation's multi-turn loop (never partial)
  # On-policy distillation's frozen teacher on `mesh` (`distill.teacher`), or None.
  teacher: object = None

  def train_loop(self, newest: NewestParams | None = None,
                 mesh: jax.sharding.Mesh | None = None, turns=None) -> MultiTurn:
    """The training rollouts' multi-turn loop; `newest` is the newest-params source of partial
    rollouts (the lag pipeline's). `mesh`: the mesh it generates on, default `rollout_mesh`
    (several processes: each process's own devices, `ProcessShare.mesh`). `turns`: the
    `SamplerFirst` its device sections mark, or None."""
    if is_agent(self.cfg.task.name):  # the agent's episodes, through the run's own server
      return agent_loop(self, self.cfg.rollout.group_size, newest)
    s = build_samplers(self.cfg, self.rollout_graphdef, self.tok, mesh or self.rollout_mesh,
                       newest)
    return MultiTurn(self.tok, self.envs, self.budget, self.cfg.rollout.group_size, s.train,
                     s.next_turn, parallel.distributed.fetch, self.cfg.env.timeout_s, turns)

  def for_rollout(self, params):
    """`params` placed for generation: as they are when colocated; else a copy on the rollout
    mesh, resharded shard by shard (no leaf is gathered whole onto one device). Params already
    there are returned as they are."""
    if self.rollout_mesh is self.mesh:
      return params
    leaf = jax.tree.leaves(params)[0]
    if leaf.sharding == jax.tree.leaves(self.rollout_shardings)[0]:
      return params
    return parallel.reshard(params, self.rollout_shardings)

  def rollout_place(self, tree, share=None):
    """`tree` (params or a part of them, e.g. LoRA adapters) moved where the samplers generate,
    as it is (no cast; `rollout_copy` makes the sampler's own copy): itself when colocated; a
    reshard onto the rollout mesh by the parameter rules; on several processes (`share`) each
    process's copy on its own devices, a global program every process launches in the same
    order. What `jaxrl.models.lora.AdapterSync` moves the base and the adapters with."""
    if share is not None:
      return parallel.distributed.publish_local(tree, share.train_mesh, share.mesh)
    if self.rollout_mesh is self.mesh:
      return tree
    return parallel.reshard(tree, parallel.param_shardings(tree, self.rollout_mesh))

  def rollout_copy(self, params, share=None):
    """The sampler's own copy of a params version (what the lag pipeline publishes): new
    buffers, never those of `params` (the train step donates them), in the rollout dtype, where
    the samplers generate. Colocated, a cast (or copy) on the same shardings; disaggregated, a
    reshard onto the rollout mesh, cast on the train mesh first where the rollout dtype is
    narrower (half the bytes moved, and the rollout mesh never holds the wide copy), after the
    reshard where it is wider; on several processes (`share`, a `ProcessShare`) each process's
    copy on its own devices, `share.publish`, which casts the same way."""
    if share is not None:
      return share.publish(params)
    return moved_copy(params, rollout_dtype(self.cfg), self.for_rollout)

  def row_problem(self, task) -> RowProblem | None:
    """What makes a task row unusable, as (reason, detail, size), or None."""
    return row_problem(task, self.envs, self.tok, self.cfg.rollout.max_prompt_len)

  def sft_batch(self, problems) -> TrainBatch:
    """A warm-up batch: each problem's prompt and demonstration (the loss mask)."""
    n = self.cfg.rollout.max_new_tokens
    b = len(problems)
    prompts, valid = left_pad([self.tok.encode_prompt(p.prompt) for p in problems],
                              self.cfg.rollout.max_prompt_len, self.tok.pad_id)
    tokens = np.full((b, n), self.tok.pad_id, np.int32)
    mask = np.zeros((b, n), bool)
    for i, p in enumerate(problems):
      demo = self.task.demonstration(p)
      tokens[i, :len(demo)] = demo
      mask[i, :len(demo)] = True
    return TrainBatch(prompts, valid, tokens, mask, np.zeros((b, n), np.float32),
                      np.zeros(b, np.float32), np.arange(b, dtype=np.int32),
                      np.ones(b, np.float32))


def row_problem(task, envs, tok, max_prompt_len: int) -> RowProblem | None:
  """What makes `task` unusable (a too-long prompt's size is its tokens), or None."""
  if task.env not in envs:
    return RowProblem("unknown_task", f"task {task.env!r} is not one of {sorted(envs)}")
  if not task.prompt.strip():
    return RowProblem("empty_prompt", "the prompt is empty")
  try:
    n = len(tok.encode_prompt(task.prompt))
  except ValueError as e:
    return RowProblem("undecodable", str(e))
  if n > max_prompt_len:
    return RowProblem("too_long", f"{n} prompt tokens, over rollout.max_prompt_len="
                      f"{max_prompt_len}", n)
  return None


def skip_hint(report: SkipReport, max_prompt_len: int) -> str:
  """How to fix the skips of `report`: the longest prompt and the key it is over, else the first
  bad row of each other reason."""
  out = []
  for reason, (size, uid, prompt) in sorted(report.worst.items()):
    if reason == "too_long":
      out.append(f"the longest prompt has {size} tokens (row {uid!r}: {prompt!r}), over "
                 f"rollout.max_prompt_len={max_prompt_len} (--config.rollout.max_prompt_len="
                 f"{size} fits every prompt)")
    else:
      out.append(f"{reason}: e.g. row {uid!r}")
  return "; ".join(out)


def _model_vocab(cfg, problems: list[str]) -> tuple[int, str]:
  """The model's vocabulary size and where it comes from (0 after a problem)."""
  if not cfg.model.hf_path:
    return cfg.model.vocab_size, "config.model.vocab_size"
  config_path = os.path.join(cfg.model.hf_path, hf_lib.CONFIG_FILE)
  try:
    with open(config_path) as f:
      model_cfg = hf_lib.config_from_hf(json.load(f), param_dtype=cfg.model.param_dtype,
                                        scan_layers=cfg.model.scan_layers,
                                        config_path=config_path)
    return model_cfg.vocab_size, f"{config_path} vocab_size"
  except (ValueError, NotImplementedError) as e:  # names the file and field
    problems.append(f"config.model.hf_path: {e}")
    return 0, ""


def with_run_settings(model_cfg: ModelConfig, cfg: ConfigDict) -> ModelConfig:
  """A model directory's config with the run's own settings: the compute dtype, remat and the
  kernels (`model.attention`, `decode_attention`, `moe_dispatch`, `moe_capacity_factor`)."""
  return dataclasses.replace(model_cfg, dtype=cfg.model.dtype, remat=cfg.model.remat,
                             attention=cfg.model.attention,
                             decode_attention=cfg.model.get("decode_attention", "auto"),
                             moe_dispatch=cfg.model.get("moe_dispatch", "auto"),
                             moe_capacity_factor=cfg.model.get("moe_capacity_factor", 0.0))


def build_parts(cfg: ConfigDict, mesh_shape: config_lib.MeshShape, *,
                envs: Mapping[str, object] | None = None, source=None) -> tuple[Parts, object]:
  """The parts of a run of validated config `cfg` on `mesh_shape`, and the initial params.

  `envs` (name -> environment) replace the registered environments of those names; `source`
  replaces the config's task source. Problems only the data or the model directory reveal are
  raised together as one `ConfigError`, before anything is compiled; a split that would skip
  more than `data.max_skipped_frac` of its rows raises `TooManySkipped` before them.
  """
  names = cfg.task.name.split("+")
  source = task_source(cfg) if source is None else source
  tok = make_tokenizer(cfg, source)
  envs = {name: (envs or {}).get(name) or make_env(name) for name in names}
  # Rows are checked when drawn: skipped and counted (data/skipped/<reason>) or raised with the
  # row named, by data.on_bad_row; the splits are checked here, before compiling, and a run that
  # would skip more than data.max_skipped_frac of either stops now (a source that cannot list its
  # train rows is judged on its first draws instead).
  max_len = cfg.rollout.max_prompt_len
  checked = CheckedSource(source, lambda t: row_problem(t, envs, tok, max_len),
                          cfg.data.on_bad_row, max_skipped_frac=cfg.data.max_skipped_frac,
                          hint=lambda report: skip_hint(report, max_len))
  val_rows = checked.split("val")  # checked once, its report kept in checked.scanned
  for report in (checked.scan("train"), checked.scanned.get("val")):
    error = None if report is None else checked.too_many(report)
    if error is not None:
      raise error
  problems = []
  if not val_rows:
    problems.append(f"config.task.name: task {cfg.task.name!r} has no usable validation rows "
                    f"(skipped: {checked.skipped})")
  vocab, vocab_key = _model_vocab(cfg, problems)
  if vocab and vocab < tok.vocab_size:
    problems.append(f"{vocab_key}: the tokenizer needs {tok.vocab_size}, got {vocab}")
  if mesh_shape.disaggregated and jax.process_count() > 1 and not mesh_shape.rollout_processes:
    problems.append(
        f"config.mesh.rollout: a rollout mesh of devices within processes runs in one process; "
        f"with {jax.process_count()} processes name whole processes with "
        "config.mesh.rollout_processes (e.g. '0'), or set it to 0 (colocated)")
  if problems:
    raise config_lib.ConfigError(problems)

  devices = jax.devices()
  if mesh_shape.rollout_processes:
    # Disaggregated across processes (`jaxrl.pipeline.remote`): the train side's meshes are the
    # train processes' devices (evaluation generates there too); a rollout process's, its own
    # devices, which it generates on as one process would.
    me = jax.process_index()
    train_devs, rollout_devs = remote_sides(mesh_shape)
    devices = train_devs
    if me in mesh_shape.rollout_processes:
      devices = [d for d in rollout_devs if d.process_index == me]
      mesh_shape = config_lib.MeshShape(*mesh_shape.rollout_shape)
  mesh = parallel.make_mesh(mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor,
                            devices[:mesh_shape.train_devices or len(devices)])
  # Rollouts are generated on `rollout_mesh`: the train mesh itself when colocated, else the
  # `rollout_devices` after the train devices, params tensor-parallel and rows split over
  # 'data'. Params reach it through `for_rollout`, which reshards shard by shard.
  rollout_mesh = mesh
  if mesh_shape.disaggregated and not mesh_shape.rollout_processes:
    first = mesh_shape.train_devices
    rollout_mesh = parallel.make_mesh(*mesh_shape.rollout_shape,
                                      devices[first:first + mesh_shape.rollout_devices])
  if cfg.model.hf_path:
    # Straight onto the mesh from the memory-mapped files; the compute dtype is the run's.
    try:
      model_cfg, _, params = hf_lib.load_hf(cfg.model.hf_path, mesh=mesh,
                                            param_dtype=cfg.model.param_dtype,
                                            scan_layers=cfg.model.scan_layers)
    except hf_lib.HFCheckpointError as e:  # a missing shard or tensor, a wrong shape
      raise config_lib.ConfigError([f"config.model.hf_path: {e}"]) from None
    model_cfg = with_run_settings(model_cfg, cfg)
    graphdef, _ = abstract_model(model_cfg)
  else:
    model_cfg = ModelConfig.from_config(cfg.model, tok.vocab_size)
    graphdef, params = init_model(model_cfg, cfg.seed)
    params = shard_params(params, mesh)
  rollout_cfg = rollout_model(cfg, model_cfg)
  rollout_graphdef = graphdef if rollout_cfg is model_cfg else abstract_model(rollout_cfg)[0]
  teacher = None
  if cfg.distill.teacher:
    teacher = teacher_lib.load(cfg, tok, model_cfg.vocab_size, mesh)
  r = cfg.rollout
  budget = Budget(max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
                  max_total_tokens=r.max_total_tokens or r.max_new_tokens, max_turns=r.max_turns)
  samplers = build_samplers(cfg, rollout_graphdef, tok, rollout_mesh)
  val_loop = MultiTurn(tok, envs, budget, cfg.val.samples_per_prompt, samplers.val,
                       samplers.next_turn, parallel.distributed.fetch, cfg.env.timeout_s)
  parts = Parts(cfg=cfg, task=getattr(source, "task", None), tok=tok, envs=envs, source=checked,
                mesh=mesh, rollout_mesh=rollout_mesh, model_cfg=model_cfg, graphdef=graphdef,
                rollout_graphdef=rollout_graphdef,
                rollout_shardings=parallel.param_shardings(params, rollout_mesh),
                data=DataPlane(mesh), budget=budget, val_loop=val_loop, teacher=teacher)
  if is_agent(cfg.task.name):  # validation plays the agent's episodes too
    parts = dataclasses.replace(parts, val_loop=agent_loop(parts, cfg.val.samples_per_prompt))
  return parts, params
