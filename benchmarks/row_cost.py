"""Per-row cost of the train step's compiled temporaries, and how it grows with a row's length.

Per-row cost = (temp(16 rows) - temp(8 rows)) / 8 of `memory_analysis().temp_size_in_bytes`,
at rows of 256 + 512 and 512 + 1024 positions: what does not scale with rows (the weights' f32
copies, Adam's update temporaries) cancels. The model is the Qwen2.5-0.5B shape (24 layers,
d 896, 14 / 2 heads of 64, mlp 4864) with a smaller vocabulary (`--vocab`, default 4,096), bf16
compute, f32 master weights, `remat=full`, groups of 8 rows sharing a prompt. Each case names the
attention (`model.attention`) and the step's form for shared prompts: `packed` (each group's
prompt and continuations as one packed row, `Transformer.grouped_forward`) or `two_pass` (the
prompt into a KV cache repeated to every row, then the continuations). Compile only (nothing
runs), one CPU device; CPU's buffer assignment, not a GPU's. Prints one JSON object.

  PYTHONPATH=. python benchmarks/row_cost.py
  PYTHONPATH=. python benchmarks/row_cost.py --cases auto:packed,xla:packed,dense:two_pass
  PYTHONPATH=. python benchmarks/row_cost.py --quick   # 2 layers: a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.core.types import TrainBatch
from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.parallel.sharding import make_mesh

# Compile only: skip LLVM's optimisation of code that never runs (buffer assignment, all that
# memory_analysis() reports, happens before it).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def temp_bytes(step, init_state, params, rows: int, lp: int, n: int) -> int:
  S = jax.ShapeDtypeStruct
  batch = TrainBatch(prompt_tokens=S((rows, lp), jnp.int32), prompt_valid=S((rows, lp), bool),
                     tokens=S((rows, n), jnp.int32), mask=S((rows, n), bool),
                     rollout_logprobs=S((rows, n), jnp.float32), rewards=S((rows,), jnp.float32),
                     group_id=S((rows,), jnp.int32), temperature=S((rows,), jnp.float32))
  spec = lambda a, sharding: S(a.shape, a.dtype, sharding=sharding)
  state = jax.tree.map(spec, jax.eval_shape(init_state, params), step.state_shardings)
  batch = jax.tree.map(lambda a: spec(a, step.batch_sharding), batch)
  return step.jitted.lower(state, batch).compile(FAST_COMPILE).memory_analysis() \
      .temp_size_in_bytes


def case(attention: str, form: str, layers: int, vocab: int, lengths) -> dict:
  cfg = ModelConfig(vocab_size=vocab, d_model=896, num_layers=layers, num_heads=14,
                    num_kv_heads=2, head_dim=64, mlp_dim=4864, rope_theta=1e6, qkv_bias=True,
                    tie_embeddings=True, param_dtype="float32", dtype="bfloat16",
                    scan_layers=True, remat="full", attention=attention)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  step_cfg = StepConfig(shared_prompts=8, pack_prompts=form == "packed")
  step, init_state = build_train_step(graphdef, make_optimizer(1e-6), step_cfg,
                                      make_mesh(1, 1, 1, devices=jax.devices()[:1]), params)
  out = {"attention": attention, "form": form, "per_row_mb": {}, "temp_mb": {}}
  for lp, n in lengths:
    t0 = time.perf_counter()
    t8, t16 = (temp_bytes(step, init_state, params, rows, lp, n) for rows in (8, 16))
    out["per_row_mb"][lp + n] = round((t16 - t8) / 8 / 1e6, 1)
    out["temp_mb"][lp + n] = {"8_rows": round(t8 / 1e6, 1), "16_rows": round(t16 / 1e6, 1)}
    print(f"{attention}:{form} {lp}+{n}: {out['per_row_mb'][lp + n]} MB a row "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
  (a, b), (c, d) = lengths
  out["growth"] = round(out["per_row_mb"][c + d] / out["per_row_mb"][a + b], 3)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default="auto:packed,xla:packed,xla:two_pass",
                  help="attention:form pairs; form is packed or two_pass")
  ap.add_argument("--layers", type=int, default=24)
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--quick", action="store_true", help="2 layers, rows of 32 + 64 and 64 + 128")
  args = ap.parse_args()
  layers = 2 if args.quick else args.layers
  lengths = ((32, 64), (64, 128)) if args.quick else ((256, 512), (512, 1024))
  cases = [c.split(":") for c in args.cases.split(",")]
  results = [case(a, f, layers, args.vocab, lengths) for a, f in cases]
  print(json.dumps({"benchmark": "row_cost", "layers": layers, "vocab": args.vocab,
                    "lengths": [list(x) for x in lengths], "cases": results,
                    "jax": jax.__version__, "backend": jax.default_backend(),
                    "machine": platform.machine(), "command": " ".join(sys.argv)}))


if __name__ == "__main__":
  main()
