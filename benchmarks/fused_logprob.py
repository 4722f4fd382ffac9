"""Fused log-prob kernel: compiled memory of value+grad at Qwen2-0.5B scale, and CPU wall time.

Prints ONE JSON object on stdout (progress goes to stderr).

(a) memory: `temp_size_in_bytes` from `memory_analysis()` of the compiled value+grad of
    `sum(logp) + sum(rollout_kl)` w.r.t. hidden and unembedding, compiled from
    `jax.ShapeDtypeStruct` inputs only (nothing runs), at N=8192, D=896, V=151936 (f32),
    for each implementation; the dense `[N, V]` f32 logits alone are N*V*4 = 4.98 GB.
(b) time: the same value+grad executed on CPU at N=1024, D=256, V=32768 (f32), median of the
    timed runs (the two impls interleaved) after a warm-up, for `reference` and `xla`.

(c) `--compare`: `xla` against the compiled Pallas `gpu` layout side by side, value+grad of
    `sum(logp) + sum(rollout_kl k2) + sum(entropy)` at N=8192, D=896, V=151936 in bf16 (the
    acceptance case; `--dtype float32` for f32), median of interleaved runs after a warm-up, the
    device's name, the tiles used and the normwise error of each `pallas` output against `xla`.
    It needs a GPU; `--compare --quick` runs it on CPU at tiny sizes, `pallas` interpreted.

  PYTHONPATH=. python benchmarks/fused_logprob.py [--chunk-size 4096] [--runs 7]
  PYTHONPATH=. python benchmarks/fused_logprob.py --quick   # smoke test, small sizes
  PYTHONPATH=. python benchmarks/fused_logprob.py --compare [--runs 10] > out.json   # on a GPU
  PYTHONPATH=. python benchmarks/fused_logprob.py --compare --quick   # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels import fused_logprob
from jaxrl.kernels.fused_logprob import pallas_gpu
from jaxrl.kernels.fused_logprob import xla as xla_impl
from jaxrl.kernels.fused_logprob.common import effective_temperature
from jaxrl.losses.kl import kl_estimate


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def value_and_grad_fn(impl: str, chunk_size: int | None, interpret=None):
  """jitted `(hidden, unembedding, targets, rollout_logprobs) -> (loss, (d hidden, d W))`."""

  def loss(h, w, targets, rollout):
    o = fused_logprob(h, w, targets, temperature=1.0, rollout_logprobs=rollout, estimator="k2",
                      impl=impl, chunk_size=chunk_size, interpret=interpret)
    return jnp.sum(o.logp) + jnp.sum(o.rollout_kl)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def specs(n, d, v, dtype=jnp.float32):
  return (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
          jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))


def temp_bytes(impl, chunk_size, n, d, v, interpret=None):
  """Compiled temp bytes (compile only) or the reason it did not compile."""
  try:
    t0 = time.perf_counter()
    f = value_and_grad_fn(impl, chunk_size, interpret)
    compiled = f.lower(*specs(n, d, v)).compile()
    mem = compiled.memory_analysis()
    label = impl + (" (interpret)" if interpret else "")
    log(f"  {label}: compiled in {time.perf_counter() - t0:.1f}s, "
        f"temp {mem.temp_size_in_bytes / 2**20:.1f} MiB")
    return {"temp_bytes": int(mem.temp_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes)}
  except Exception as e:  # noqa: BLE001  (a missing backend is a reported result, not a crash)
    log(f"  {impl}: did not compile: {type(e).__name__}: {e}")
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def wall_times(impls: dict, n, d, v, runs):
  """Median seconds of value+grad per impl; one warm-up call each, then the impls' timed calls
  interleaved so that load from other processes on the machine hits them alike."""
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (n, d), jnp.float32)
  w = jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5
  targets = jax.random.randint(k[2], (n,), 0, v)
  rollout = jnp.full((n,), -np.log(v), jnp.float32)
  fns = {name: value_and_grad_fn(name, chunk) for name, chunk in impls.items()}
  for f in fns.values():
    jax.block_until_ready(f(h, w, targets, rollout))  # compile + warm-up
  times = {name: [] for name in fns}
  for _ in range(runs):
    for name, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(h, w, targets, rollout))
      times[name].append(time.perf_counter() - t0)
  out = {}
  for name, ts in times.items():
    log(f"  {name}: median {statistics.median(ts) * 1e3:.1f} ms over {runs} runs")
    out[name] = {"median_s": statistics.median(ts), "min_s": min(ts), "runs": runs}
  return out


def rel_err(a, b) -> float:
  """Normwise: `max|a - b| / max|b|` (elementwise relative error is meaningless near 0)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def compare_fn(kernel):
  """jitted `(h, W, targets, t, rollout) -> ((loss, (logp, entropy)), (d h, d W))` of
  `sum(logp) + sum(rollout_kl k2) + sum(entropy)` through `kernel` (an implementation's
  `fused_logprob(h, w, targets, t, with_entropy=...)`), called directly so that a Pallas kernel
  that fails to lower is an error here, not the API's silent fallback to `xla`."""

  def loss(h, w, targets, t, rollout):
    logp, entropy = kernel(h, w, targets, t, with_entropy=True)
    kl = kl_estimate(logp, rollout, "k2")
    return jnp.sum(logp) + jnp.sum(kl) + jnp.sum(entropy), (logp, entropy)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def compare(args, n, d, v, interpret):
  """`xla` vs `pallas` (gpu layout) value+grad at one shape: compile time, median, errors."""
  dtype = jnp.dtype(args.dtype)
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5).astype(dtype)
  targets = jax.random.randint(k[2], (n,), 0, v)
  t = effective_temperature(1.0, n)
  rollout = jnp.full((n,), -np.log(v), jnp.float32)
  tiles = dict(chunk_size=args.block_v, block_n=args.block_n, block_d=args.block_d,
               splits=args.splits, slice_v=args.slice_v)
  kernels = {"xla": functools.partial(xla_impl.fused_logprob, chunk_size=args.chunk_size),
             "pallas": functools.partial(pallas_gpu.fused_logprob, interpret=interpret, **tiles)}
  res, outs, fns = {}, {}, {}
  for name, kernel in kernels.items():
    try:
      t0 = time.perf_counter()
      fns[name] = compare_fn(kernel)
      outs[name] = jax.block_until_ready(fns[name](h, w, targets, t, rollout))
      res[name] = {"first_call_s": time.perf_counter() - t0}
      log(f"  {name}: first call (compile + run) {res[name]['first_call_s']:.1f}s")
    except Exception as e:  # noqa: BLE001  (a kernel that does not lower is a reported result)
      log(f"  {name}: failed: {type(e).__name__}: {e}")
      res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      fns.pop(name, None)
  times = {name: [] for name in fns}
  for _ in range(args.runs):
    for name, f in fns.items():  # interleaved, so load from elsewhere hits both alike
      t0 = time.perf_counter()
      jax.block_until_ready(f(h, w, targets, t, rollout))
      times[name].append(time.perf_counter() - t0)
  for name, ts in times.items():
    log(f"  {name}: median {statistics.median(ts) * 1e3:.2f} ms over {args.runs} runs")
    res[name].update(median_s=statistics.median(ts), min_s=min(ts), runs=args.runs)
  if "median_s" in res.get("xla", {}) and "median_s" in res.get("pallas", {}):
    res["pallas_over_xla"] = res["pallas"]["median_s"] / res["xla"]["median_s"]
  if "xla" in outs and "pallas" in outs:
    (_, (lp, ent)), (dh, dw) = outs["pallas"]
    (_, (lp_x, ent_x)), (dh_x, dw_x) = outs["xla"]
    res["pallas_rel_err_vs_xla"] = {"logp": rel_err(lp, lp_x), "entropy": rel_err(ent, ent_x),
                                    "d_hidden": rel_err(dh, dh_x), "d_unembedding":
                                    rel_err(dw, dw_x)}
  plan = pallas_gpu.plan_tiles(n, d, v, dtype.itemsize, args.block_n, args.block_v,
                              args.block_d, args.splits, args.slice_v)
  res["pallas_tiles"] = plan._asdict()
  res["pallas_grids"] = pallas_gpu.plan_grids(n, d, v, plan)._asdict()
  return res


def run_compare(args):
  backend = jax.default_backend()
  if backend == "cpu" and not args.quick:
    raise SystemExit("--compare times the compiled Pallas GPU kernel: run it on a GPU, or add "
                     "--quick for a CPU smoke test (tiny sizes, pallas interpreted)")
  n, d, v = (256, 96, 1000) if args.quick else (8192, 896, 151936)
  if args.shape:
    n, d, v = (int(x) for x in args.shape.split(","))
  dev = jax.devices()[0]
  log(f"compare xla vs pallas (gpu layout), value+grad, N={n} D={d} V={v} {args.dtype} "
      f"on {dev.device_kind}")
  out = {"benchmark": "fused_logprob_compare", "backend": backend, "device": dev.device_kind,
         "device_count": jax.device_count(), "jax": jax.__version__, "quick": args.quick,
         "shape": {"N": n, "D": d, "V": v}, "dtype": args.dtype,
         "matmul_precision": str(jax.config.jax_default_matmul_precision),
         "pallas_interpret": backend == "cpu", "xla_chunk_size": args.chunk_size,
         "loss": "sum(logp) + sum(rollout_kl k2) + sum(entropy), value and grad w.r.t. hidden "
                 "and unembedding"}
  if backend == "cpu":
    out["note"] = ("pallas ran in Pallas' interpreter on CPU: a smoke test of the benchmark, "
                   "not a timing of the kernel")
  out.update(compare(args, n, d, v, interpret=backend == "cpu"))
  print(json.dumps(out, indent=1))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="small sizes, few runs (smoke test)")
  ap.add_argument("--chunk-size", type=int, default=xla_impl.DEFAULT_CHUNK_SIZE,
                  help="xla vocabulary chunk width")
  ap.add_argument("--runs", type=int, default=7, help="timed runs (median reported)")
  ap.add_argument("--compare", action="store_true",
                  help="only (c): xla vs compiled pallas (gpu layout) side by side; needs a GPU "
                       "unless --quick")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                  help="--compare: hidden and unembedding dtype")
  ap.add_argument("--shape", default=None, help="--compare: N,D,V (default 8192,896,151936)")
  ap.add_argument("--block-n", type=int, default=None, help="--compare: pallas token block")
  ap.add_argument("--block-v", type=int, default=None, help="--compare: pallas vocabulary block")
  ap.add_argument("--block-d", type=int, default=None, help="--compare: pallas K step")
  ap.add_argument("--splits", type=int, default=None,
                  help="--compare: pallas forward vocabulary slices (default: by program count)")
  ap.add_argument("--slice-v", type=int, default=None,
                  help="--compare: pallas backward vocabulary slice (default: 256 MiB of dl)")
  args = ap.parse_args()
  if args.compare:
    run_compare(args)
    return
  if args.quick:
    mem_shape, time_shape, runs = (1024, 128, 16384), (256, 64, 4096), 3
  else:
    mem_shape, time_shape, runs = (8192, 896, 151936), (1024, 256, 32768), max(5, args.runs)

  out = {"benchmark": "fused_logprob", "backend": jax.default_backend(),
         "jax": jax.__version__, "cpu_count": os.cpu_count(), "machine": platform.machine(),
         "xla_chunk_size": args.chunk_size, "quick": args.quick,
         "loss": "sum(logp) + sum(rollout_kl k2), grad w.r.t. hidden and unembedding, f32"}

  n, d, v = mem_shape
  log(f"memory (compile only) at N={n} D={d} V={v}")
  mem = {"shape": {"N": n, "D": d, "V": v}, "dense_logits_bytes": n * v * 4}
  for impl in ("reference", "xla"):
    mem[impl] = temp_bytes(impl, None if impl == "reference" else args.chunk_size, n, d, v)
  if "temp_bytes" in mem["reference"] and "temp_bytes" in mem["xla"]:
    mem["xla_over_reference"] = mem["xla"]["temp_bytes"] / mem["reference"]["temp_bytes"]
    mem["target_ratio"] = 1 / 16
  # The compiled kernel only exists for TPU / GPU; on CPU report why, and the interpreter's
  # footprint (it pads and carries whole copies of W and dW, so it is no kernel measurement).
  mem["pallas"] = temp_bytes("pallas", None, n, d, v, interpret=False)
  if jax.default_backend() == "cpu":
    mem["pallas"]["why"] = ("Pallas has no compiled CPU backend (TPU: Mosaic, GPU: Mosaic GPU); "
                            "on CPU it runs only in interpret mode")
    mem["pallas_interpret"] = temp_bytes("pallas", None, n, d, v, interpret=True)
    mem["pallas_interpret"]["note"] = ("Pallas HLO interpreter on CPU: pads and loop-carries "
                                       "whole arrays; not the kernel's memory")
  out["memory"] = mem

  n, d, v = time_shape
  log(f"wall time (value+grad, CPU) at N={n} D={d} V={v}")
  tm = {"shape": {"N": n, "D": d, "V": v}}
  tm.update(wall_times({"reference": None, "xla": args.chunk_size}, n, d, v, runs))
  tm["xla_over_reference"] = tm["xla"]["median_s"] / tm["reference"]["median_s"]
  tm["target_ratio"] = 1.2
  out["time"] = tm
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
