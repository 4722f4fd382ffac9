"""Memory plan: per-device bytes of one jaxrl GRPO setup on a mesh, without weights.

For Qwen2.5-0.5B / 1.5B / 7B shapes (or any `ModelConfig`) and a ('data', 'fsdp', 'tensor') mesh:
params, optimizer state, gradients, train batch and the sampler's KV cache per device, from
`jax.eval_shape` of jaxrl's own builders (`build_train_step`, `make_optimizer`, `make_sampler`)
under the shardings they use; with `--compile`, also the compiled train step's and sampler's
`memory_analysis()`. The KV cache is sized on the rollout mesh (`--rollout-mesh`, default the
train mesh: colocated), split as the sampler pins it (rows over 'data', kv heads over 'tensor':
`parallel.sharding.kv_cache_shardings`), next to its replicated size (every device holding all
of it, as before the sampler pinned it). Nothing is allocated: every argument is a
`jax.ShapeDtypeStruct`, so sizing a 7B run needs no weights and no accelerator (simulate the
slice with `--devices N`).

Prints one JSON object per model (one line each, as it finishes) and then a summary object
(one line) on stdout; progress goes to stderr. `--out FILE` writes all of it as one JSON object.

Per-device bytes of a leaf = prod(sharding.shard_shape(shape)) x itemsize (a replicated leaf
counts in full on every device). Totals:
  train   = compiled step: argument + output - alias + temp (donated state counted once);
            not compiled: params + optimizer state + gradients + batch
  rollout = compiled: max(prefill, decode) peak, each argument + output - alias + temp
            (includes the params it reads and the KV cache); not compiled: params + KV cache
  lag0    = max(train + the published params copy, params + optimizer state + rollout):
            sampling and training alternate
  lag1    = train + rollout: batch t+1 is sampled (with the published params copy) while step t
            trains, on the same devices

  PYTHONPATH=. python benchmarks/memory_plan.py --models 0.5b,1.5b,7b --devices 8 --mesh 1,8,1
  PYTHONPATH=. python benchmarks/memory_plan.py --models 0.5b,1.5b --devices 8 --compile
  PYTHONPATH=. python benchmarks/memory_plan.py --quick   # smoke test: tiny model, compiled
  PYTHONPATH=. python benchmarks/memory_plan.py --models 0.5b --compile --remat full
  # a recipe's sizes, dtypes, step and mesh; its KV cache on an 8-device rollout mesh
  PYTHONPATH=. python benchmarks/memory_plan.py --recipe configs/qwen2_5_0_5b_gsm8k.py
      --models 0.5b --devices 8 --rollout-mesh 8,1,1

Every model's line also holds `library_plan`: the run's own plan (`jaxrl.config.memory`, what
validation checks against the device before compiling, and what the run prints at its start) for
the same shapes, colocated, with the train batch as the rollout's P x G rows; compiled, its
train-step temporaries (gradients + activations) and sampler peak next to `memory_analysis()`'s
(`ratio` = planned / compiled). The summary row's `plan_total_gib` is its total.

`--remat none|full|dots` sets `ModelConfig.remat` (per-layer rematerialisation in the train step;
the sampler never uses it); the default is the default run config's `model.remat` ("none").

`--lora-rank R` (0: off) also plans each model with LoRA adapters (`jaxrl.models.lora`; rank R,
`--lora-alpha`, `--lora-targets`, default all seven projections), as the trainer builds it: the
base frozen in `--param-dtype` (`frozen_params`), the adapters (f32, replicated by their sharding
rule) the state's trained params (`trainable_params`), gradients and Adam's mu + nu for them
alone; the sampler gets merged weights in the base layout (`published_params`, KV cache as
without LoRA). Each model's line then holds `with_lora` (that plan) and `lora_comparison` (per
device bytes without / with), and the summary a row "<model> lora<R>" after the model's own.
`params` counts the model's own parameters (never the adapters; `trainable_params` counts what
trains), and `per_device_bytes.params` every param resident on a device (base + adapters).

  PYTHONPATH=. python benchmarks/memory_plan.py --models 0.5b,1.5b,7b --devices 8 --lora-rank 16
"""

from __future__ import annotations

import argparse
import os
import sys


def _devices_from_argv(argv: list[str]) -> int | None:
  """`--devices N` read before JAX is imported (XLA reads its flags once, at backend start)."""
  for i, a in enumerate(argv):
    if a == "--devices" and i + 1 < len(argv):
      return int(argv[i + 1])
    if a.startswith("--devices="):
      return int(a.split("=", 1)[1])
  return None


if __name__ == "__main__":
  _n = _devices_from_argv(sys.argv[1:])
  if _n:
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f"--xla_force_host_platform_device_count={_n}"])

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.recipes.default import get_config  # noqa: E402
from jaxrl.kernels.fused_logprob.api import default_impl  # noqa: E402
from jaxrl.models import lora as lora_lib  # noqa: E402
from jaxrl.models.layers import lora_dims  # noqa: E402
from jaxrl.models.model_config import REMAT_POLICIES, ModelConfig  # noqa: E402
from jaxrl.models.transformer import abstract_model  # noqa: E402
from jaxrl.parallel import batch_sharding, make_mesh, param_shardings  # noqa: E402
from jaxrl.parallel.sharding import kv_cache_shardings, mesh_of  # noqa: E402
from jaxrl.rollout.static_sampler import make_sampler  # noqa: E402
from jaxrl.learner.step import build_train_step, make_optimizer  # noqa: E402
from jaxrl.learner.rl import rl_step_config  # noqa: E402
from jaxrl.core.types import TrainBatch  # noqa: E402
from jaxrl.config import memory  # noqa: E402
from jaxrl.config.mesh import MeshShape  # noqa: E402
from jaxrl.config.schema import flatten  # noqa: E402

GIB = 1 << 30

# Shapes of the published Hugging Face config.json files (Qwen/Qwen2.5-*); `params` is the
# published total, checked against the count of the built model.
QWEN = {
    "0.5b": ("Qwen2.5-0.5B", dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14,
                                  num_kv_heads=2, head_dim=64, mlp_dim=4864,
                                  tie_embeddings=True), 494_032_768),
    "1.5b": ("Qwen2.5-1.5B", dict(vocab_size=151936, d_model=1536, num_layers=28, num_heads=12,
                                  num_kv_heads=2, head_dim=128, mlp_dim=8960,
                                  tie_embeddings=True), 1_543_714_304),
    "7b": ("Qwen2.5-7B", dict(vocab_size=152064, d_model=3584, num_layers=28, num_heads=28,
                              num_kv_heads=4, head_dim=128, mlp_dim=18944,
                              tie_embeddings=False), 7_615_616_512),
}
CPU_NOTE = ("compiled by the CPU backend: sizes are per device of the SPMD-partitioned program, "
            "but CPU fusion and buffer assignment, not TPU's; CPU upcasts bf16 dot operands to f32 "
            "(temps of bf16 models are over-counted); the fused log-prob runs the `xla` impl, not "
            "TPU's `pallas`; no TPU tile padding, collective buffers or runtime reserve")
# The compiled programs are never run, so on CPU skip LLVM's optimisation of the generated code:
# buffer assignment (all memory_analysis() reports) happens before it and is unchanged (checked:
# identical fields for the 0.5B step), and compiles take about 60% of the time.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                        "xla_llvm_disable_expensive_passes": True}
MA_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
             "alias_size_in_bytes", "generated_code_size_in_bytes")


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def qwen_config(name: str, param_dtype: str = "bfloat16", dtype: str | None = None,
                remat: str = "none") -> ModelConfig:
  """Qwen2.5 shapes (qkv bias, RoPE theta 1e6, RMSNorm eps 1e-6), layers scanned."""
  _, shape, _ = QWEN[name]
  return ModelConfig(**shape, rope_theta=1e6, rms_eps=1e-6, qkv_bias=True,
                     param_dtype=param_dtype, dtype=dtype or param_dtype, scan_layers=True,
                     remat=remat)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """One GRPO step: the train batch and the rollout batch that fills it."""

  rows: int  # B: train rows per step
  train_prompt_len: int  # Lp of the train batch
  train_new_tokens: int  # N of the train batch (B x (Lp + N) tokens per step)
  microbatches: int
  prompts: int  # P: rollout prompts
  group: int  # G: samples per prompt (rollout rows = P x G)
  prompt_len: int  # rollout prompt length
  new_tokens: int  # rollout completion budget (cache slots = prompt_len + new_tokens)


# ---- bytes --------------------------------------------------------------------------------------


def leaf_bytes(x) -> int:
  """Bytes of one leaf on one device: its shard if it has a sharding, else all of it."""
  shape = tuple(x.shape)
  sh = getattr(x, "sharding", None)
  if sh is not None:
    shape = tuple(sh.shard_shape(shape))
  return math.prod(shape) * np.dtype(x.dtype).itemsize


def per_device_bytes(tree) -> int:
  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def global_bytes(tree) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def count(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def spec_str(sharding) -> str:
  spec = getattr(sharding, "spec", None)
  return "replicated" if sharding is None or getattr(sharding, "is_fully_replicated", False) \
      else str(spec)


def memory_stats(compiled) -> tuple[dict | None, str | None]:
  """The memory_analysis() fields as ints, or (None, why)."""
  try:
    ma = compiled.memory_analysis()
  except Exception as e:  # some backends raise instead of returning None
    return None, f"memory_analysis() raised {type(e).__name__}: {e}"
  if ma is None:
    return None, f"memory_analysis() returned None on backend {jax.default_backend()!r}"
  out, missing = {}, []
  for f in MA_FIELDS:
    v = getattr(ma, f, None)
    if v is None:
      missing.append(f)
    else:
      out[f] = int(v)
  note = f"missing fields: {', '.join(missing)}" if missing else None
  if {"argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"} <= out.keys():
    out["peak_estimate_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                  - out.get("alias_size_in_bytes", 0)
                                  + out["temp_size_in_bytes"])
  return out, note


def _compile(name: str, jitted, *args, **kwargs) -> tuple[object, dict]:
  log(f"compiling {name} ...")
  t0 = time.perf_counter()
  lowered = jitted.lower(*args, **kwargs)
  t1 = time.perf_counter()
  opts = CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
  compiled = lowered.compile(compiler_options=opts) if opts else lowered.compile()
  t2 = time.perf_counter()
  stats, note = memory_stats(compiled)
  log(f"compiled {name}: lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s")
  return compiled, {"lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                    "compiler_options": opts or {}, "memory_analysis": stats,
                    **({"memory_analysis_note": note} if note else {})}


# ---- the plan -----------------------------------------------------------------------------------


def abstract_batch(s: Sizes, mesh) -> TrainBatch:
  """The trainer's batch (every field it reads), rows over ('data', 'fsdp')."""
  row = batch_sharding(mesh)
  B, Lp, N = s.rows, s.train_prompt_len, s.train_new_tokens
  a = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=row)
  return TrainBatch(prompt_tokens=a((B, Lp), jnp.int32), prompt_valid=a((B, Lp), jnp.bool_),
                    tokens=a((B, N), jnp.int32), mask=a((B, N), jnp.bool_),
                    rollout_logprobs=a((B, N), jnp.float32), rewards=a((B,), jnp.float32),
                    group_id=a((B,), jnp.int32), temperature=a((B,), jnp.float32),
                    completion_valid=a((B, N), jnp.bool_))


def check_sizes(s: Sizes, mesh) -> None:
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if s.rows % s.microbatches:
    raise ValueError(f"--batch {s.rows} is not divisible by --microbatches {s.microbatches}")
  if (s.rows // s.microbatches) % shards:
    raise ValueError(f"each micro-batch ({s.rows} / {s.microbatches} rows) must be divisible by "
                     f"data x fsdp = {shards}")
  if s.train_new_tokens < 1:
    raise ValueError("--seq must exceed the train prompt length")


def rollout_inputs(model_cfg: ModelConfig, rollout_mesh, sizes: Sizes, graphdef=None,
                   params=None):
  """The static sampler and its abstract inputs as the trainer calls it on `rollout_mesh`: params
  by the logical-axis rules there, prompt rows over 'data' where it divides them (`rows_over`)
  -> (sampler, params, (prompts, prompt_valid), the mesh its programs split the cache over)."""
  if graphdef is None:
    graphdef, params = abstract_model(model_cfg)
  sample = make_sampler(graphdef, num_samples=sizes.group, max_new_tokens=sizes.new_tokens,
                        eos_id=0, pad_id=0)
  sharded_params = with_shardings(params, param_shardings(params, rollout_mesh))
  P, Lp = sizes.prompts, sizes.prompt_len
  rows = None if P % rollout_mesh.shape["data"] else \
      jax.sharding.NamedSharding(rollout_mesh, jax.sharding.PartitionSpec("data"))
  prompts = (jax.ShapeDtypeStruct((P, Lp), jnp.int32, sharding=rows),
             jax.ShapeDtypeStruct((P, Lp), jnp.bool_, sharding=rows))
  return sample, sharded_params, prompts, mesh_of(sharded_params)


def kv_cache_plan(model_cfg: ModelConfig, rollout_mesh, sizes: Sizes, graphdef=None,
                  params=None) -> tuple[dict, object]:
  """The sampler's KV cache for P x G rows on `rollout_mesh`, from `jax.eval_shape` of its
  prefill -> (report, the cache as ShapeDtypeStructs with the shardings the sampler pins).

  `replicated_bytes`: per device with the whole cache on every device (before the sampler pinned
  it; XLA's choice could split kv heads over 'tensor' at most). `per_device_bytes`: as pinned,
  rows over 'data' and kv heads over 'tensor' (a dim they do not divide replicated)."""
  sample, sharded_params, prompts, mesh = rollout_inputs(model_cfg, rollout_mesh, sizes, graphdef,
                                                         params)
  cache, _, _ = jax.eval_shape(functools.partial(sample.prefill, mesh=mesh), sharded_params,
                               *prompts)
  cache = with_shardings(cache, kv_cache_shardings(cache, rollout_mesh))
  stacked = lambda x: [len(x), *x[0].shape] if isinstance(x, tuple) else list(x.shape)
  first = lambda t: jax.tree.leaves(t)[0]  # unrolled models: one array per layer
  kv = {"k_shape": stacked(cache.k), "v_shape": stacked(cache.v),
        "dtype": str(np.dtype(first(cache.k).dtype)), "rows": sizes.prompts * sizes.group,
        "slots": sizes.prompt_len + sizes.new_tokens, "rollout_mesh": dict(rollout_mesh.shape),
        "sharding": {"k": spec_str(first(cache.k).sharding), "v": spec_str(first(cache.v).sharding),
                     "valid": spec_str(cache.valid.sharding)},
        "sharded_as": "pinned by the sampler: rows over 'data', kv heads over 'tensor'",
        "replicated_bytes": global_bytes(cache), "per_device_bytes": per_device_bytes(cache),
        "shards": global_bytes((cache.k, cache.v)) // per_device_bytes((cache.k, cache.v))}
  return kv, cache


def plan(model_cfg: ModelConfig, mesh, sizes: Sizes, *, compile_train: bool = False,
         compile_rollout: bool = False, compile_decode: bool = True, cfg=None,
         rollout_mesh=None) -> dict:
  """Per-device memory of one GRPO setup. `cfg`: a run config (default: `get_config()`) whose
  `train` (optimizer) and `loss` / `advantage` / `rollout_kl` / `ref_kl` sections pick the step.
  `rollout_mesh` (default `mesh`: colocated) is where the sampler runs. `compile_rollout`
  compiles the sampler's prefill (its output shardings must be the cache's planned ones) and,
  with `compile_decode`, its decode loop."""
  check_sizes(sizes, mesh)
  cfg = cfg or get_config()
  t = cfg.train
  graphdef, params = abstract_model(model_cfg)
  lora = model_cfg.lora_rank > 0
  # The sampler runs the base model's layout: with LoRA it gets merged weights (the trainer's
  # `model.lora.rollout = "merge"`), so its params and KV cache are the base model's.
  base_graphdef, base_params = abstract_model(lora_lib.base_config(model_cfg)) if lora else \
      (graphdef, params)
  optimizer = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                             grad_clip=t.grad_clip, warmup_steps=t.warmup_steps)
  step_cfg = dataclasses.replace(rl_step_config(cfg), num_microbatches=sizes.microbatches)
  # With LoRA the builder makes the state's params the adapters alone (their gradients and
  # optimizer state only) and keeps the base in `frozen`, a separate argument of the step.
  step, init_state = build_train_step(graphdef, optimizer, step_cfg, mesh, params)
  batch = abstract_batch(sizes, mesh)
  state0, frozen = jax.eval_shape(init_state, params), ()
  if lora:
    frozen = (with_shardings(state0.frozen, step.frozen_shardings),)
    state0 = state0._replace(frozen=None)
  # The step's own out_shardings give the train state exactly as the builder places it (params
  # by the logical-axis rules, optimizer state like its params, scalars replicated).
  state, _ = jax.eval_shape(step.jitted, state0, batch, *frozen)
  trained = per_device_bytes(state.params)
  frozen_bytes = per_device_bytes(frozen)
  b = {
      # Every param of the model resident on a device: with LoRA, the frozen base + adapters.
      "params": trained + frozen_bytes,
      "trainable_params": trained,
      "frozen_params": frozen_bytes,
      "optimizer_state": per_device_bytes(state.opt_state),
      # The step's gradient accumulator is `zeros_like(params)` of the trained params: their
      # dtype, their layout (with LoRA, the adapters').
      "gradients": trained,
      "ref_params": per_device_bytes(state.ref_params) if state.ref_params is not None else 0,
      "train_batch": per_device_bytes(batch),
      # The sampler's copy of a version (the base model's layout; LoRA: merged weights).
      "published_params": per_device_bytes(with_shardings(
          base_params, param_shardings(base_params, mesh))),
  }
  g_trained, g_frozen = global_bytes(state.params), global_bytes(frozen)
  g = {"params": g_trained + g_frozen, "trainable_params": g_trained, "frozen_params": g_frozen,
       "optimizer_state": global_bytes(state.opt_state), "gradients": g_trained,
       "ref_params": global_bytes(state.ref_params) if state.ref_params is not None else 0,
       "train_batch": global_bytes(batch), "published_params": global_bytes(base_params)}

  # ---- rollout: the sampler exactly as the trainer builds it (prompt rows over 'data', params
  # on the rollout mesh), its KV cache split as the sampler pins it.
  rollout_mesh = mesh if rollout_mesh is None else rollout_mesh
  kv, cache = kv_cache_plan(model_cfg, rollout_mesh, sizes, base_graphdef, base_params)
  rollout_ma = {}
  if compile_rollout:
    sample, sharded_params, prompts, on = rollout_inputs(model_cfg, rollout_mesh, sizes,
                                                          base_graphdef, base_params)
    prefill_c, rollout_ma["prefill"] = _compile("prefill", sample.prefill, sharded_params,
                                                *prompts, mesh=on)
    cache_sh, logits_sh, lens_sh = prefill_c.output_shardings
    planned = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, cache))
    if not all(c.is_equivalent_to(p, len(x.shape)) for c, p, x in zip(
        jax.tree.leaves(cache_sh), planned, jax.tree.leaves(cache))):
      raise RuntimeError(f"compiled prefill placed the KV cache as {cache_sh}, not as planned")
    kv["sharded_as"] += " (checked: the compiled prefill's output shardings)"
    _, first_logits, prompt_lens = jax.eval_shape(
        functools.partial(sample.prefill, mesh=on), sharded_params, *prompts)
    if compile_decode:
      rows, scalar = sizes.prompts * sizes.group, (lambda dt: jax.ShapeDtypeStruct((), dt))
      _, rollout_ma["decode"] = _compile(
          "decode", sample.decode, sharded_params, cache,
          with_shardings(first_logits, logits_sh), with_shardings(prompt_lens, lens_sh),
          jax.random.key(0), jax.ShapeDtypeStruct((rows,), jnp.int32),
          jax.ShapeDtypeStruct((rows,), jnp.float32), scalar(jnp.int32), scalar(jnp.float32),
          mesh=on)
  if kv["shards"] == 1 and rollout_mesh.size > 1:
    kv["note"] = (f"no rollout row or kv head is split: every one of the {rollout_mesh.size} "
                  "devices holds the whole cache (rollout rows go over 'data' only, never "
                  "'fsdp')")
  b["kv_cache"] = kv_bytes = kv["per_device_bytes"]
  g["kv_cache"] = kv["replicated_bytes"]

  step_info = {"compiled": compile_train, "logprob_impl": step_cfg.logprob_impl or default_impl(),
               "num_microbatches": step_cfg.num_microbatches}
  if compile_train:
    _, info = _compile("train step", step.jitted, state, batch, *frozen)
    step_info.update(info)

  # ---- totals
  ma = step_info.get("memory_analysis") or {}
  train = ma.get("peak_estimate_bytes")
  train_src = "compiled"
  if train is None:
    train = b["params"] + b["optimizer_state"] + b["gradients"] + b["ref_params"] + \
        b["train_batch"]
    train_src = "eval_shape: params + optimizer state + gradients + ref params + batch"
  peaks = [(x.get("memory_analysis") or {}).get("peak_estimate_bytes")
           for x in rollout_ma.values()]
  if peaks and all(p is not None for p in peaks):
    rollout, rollout_src = max(peaks), f"compiled: max({', '.join(rollout_ma)})"
  else:
    rollout = b["published_params"] + kv_bytes
    rollout_src = "eval_shape: published params + KV cache"
  if rollout_mesh is not mesh:
    rollout_src += (" (train-mesh params bytes; the rollout mesh may be other devices: the lag "
                    "totals add both as if colocated)")
  state_bytes = b["params"] + b["optimizer_state"] + b["ref_params"]
  totals = {"train": train, "rollout": rollout,
            "lag0": max(train + b["published_params"], state_bytes + rollout),
            "lag1": train + rollout}
  out = {
      "params": count(base_params),  # the model's own (without adapters)
      "trainable_params": count(state.params),
      "lora": None if not lora else {
          "rank": model_cfg.lora_rank, "alpha": model_cfg.lora_alpha,
          "targets": list(model_cfg.lora_targets), "adapter_params": count(state.params),
          "adapter_params_arithmetic": lora_params(model_cfg),
          "frozen_base_dtype": model_cfg.param_dtype,
          "adapter_dtype": str(np.dtype(jax.tree.leaves(state.params)[0].dtype)),
          "rollout": "merge: the sampler gets the base model's layout with the adapters folded "
                     "in (published_params), its KV cache as without LoRA"},
      "mesh": dict(mesh.shape),
      "param_dtype": model_cfg.param_dtype,
      "dtype": model_cfg.dtype,
      "remat": model_cfg.remat,
      "sizes": dataclasses.asdict(sizes),
      "per_device_bytes": b,
      "global_bytes": g,
      "kv_cache": kv,
      "train_step": step_info,
      "rollout": rollout_ma or {"compiled": False},
      "totals_bytes": totals,
      "totals_source": {"train": train_src, "rollout": rollout_src},
      "per_device_gib": {k: round(v / GIB, 3) for k, v in {**b, **{
          f"total_{k}": v for k, v in totals.items()}}.items()},
  }
  out["library_plan"] = library_plan(model_cfg, mesh, sizes, cfg, step_info, rollout_ma)
  if (compile_train or compile_rollout) and jax.default_backend() == "cpu":
    out["backend_note"] = CPU_NOTE
  return out


def library_plan(model_cfg: ModelConfig, mesh, sizes: Sizes, cfg, step_info: dict,
                 rollout_ma: dict) -> dict:
  """The run's own memory plan (`jaxrl.config.memory`, what validation checks against the
  device) for these shapes on `mesh`, colocated, with the train batch as the rollout's P x G rows
  of prompt + completion; next to the compiled programs' temporaries when they were compiled."""
  flat = flatten(cfg or get_config())
  flat.update({f"model.{f.name}": getattr(model_cfg, f.name) for f in
               dataclasses.fields(model_cfg) if f"model.{f.name}" in flat})
  flat.update({"model.hf_path": "", "model.lora.rank": model_cfg.lora_rank,
               "model.lora.targets": ",".join(model_cfg.lora_targets),
               "rollout.num_prompts": sizes.prompts, "rollout.group_size": sizes.group,
               "rollout.max_prompt_len": sizes.prompt_len,
               "rollout.max_new_tokens": sizes.new_tokens, "rollout.max_total_tokens": 0,
               "rollout.engine": "static", "train.num_microbatches": sizes.microbatches})
  shape = MeshShape(mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"])
  inputs = memory.inputs_from_config(flat, shape, jax.default_backend())
  if inputs is None:
    return {"note": "the config's keys did not make a plan"}
  p = memory.plan_memory(inputs)
  out = {"per_device_bytes": p.parts, "train": p.train, "rollout": p.rollout, "total": p.total,
         "text": p.render()}
  ma = step_info.get("memory_analysis") or {}
  if "temp_size_in_bytes" in ma:
    planned = p.parts["gradients"] + p.parts["activations"]
    out["train_temp"] = {"planned": planned, "compiled": ma["temp_size_in_bytes"],
                         "ratio": round(planned / max(ma["temp_size_in_bytes"], 1), 3)}
  peaks = [(x.get("memory_analysis") or {}).get("peak_estimate_bytes")
           for x in rollout_ma.values()]
  if peaks and None not in peaks:
    out["sampler_peak"] = {"planned": p.rollout, "compiled": max(peaks),
                           "ratio": round(p.rollout / max(max(peaks), 1), 3)}
  return out


def lora_params(model_cfg: ModelConfig) -> int:
  """Adapter parameters by arithmetic: per target, A [L, din, r] + B [L, r, dout]."""
  return sum(model_cfg.num_layers * sum(lora_dims(model_cfg, t)) * model_cfg.lora_rank
             for t in model_cfg.lora_targets) if model_cfg.lora_rank else 0


LORA_COMPARED = ("params", "frozen_params", "trainable_params", "gradients", "optimizer_state",
                 "ref_params", "kv_cache", "published_params")


def lora_comparison(full: dict, lora: dict) -> dict:
  """Per-device bytes without and with LoRA, side by side (and their ratio, with / without)."""
  pick = lambda r: {**{k: r["per_device_bytes"][k] for k in LORA_COMPARED},
                    **{f"total_{k}": v for k, v in r["totals_bytes"].items()}}
  a, b = pick(full), pick(lora)
  return {"per_device_bytes": {k: {"without_lora": a[k], "with_lora": b[k],
                                   "ratio": round(b[k] / a[k], 5) if a[k] else None}
                               for k in a},
          "per_device_gib": {k: [round(a[k] / GIB, 3), round(b[k] / GIB, 3)] for k in a},
          "trainable_params": [full["trainable_params"], lora["trainable_params"]]}


def summary_row(name: str, r: dict) -> dict:
  gib = r["per_device_gib"]
  ma = r["train_step"].get("memory_analysis") or {}
  return {"model": name, "params": r["params"],
          "lora_rank": (r.get("lora") or {}).get("rank", 0),
          "trainable_params": r.get("trainable_params", r["params"]),
          "trainable_gib": gib.get("trainable_params", gib["params"]),
          "frozen_gib": gib.get("frozen_params", 0.0),
          "mesh": "x".join(str(v) for v in r["mesh"].values()), "remat": r["remat"],
          "params_gib": gib["params"], "optimizer_gib": gib["optimizer_state"],
          "gradients_gib": gib["gradients"], "kv_cache_gib": gib["kv_cache"],
          "kv_cache_replicated_gib": round(r["kv_cache"]["replicated_bytes"] / GIB, 3),
          "kv_cache_shards": r["kv_cache"]["shards"],
          "rollout_mesh": "x".join(str(v) for v in r["kv_cache"]["rollout_mesh"].values()),
          "step_temp_gib": round(ma["temp_size_in_bytes"] / GIB, 3)
          if "temp_size_in_bytes" in ma else None,
          "train_gib": gib["total_train"], "rollout_gib": gib["total_rollout"],
          "total_lag0_gib": gib["total_lag0"], "total_lag1_gib": gib["total_lag1"],
          "compiled": r["train_step"]["compiled"],
          "plan_total_gib": round(r["library_plan"].get("total", 0) / GIB, 3),
          "plan_train_temp_ratio": (r["library_plan"].get("train_temp") or {}).get("ratio")}


def recipe_defaults(cfg, devices: int) -> dict:
  """The flags a run config sets: rollout sizes, micro-batches, dtypes, remat and the train mesh
  (a -1 axis takes the devices the others leave)."""
  r, m = cfg.rollout, cfg.mesh
  axes = [m.data, m.fsdp, m.tensor]
  if -1 in axes:
    axes[axes.index(-1)] = devices // math.prod(a for a in axes if a != -1)
  return {"prompts": r.num_prompts, "group": r.group_size, "prompt_len": r.max_prompt_len,
          "new_tokens": r.max_new_tokens, "microbatches": cfg.train.num_microbatches,
          "param_dtype": cfg.model.param_dtype, "dtype": cfg.model.dtype,
          "remat": cfg.model.remat, "mesh": ",".join(map(str, axes))}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--recipe", default=None,
                  help="a run config file (configs/*.py): its rollout sizes, micro-batches, "
                       "dtypes, remat, mesh and train step are the defaults of those flags")
  ap.add_argument("--models", default="0.5b,1.5b,7b", help=f"comma list of {', '.join(QWEN)}")
  ap.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor (product <= devices)")
  ap.add_argument("--rollout-mesh", default=None,
                  help="data,fsdp,tensor of the rollout mesh the KV cache is sized on "
                       "(default: --mesh, colocated)")
  ap.add_argument("--devices", type=int, default=None,
                  help="simulate N CPU devices (sets XLA_FLAGS before JAX starts)")
  ap.add_argument("--param-dtype", default="bfloat16", help="float32 | bfloat16")
  ap.add_argument("--dtype", default=None, help="compute dtype (KV cache too); default: param")
  ap.add_argument("--remat", default=None, choices=tuple(REMAT_POLICIES),
                  help="per-layer rematerialisation of the train step (ModelConfig.remat); "
                       "default: the default run config's model.remat")
  ap.add_argument("--prompts", type=int, default=16, help="P: rollout prompts per step")
  ap.add_argument("--group", type=int, default=8, help="G: samples per prompt")
  ap.add_argument("--prompt-len", type=int, default=512, help="rollout prompt length")
  ap.add_argument("--new-tokens", type=int, default=1024, help="rollout completion budget")
  ap.add_argument("--batch", type=int, default=None, help="train rows per step (default P x G)")
  ap.add_argument("--seq", type=int, default=None,
                  help="train tokens per row, prompt + completion (default prompt-len + "
                       "new-tokens); the prompt part is min(prompt-len, seq - 1)")
  ap.add_argument("--microbatches", type=int, default=4)
  ap.add_argument("--compile", nargs="?", const="all", default="",
                  help="compile the train step and the sampler for memory_analysis(): all "
                       "models, or a comma list (e.g. 0.5b,1.5b); eval_shape only otherwise")
  ap.add_argument("--no-rollout-compile", action="store_true",
                  help="with --compile, compile only the train step (the KV cache is then "
                       "sized from the sharding the sampler pins, unchecked)")
  ap.add_argument("--lora-rank", type=int, default=0,
                  help="also plan each model with LoRA adapters of this rank (0: off): frozen "
                       "base, adapters trained (f32), side by side with the full fine-tune")
  ap.add_argument("--lora-alpha", type=float, default=32.0)
  ap.add_argument("--lora-targets", default="q,k,v,o,gate,up,down",
                  help="comma list of the projections adapted")
  ap.add_argument("--quick", action="store_true", help="smoke test: a tiny model, compiled")
  ap.add_argument("--out", default=None, help="also write the whole report to this JSON file")
  args, _ = ap.parse_known_args()
  recipe = None
  if args.recipe:
    from jaxrl.config.loader import load_recipe
    recipe = load_recipe(args.recipe)
    ap.set_defaults(**recipe_defaults(recipe, jax.device_count()))
  args = ap.parse_args()
  t_start = time.perf_counter()

  mesh_shape = tuple(int(v) for v in args.mesh.split(","))
  if len(mesh_shape) != 3:
    ap.error("--mesh is data,fsdp,tensor")
  if math.prod(mesh_shape) > jax.device_count():
    ap.error(f"--mesh {args.mesh} needs {math.prod(mesh_shape)} devices, have "
             f"{jax.device_count()} (--devices N simulates N CPU devices)")
  mesh = make_mesh(*mesh_shape)
  rollout_mesh = mesh
  if args.rollout_mesh:
    rollout_shape = tuple(int(v) for v in args.rollout_mesh.split(","))
    if len(rollout_shape) != 3 or math.prod(rollout_shape) > jax.device_count():
      ap.error(f"--rollout-mesh {args.rollout_mesh}: data,fsdp,tensor over at most "
               f"{jax.device_count()} devices")
    rollout_mesh = make_mesh(*rollout_shape)
  remat = args.remat or (recipe or get_config()).model.remat
  seq = args.seq or args.prompt_len + args.new_tokens
  train_lp = min(args.prompt_len, seq - 1)
  sizes = Sizes(rows=args.batch or args.prompts * args.group, train_prompt_len=train_lp,
                train_new_tokens=seq - train_lp, microbatches=args.microbatches,
                prompts=args.prompts, group=args.group, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens)
  if args.quick:
    models = {"tiny": ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16, mlp_dim=128,
                                  param_dtype=args.param_dtype,
                                  dtype=args.dtype or args.param_dtype, remat=remat)}
    sizes = Sizes(16, 8, 8, 2, 4, 4, 8, 8)
    to_compile = {"tiny"}
  else:
    names = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for n in names:
      if n not in QWEN:
        ap.error(f"unknown model {n!r}; choose from {', '.join(QWEN)}")
    models = {n: qwen_config(n, args.param_dtype, args.dtype, remat) for n in names}
    to_compile = set(names) if args.compile == "all" else \
        {m.strip().lower() for m in args.compile.split(",") if m.strip()}
    if to_compile - set(names):
      extra = ", ".join(sorted(to_compile - set(names)))
      ap.error(f"--compile names models not in --models: {extra}")
  try:
    check_sizes(sizes, mesh)
  except ValueError as e:
    ap.error(str(e))
  lora_section = types.SimpleNamespace(rank=args.lora_rank, alpha=args.lora_alpha,
                                       targets=args.lora_targets, dropout=0.0)
  if args.lora_rank < 0:
    ap.error("--lora-rank must be >= 0")

  report = {
      "benchmark": "memory_plan",
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(), "devices": jax.device_count()},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "recipe": args.recipe,
      "mesh": dict(mesh.shape),
      "rollout_mesh": dict(rollout_mesh.shape),
      "sizes": dataclasses.asdict(sizes),
      "lora": None if not args.lora_rank else {"rank": args.lora_rank, "alpha": args.lora_alpha,
                                               "targets": args.lora_targets},
      "models": {},
  }
  summary = []
  for name, mc in models.items():
    t0 = time.perf_counter()
    how = "compile" if name in to_compile else "eval_shape only"
    log(f"[{name}] planning on mesh {args.mesh} ({how})")
    r = plan(mc, mesh, sizes, compile_train=name in to_compile,
             compile_rollout=name in to_compile and not args.no_rollout_compile,
             rollout_mesh=rollout_mesh, cfg=recipe)
    if name in QWEN:
      r["name"], r["published_params"] = QWEN[name][0], QWEN[name][2]
      if r["params"] != QWEN[name][2]:
        raise RuntimeError(f"{name}: built {r['params']} parameters, published {QWEN[name][2]}")
    r["model_config"] = dataclasses.asdict(mc)
    rows = [summary_row(name, r)]
    if args.lora_rank:
      lc = lora_lib.with_lora(mc, lora_section)
      log(f"[{name}] planning with LoRA rank {lc.lora_rank} on {','.join(lc.lora_targets)}")
      r["with_lora"] = plan(lc, mesh, sizes, compile_train=name in to_compile,
                            compile_rollout=name in to_compile and not args.no_rollout_compile,
                            rollout_mesh=rollout_mesh, cfg=recipe)
      r["lora_comparison"] = lora_comparison(r, r["with_lora"])
      rows.append(summary_row(f"{name} lora{lc.lora_rank}", r["with_lora"]))
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"model": name, **r}), flush=True)
    report["models"][name] = r
    summary.extend(rows)
    log(f"[{name}] done in {r['wall_s']}s: total (lag 1) {r['per_device_gib']['total_lag1']} GiB "
        f"per device")
  report["summary"] = summary
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  tail = {"summary": summary, "total_wall_s": report["total_wall_s"]}
  if to_compile and jax.default_backend() == "cpu":
    tail["backend_note"] = report["backend_note"] = CPU_NOTE
  print(json.dumps(tail), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  main()
