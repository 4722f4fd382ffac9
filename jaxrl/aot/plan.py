"""A run config planned for a target: every program compiled by the target's compiler, what is
live at once, estimates and the verdict (`make_plan`), shown as a table (`render`).

The config is resolved for the plan first (`prepare`): `model.hf_path` is read for its
config.json only (the directory, or a shape shipped with jaxrl of the same name), and the config
is validated for the target's chip and host count with `files=False` (nothing the config names
on disk is needed: no weights, no data, no run directory). The run's own memory plan
(`jaxrl.config.memory`, what a run prints and checks at its start) is set beside the compiler's
figures for the same config, so their ratio is visible in every plan.
"""

from __future__ import annotations

import dataclasses
import os
import platform as host_platform
import time

from jaxrl import config as config_lib
from jaxrl.aot import programs as programs_lib
from jaxrl.aot import report, targets
from jaxrl.aot.targets import Target, TargetError
from jaxrl.config import memory
from jaxrl.config.schema import PREFIX, flatten
from jaxrl.core.names import lag_bound
from jaxrl.run.inputs import make_tokenizer, task_source

GIB = 1 << 30


def prepare(cfg, target: Target, say=print) -> config_lib.MeshShape:
  """Resolves `cfg` for a plan on `target` in place and validates it; returns the mesh shape.
  Raises `ConfigError` (every problem, one line each) or `TargetError` (the mesh against the
  target), before anything is compiled."""
  if cfg.model.hf_path:
    found = programs_lib.model_dir(cfg.model.hf_path)
    if found is None:
      shapes = ", ".join(programs_lib.shipped_shapes())
      raise config_lib.ConfigError([
          f"{PREFIX}model.hf_path: no config.json in {cfg.model.hf_path!r}, and no shipped shape "
          f"of that name ({shapes}); a plan needs the model's config.json only"])
    if found != cfg.model.hf_path:
      say(f"jaxrl | model.hf_path: {cfg.model.hf_path} is not here; planning with the shipped "
          f"shape {os.path.basename(found)} (its config.json)")
      cfg.model.hf_path = found
  try:
    return config_lib.validate(cfg, target.chips, num_processes=target.hosts,
                               backend=target.platform, files=False)
  except config_lib.ConfigError as e:
    mesh_keys = [p for p in e.problems if p.startswith(f"{PREFIX}mesh")]
    if mesh_keys and len(mesh_keys) == len(e.problems):
      raise TargetError(f"target {target.name} ({target.chips} chips, {target.hosts} host(s)): "
                        + "; ".join(mesh_keys)) from None
    raise


def _vocab(cfg) -> int:
  """The tokenizer's size for a config whose model takes it (`model.vocab_size` 0, no model
  directory): the task's character tokenizer."""
  if cfg.model.hf_path or cfg.model.vocab_size:
    return 0
  return make_tokenizer(cfg, task_source(cfg)).vocab_size


def library_plan(cfg, mesh_shape, target: Target, vocab: int) -> memory.MemoryPlan | None:
  """The run's own memory plan (`jaxrl.config.memory`) of `cfg` on the target's platform."""
  inputs = memory.inputs_from_config(flatten(cfg), mesh_shape, target.platform, target.hosts,
                                     vocab=vocab or None)
  return None if inputs is None else memory.plan_memory(inputs)


def make_plan(cfg, target: Target, mesh_shape, devices, only=(), progress=print) -> dict:
  """Compiles every program of `cfg` (prepared) for `target`'s `devices`; the plan as a dict
  (`render` shows it; it is also the `--json` output)."""
  t0 = time.perf_counter()
  vocab = _vocab(cfg)
  host = targets.host_target(target)
  host_devices = None if host is target else targets.devices(host)
  built = programs_lib.build_programs(cfg, mesh_shape, devices, vocab, only, host_devices)
  compiled = {}
  for p in built.programs:
    progress(f"jaxrl | compiling {p.name} for {target.name} ({p.what}) ...")
    compiled[p.name] = report.compile_program(p, progress)
  colocated = built.colocated
  lag = lag_bound(cfg.rollout)  # `lag=auto`: its bound, the most a run may hold
  peak = report.live_peak(compiled, built, lag, colocated)
  fits, lines = report.verdict(compiled, peak, target, cfg)
  if only:  # a subset: the peak and the verdict count those programs alone
    lines.append(f"only {', '.join(compiled)} compiled (--programs): the peak and the verdict "
                 "leave the others out")
  est = report.estimates(compiled, built, cfg, target)
  lib = library_plan(cfg, mesh_shape, target, vocab)
  step = compiled.get("train_step")
  agreement = None
  if lib is not None and step is not None and not step.error:
    agreement = {
        "train_step": {"planned": lib.train, "compiled": step.peak,
                       "ratio": round(lib.train / max(step.peak, 1), 3)},
        "total": {"planned": lib.total, "compiled": peak["total"],
                  "ratio": round(lib.total / max(peak["total"], 1), 3)}}
    dec = [c for n, c in compiled.items() if n in ("prefill", "decode") and not c.error]
    if dec:
      # One sampler program holds one params copy (the plan's sampler part counts the lag's
      # two): the planned program against the larger compiled one.
      top = max(c.peak for c in dec)
      copies = 2 if lib.inputs.lag and lib.inputs.colocated else 1
      one = lib.rollout - lib.parts["rollout_params"] + lib.parts["rollout_params"] // copies
      agreement["sampler"] = {"planned": one, "compiled": top,
                              "ratio": round(one / max(top, 1), 3)}
  return {
      "target": dataclasses.asdict(target) | {"usable_bytes": target.usable_bytes,
                                              "reserve": target.reserve_note},
      "config": cfg.name,
      "model": {"params": built.params, "hf_path": cfg.model.hf_path or None,
                "param_dtype": built.model_cfg.param_dtype, "dtype": built.model_cfg.dtype,
                "rollout_dtype": built.rollout_cfg.param_dtype,
                "kv_cache_dtype": built.rollout_cfg.kv_cache_dtype or built.rollout_cfg.dtype,
                "attention": built.model_cfg.attention, "remat": built.model_cfg.remat},
      "mesh": dict(built.mesh.shape),
      "rollout_mesh": dict(built.rollout_mesh.shape),
      "lag": lag,
      "programs": {n: dataclasses.asdict(c) | {"peak": c.peak} for n, c in compiled.items()},
      "peak": peak,
      "fits": fits,
      "lines": lines,
      "estimates": est,
      "memory_plan": agreement,
      "not_built": list(built.not_built),
      "machine": {"cpus": os.cpu_count(), "platform": host_platform.platform()},
      "wall_s": round(time.perf_counter() - t0, 1),
      "label": "compiled (XLA memory per chip) and estimated (step time, tokens/s); "
               "nothing here was measured on the accelerator",
  }


def render(plan: dict) -> str:
  """The plan as a table: a row per program, then the peak, the estimates and the verdict."""
  t = plan["target"]
  big = max([plan["peak"]["total"]] + [c["peak"] for c in plan["programs"].values()])
  unit, scale = ("GiB", GIB) if big >= GIB else ("MiB", 1 << 20)
  g = lambda n: f"{n / scale:8.2f}"
  out = [f"plan of {plan['config']} for {t['name']}: {t['chips']} x {t['device_kind'] or t['generation']} "
         f"({t['hbm_bytes'] / GIB:.0f} GiB HBM, {t['peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
         f"{t['hbm_bandwidth'] / 1e9:,.0f} GB/s each; {t['source']})",
         f"mesh {plan['mesh']}, rollout mesh {plan['rollout_mesh']}, rollout.lag {plan['lag']}; "
         f"{plan['model']['params']:,} params, {plan['model']['attention']} attention, remat "
         f"{plan['model']['remat']}, KV cache {plan['model']['kv_cache_dtype']}",
         "",
         f"program        compiled {unit} per chip: args   output    temp    peak   compile s  "
         "collectives (ops, MiB)"]
  for name, c in plan["programs"].items():
    if c["error"]:
      out.append(f"{name:<14} REFUSED: {c['error']}")
      continue
    m = c["memory"]
    coll = ", ".join(f"{k} {v['ops']} ({v['bytes'] / (1 << 20):,.0f})"
                     for k, v in c["collectives"].items()) or "none"
    out.append(f"{name:<14} {'':>22}{g(m.get('argument', 0))} {g(m.get('output', 0))} "
               f"{g(m.get('temp', 0))} {g(c['peak'])} {c['compile_s']:10.0f}  {coll}")
  p = plan["peak"]
  out += ["", f"live at once ({p['how']}): train side {p['train'] / scale:.2f} {unit}, rollout "
          f"side {p['rollout'] / scale:.2f} {unit}, peak {p['total'] / scale:.2f} {unit} per chip "
          f"of {t['usable_bytes'] / GIB:.2f} GiB usable"]
  e = plan["estimates"]
  decode = (f"; XLA:TPU's estimate {e['decode_compiler_tokens_per_s']:,.0f} tokens/s "
            f"({_seconds(e['decode_compiler_step_s'])} a step)"
            if e.get("decode_compiler_tokens_per_s") else "")
  out.append(f"estimated: train step >= {_seconds(e['train_step_s'])} (its model FLOPs per chip at "
             f"the bf16 peak); decode {e['decode_tokens_per_s']:,.0f} tokens/s at the memory "
             f"roofline ({_seconds(e['decode_step_s'])} a step){decode}")
  mp = plan.get("memory_plan")
  if mp:
    out.append("jaxrl.config.memory (the plan a run prints) / compiled: train step "
               f"{mp['train_step']['ratio']:.2f}, peak {mp['total']['ratio']:.2f}"
               + (f", sampler {mp['sampler']['ratio']:.2f}" if "sampler" in mp else ""))
  if plan["not_built"]:
    out.append("not compiled: " + "; ".join(plan["not_built"]))
  out += plan["lines"]
  out.append(f"({plan['label']}; {plan['wall_s']:.0f} s on {plan['machine']['cpus']} CPU cores)")
  return "\n".join(out)


def _seconds(s: float) -> str:
  return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"
