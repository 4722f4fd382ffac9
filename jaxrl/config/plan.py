"""The dry run's text (`python -m jaxrl.train --print_config`): a validated config and its plan.

The plan is what the run would lay out, from the same functions the run uses: the devices and
meshes (`jaxrl.config.mesh`), the RL batch and its micro-batches (`jaxrl.config.microbatch`) and
the memory plan per device (`jaxrl.config.memory`). Nothing is built or compiled. No jax here:
the caller passes the device count and backend.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from jaxrl.config import memory, reference
from jaxrl.config.mesh import MeshShape
from jaxrl.config.microbatch import run_microbatches
from jaxrl.config.schema import PREFIX, flatten, is_section
from jaxrl.recipes import default as default_config


def config_lines(cfg: ConfigDict) -> list[str]:
  """Every key as `--config.KEY=VALUE`, in default.py's order; a value that differs from the
  default says so."""
  ref, flat = flatten(default_config.get_config()), flatten(cfg)
  order = {k: i for i, k in enumerate(reference.help_texts())}
  out = []
  for key in sorted(flat, key=lambda k: order.get(k, len(order))):
    value = flat[key]
    if is_section(value):
      continue
    note = "" if ref.get(key) == value else f"  (default {reference.show(ref.get(key))})"
    out.append(f"--{PREFIX}{key}={reference.show(value)}{note}")
  return out


def plan_lines(cfg: ConfigDict, mesh: MeshShape, num_devices: int, backend: str,
               num_processes: int = 1) -> list[str]:
  """The plan: devices, meshes, the RL batch and its micro-batches, memory per device."""
  r, t = cfg.rollout, cfg.train
  out = [f"devices: {num_devices} {backend} device(s) in {num_processes} process(es)"]
  out.append(f"train mesh: data {mesh.data} x fsdp {mesh.fsdp} x tensor {mesh.tensor} "
             f"({mesh.size} device(s))")
  if mesh.disaggregated:
    d, f, tp = mesh.rollout_shape
    where = (f" on process(es) {', '.join(map(str, mesh.rollout_processes))}"
             if mesh.rollout_processes else "")
    out.append(f"rollout mesh: {mesh.rollout_devices} device(s){where}, {d} x {f} x {tp} "
               "(disaggregated)")
  else:
    out.append("rollout mesh: colocated (the train mesh's devices)")
  shards = mesh.data * mesh.fsdp
  rows = r.num_prompts * r.group_size
  completion = r.max_total_tokens or r.max_new_tokens
  m = run_microbatches(cfg, shards)
  how = "train.num_microbatches" if t.num_microbatches else \
      f"auto: within train.microbatch_tokens = {t.microbatch_tokens} per device"
  if t.packing:
    out.append(f"RL batch: {r.num_prompts} prompts x {r.group_size} samples = {rows} rows of "
               f"<= {r.max_prompt_len} + {completion} tokens, packed into rows of "
               f"{t.microbatch_tokens} positions per batch shard ({shards} shard(s))")
  else:
    out.append(f"RL batch: {r.num_prompts} prompts x {r.group_size} samples = {rows} rows of "
               f"{r.max_prompt_len} + {completion} tokens over {shards} batch shard(s); "
               f"{m} micro-batch(es) of {rows // max(shards, 1) // m} rows per shard ({how})")
  out.append(f"steps: {t.steps} RL step(s), rollout.lag {r.lag}, engine {r.engine}"
             + (f"; supervised warm-up up to {cfg.sft.max_steps} step(s)"
                if cfg.sft.enabled and cfg.sft.max_steps else ""))
  inputs = memory.inputs_from_config(flatten(cfg), mesh, backend, num_processes)
  if inputs is None:
    out.append("memory plan: not known for this model")
  else:
    plan = memory.plan_memory(inputs)
    out.append(plan.render())
  return out


def dry_run_text(cfg: ConfigDict, mesh: MeshShape, num_devices: int, backend: str,
                 num_processes: int = 1) -> str:
  """What `--print_config` prints: the resolved config, then the plan."""
  return "\n".join(["# resolved config", *config_lines(cfg), "", "# plan",
                    *plan_lines(cfg, mesh, num_devices, backend, num_processes),
                    "", "(dry run: nothing was compiled, created or written)"])
