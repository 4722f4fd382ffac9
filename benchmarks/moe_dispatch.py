"""A mixture-of-experts layer's grouped products against a dense MLP of the same active FLOPs.

`jaxrl.models.moe.moe_mlp` at a Qwen3-30B-A3B layer's shape (D = 2048, E = 128 experts of width
F = 768, k = 8 per token, router in float32), value + grad w.r.t. the input and every weight,
for each dispatch (`ragged_dot`: `jax.lax.ragged_dot`; `blocked`: tiles of sorted rows and one
batched einsum), against a dense SwiGLU MLP of width k x F = 6144 over the same tokens: the
same matmul FLOPs per token (3 products of 2 x D x k x F each, forward; x 3 with the backward).
The router's top-k is drawn from a seeded random router, so the experts' loads are what random
weights give (close to uniform).

Reported per case: compile time, median wall time of `--runs` runs after a warm-up (runs of the
cases interleaved, so load drifts hit each alike), the matmul TFLOP/s that time gives (the
dense-equivalent count above; the router's D x E product is left out), and the ratio to the dense
MLP's time. The ratio is the dispatch's whole cost: sorting, gathers, the grouped products and
the scatter back.

Prints ONE JSON object on stdout (progress on stderr).

  PYTHONPATH=. python benchmarks/moe_dispatch.py                 # N = 8192 tokens, bfloat16
  PYTHONPATH=. python benchmarks/moe_dispatch.py --tokens 32768 --dtype float32
  PYTHONPATH=. python benchmarks/moe_dispatch.py --quick         # small shape (CPU smoke test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxrl.models.model_config import ModelConfig
from jaxrl.models.moe import moe_mlp


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
  ap.add_argument("--topk", type=int, default=8)
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--runs", type=int, default=10)
  ap.add_argument("--dispatch", default="ragged_dot,blocked")
  ap.add_argument("--quick", action="store_true", help="N=512, D=128, E=8, F=64, k=2, 3 runs")
  args = ap.parse_args(argv)
  if args.quick:
    args.tokens, args.hidden, args.experts, args.width, args.topk, args.runs = \
        512, 128, 8, 64, 2, 3
  dispatches = [d.strip() for d in args.dispatch.split(",") if d.strip()]
  for name, v in (("--tokens", args.tokens), ("--hidden", args.hidden),
                  ("--experts", args.experts), ("--width", args.width), ("--runs", args.runs)):
    if v < 1:
      raise SystemExit(f"jaxrl: {name} must be >= 1, got {v}")
  if not 1 <= args.topk <= args.experts:
    raise SystemExit(f"jaxrl: --topk must be in [1, --experts={args.experts}], got {args.topk}")
  bad = [d for d in dispatches if d not in ("ragged_dot", "blocked")]
  if bad or not dispatches:
    raise SystemExit(f"jaxrl: --dispatch takes ragged_dot and/or blocked, got {args.dispatch!r}")
  n, d, e, f, k = args.tokens, args.hidden, args.experts, args.width, args.topk
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(0), 8)
  scale = lambda fan_in: 1.0 / fan_in ** 0.5
  x = (jax.random.normal(keys[0], (1, n, d)) * 0.5).astype(dtype)
  moe_params = {
      "router": (jax.random.normal(keys[1], (d, e)) * scale(d)).astype(jnp.float32),
      "we_gate": (jax.random.normal(keys[2], (e, d, f)) * scale(d)).astype(dtype),
      "we_up": (jax.random.normal(keys[3], (e, d, f)) * scale(d)).astype(dtype),
      "we_down": (jax.random.normal(keys[4], (e, f, d)) * scale(f)).astype(dtype)}
  dense_params = {
      "gate": (jax.random.normal(keys[5], (d, k * f)) * scale(d)).astype(dtype),
      "up": (jax.random.normal(keys[6], (d, k * f)) * scale(d)).astype(dtype),
      "down": (jax.random.normal(keys[7], (k * f, d)) * scale(k * f)).astype(dtype)}

  def moe_loss(dispatch):
    cfg = ModelConfig(vocab_size=256, d_model=d, num_layers=1, num_heads=max(d // 128, 1),
                      num_kv_heads=max(d // 128, 1), head_dim=128, mlp_dim=k * f, num_experts=e,
                      num_experts_per_tok=k, moe_intermediate_size=f, moe_dispatch=dispatch,
                      norm_topk_prob=True)

    def loss(p, x):
      y, _ = moe_mlp(x, p, cfg, None)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    return loss

  def dense_loss(p, x):
    h = jax.nn.silu(x @ p["gate"]) * (x @ p["up"])
    return jnp.sum((h @ p["down"]).astype(jnp.float32) ** 2)

  cases = {"dense": (dense_loss, dense_params)}
  cases.update({dispatch: (moe_loss(dispatch), moe_params) for dispatch in dispatches})
  flops = 3 * 3 * 2 * n * d * k * f  # 3 products, forward + backward (x3), 2 flops a MAC
  compiled, out = {}, {}
  for name, (fn, p) in cases.items():
    log(f"compiling {name} ...")
    t0 = time.perf_counter()
    try:
      compiled[name] = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(p, x).compile()
      jax.block_until_ready(compiled[name](p, x))  # warm-up
      out[name] = {"compile_s": round(time.perf_counter() - t0, 3)}
    except Exception as err:  # noqa: BLE001  (the report says which case failed, and why)
      out[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:400]}"}
  times = {name: [] for name in compiled}
  for _ in range(args.runs):
    for name, fn in compiled.items():
      p = cases[name][1]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(p, x))
      times[name].append(time.perf_counter() - t0)
  for name, ts in times.items():
    med = statistics.median(ts)
    out[name].update({"median_ms": round(med * 1e3, 3), "tflops": round(flops / med / 1e12, 3)})
  if "dense" in times:
    for name in times:
      if name != "dense":
        out[name]["vs_dense"] = round(out[name]["median_ms"] / out["dense"]["median_ms"], 3)
  dev = jax.devices()[0]
  report = {"benchmark": "moe_dispatch", "device": {"platform": dev.platform,
                                                     "kind": dev.device_kind},
            "jax": jax.__version__, "shape": {"tokens": n, "hidden": d, "experts": e,
                                               "width": f, "topk": k, "dtype": args.dtype},
            "flops_per_step": flops, "runs": args.runs, "cases": out}
  print(json.dumps(report))
  return report


if __name__ == "__main__":
  main()
