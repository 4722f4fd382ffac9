"""The accelerator path in one run: fused log-prob kernels, train step and sampler on GPU / TPU.

Prints ONE JSON object on stdout (progress goes to stderr). Every part records an error instead
of stopping the run, so one report says what works on the backend and what does not:

- `fused_logprob`: value+grad of `sum(logp) + sum(rollout_kl k2) + sum(entropy)` w.r.t. hidden
  and unembedding at Qwen2-0.5B scale (N=8192, D=896, V=151936, f32) for `reference`, `xla` and
  `pallas` (compiled, not interpreted): compile time, compiled temp bytes, median wall time, and
  the normwise error `max|a - b| / max|b|` of logp, entropy, d hidden and d unembedding against
  `reference` (dense logits: 5 GB of them, so it needs a large accelerator).
- `train_step`: `benchmarks/train_step.py`'s cases (the default recipe's batch and a long one)
  for each kernel implementation.
- `sampler`: the jaxrl sampler's tokens/s (`benchmarks/sampler_throughput.py`'s jaxrl side).

  PYTHONPATH=. python benchmarks/accelerator_check.py [--parts fused_logprob,train_step,sampler]
  PYTHONPATH=. python benchmarks/accelerator_check.py --quick   # small sizes (runs on CPU too)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxrl.kernels import fused_logprob  # noqa: E402

IMPLS = ("reference", "xla", "pallas")


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def error(e: BaseException) -> dict:
  lines = [ln for ln in str(e).splitlines() if ln.strip()]
  return {"error": f"{type(e).__name__}: {' | '.join(lines[:3])[:600]}",
          "where": "".join(traceback.format_tb(e.__traceback__)[-2:])[-800:]}


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def kernel_fn(impl: str):
  def loss(h, w, targets, rollout):
    o = fused_logprob(h, w, targets, temperature=1.0, rollout_logprobs=rollout, estimator="k2",
                      with_entropy=True, impl=impl, interpret=False)
    return jnp.sum(o.logp) + jnp.sum(o.rollout_kl) + jnp.sum(o.entropy), (o.logp, o.entropy)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def check_fused_logprob(n: int, d: int, v: int, runs: int) -> dict:
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (n, d), jnp.float32)
  w = jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5
  targets = jax.random.randint(k[2], (n,), 0, v)
  rollout = jnp.full((n,), -np.log(v), jnp.float32)
  out = {"shape": {"N": n, "D": d, "V": v}, "dtype": "float32",
         "dense_logits_bytes": n * v * 4}
  results = {}
  for impl in IMPLS:
    r = {}
    try:
      f = kernel_fn(impl)
      t0 = time.perf_counter()
      compiled = f.lower(h, w, targets, rollout).compile()
      r["compile_s"] = round(time.perf_counter() - t0, 2)
      mem = compiled.memory_analysis()
      if mem is not None:
        r["temp_bytes"] = int(mem.temp_size_in_bytes)
      res = jax.block_until_ready(compiled(h, w, targets, rollout))
      times = []
      for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(h, w, targets, rollout))
        times.append(time.perf_counter() - t0)
      r["median_s"] = statistics.median(times)
      r["min_s"] = min(times)
      results[impl] = res
      log(f"  {impl}: compile {r['compile_s']}s, median {r['median_s'] * 1e3:.2f} ms, "
          f"temp {r.get('temp_bytes', 0) / 2**20:.0f} MiB")
    except Exception as e:  # noqa: BLE001  (a failing impl is a result)
      r.update(error(e))
      log(f"  {impl}: FAILED {r['error'][:200]}")
    out[impl] = r
  if "reference" in results:
    (_, (lp0, ent0)), (dh0, dw0) = results["reference"]
    for impl, ((_, (lp, ent)), (dh, dw)) in results.items():
      if impl != "reference":
        out[impl]["rel_err_vs_reference"] = {
            "logp": rel_err(lp, lp0), "entropy": rel_err(ent, ent0),
            "d_hidden": rel_err(dh, dh0), "d_unembedding": rel_err(dw, dw0)}
    for impl in results:
      if impl != "reference" and "median_s" in out[impl]:
        out[impl]["time_over_reference"] = out[impl]["median_s"] / out["reference"]["median_s"]
  return out


def check_train_step(quick: bool, steps: int) -> dict:
  import dataclasses  # noqa: F401  (train_step's own imports)
  import train_step as ts
  cfg = ts.get_config()
  model_cfg = ts.ModelConfig.from_config(cfg.model, ts.DEFAULT_VOCAB)
  out = {}
  for name, case in ts.make_cases(quick, cfg).items():
    for impl in ("xla", "pallas"):
      key = f"{name}/{impl}"
      try:
        out[key] = ts.run_case(case, model_cfg, cfg, steps, impl)
        out[key].pop("step_s", None)
      except Exception as e:  # noqa: BLE001
        out[key] = error(e)
        log(f"  train step {key}: FAILED {out[key]['error'][:200]}")
  return out


def check_sampler(quick: bool, repeats: int) -> dict:
  import sampler_throughput as st
  out = {}
  for name, case in st.make_cases(quick).items():
    try:
      out[name] = st.run_case(case, repeats, hf_reason="not run (accelerator check: jaxrl side "
                              "only)", threads=2)
      out[name]["jaxrl"].pop("call_s", None)
      out[name]["jaxrl"].pop("tokens_per_s_all", None)
    except Exception as e:  # noqa: BLE001
      out[name] = error(e)
      log(f"  sampler {name}: FAILED {out[name]['error'][:200]}")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--parts", default="fused_logprob,train_step,sampler")
  ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
  ap.add_argument("--runs", type=int, default=5, help="timed calls per measurement")
  args = ap.parse_args()
  parts = [p.strip() for p in args.parts.split(",") if p.strip()]
  known = ("fused_logprob", "train_step", "sampler")
  for p in parts:
    if p not in known:
      ap.error(f"unknown part {p!r}; choose from {known}")
  t_start = time.perf_counter()
  dev = jax.devices()[0]
  report = {"benchmark": "accelerator_check", "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)), "device_count": jax.device_count(),
            "jax": jax.__version__, "python": platform.python_version(), "quick": args.quick}
  log(f"backend {report['backend']}: {report['device']} x {report['device_count']}")
  if "fused_logprob" in parts:
    shape = (256, 64, 4096) if args.quick else (8192, 896, 151936)
    log(f"fused_logprob at N, D, V = {shape}")
    report["fused_logprob"] = check_fused_logprob(*shape, runs=args.runs)
  if "train_step" in parts:
    log("train step")
    report["train_step"] = check_train_step(args.quick, max(args.runs, 3))
  if "sampler" in parts:
    log("sampler")
    report["sampler"] = check_sampler(args.quick, max(args.runs, 3))
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
