"""Train-step throughput: the full jitted GRPO step (loss + grad + AdamW update) on random data.

Prints ONE JSON object on stdout (progress goes to stderr). For each case: compile time (first
call, which compiles and runs once), then the median wall time of the timed steps, reported as
completion tokens/s (B x N, the tokens the loss is taken over) and sequence tokens/s
(B x (Lp + N), the tokens the forward/backward pass runs over). Masks are all on, rewards are
random, group ids are arange(B) // 8, so every step does the same work.

  PYTHONPATH=. python benchmarks/train_step.py [--cases default,long] [--steps 10]
  PYTHONPATH=. python benchmarks/train_step.py --cases default --microbatches 1,8
  PYTHONPATH=. python benchmarks/train_step.py --quick   # smoke test, tiny sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from jaxrl.recipes.default import get_config
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import init_model
from jaxrl.parallel.sharding import make_mesh
from jaxrl.learner.step import build_train_step, make_optimizer, to_rows
from jaxrl.learner.rl import rl_step_config
from jaxrl.core.types import TrainBatch

DEFAULT_VOCAB = 14  # the `add` task's CharTokenizer: 12 characters + pad + EOS
GROUP = 8


def log(*a):
  print(*a, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Case:
  name: str
  rows: int  # B
  prompt_len: int  # Lp
  new_tokens: int  # N


def make_cases(quick: bool, cfg) -> dict[str, Case]:
  r = cfg.rollout  # the default RL batch: P x G rows, prompt budget + completion budget
  if quick:
    return {"default": Case("default (quick)", 32, r.max_prompt_len, r.max_new_tokens),
            "long": Case("long (quick)", 8, 16, 48)}
  return {"default": Case("default", r.num_prompts * r.group_size, r.max_prompt_len,
                          r.max_new_tokens),
          "long": Case("long", 64, 64, 192)}


def random_batch(case: Case, vocab: int, seed: int = 0) -> TrainBatch:
  rng = np.random.default_rng(seed)
  B, Lp, N = case.rows, case.prompt_len, case.new_tokens
  return TrainBatch(
      # One prompt per group of GROUP rows, as GRPO batches are laid out.
      prompt_tokens=np.repeat(rng.integers(2, vocab, (-(-B // GROUP), Lp)), GROUP, 0)[:B]
      .astype(np.int32),
      prompt_valid=np.ones((B, Lp), bool),
      tokens=rng.integers(2, vocab, (B, N)).astype(np.int32),
      mask=np.ones((B, N), bool),
      rollout_logprobs=(-rng.uniform(0.5, 4.0, (B, N))).astype(np.float32),
      rewards=rng.integers(0, 2, B).astype(np.float32),
      group_id=(np.arange(B) // GROUP).astype(np.int32),
      temperature=np.ones(B, np.float32),
  )


def run_case(case: Case, model_cfg: ModelConfig, cfg, steps: int, impl: str | None,
             microbatches: int = 1, shared: int = 0) -> dict:
  B, Lp, N = case.rows, case.prompt_len, case.new_tokens
  log(f"[{case.name}] B={B} Lp={Lp} N={N} micro-batches={microbatches} shared prompts={shared}")
  mesh = make_mesh(1, 1, 1)
  graphdef, params = init_model(model_cfg, seed=0)
  t = cfg.train
  extra = {"warmup_steps": t.warmup_steps} if "warmup_steps" in t else {}  # as the trainer
  optimizer = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                             grad_clip=t.grad_clip, **extra)
  step_cfg = dataclasses.replace(rl_step_config(cfg), num_microbatches=microbatches,
                                 logprob_impl=impl, shared_prompts=shared)
  step, init_state = build_train_step(graphdef, optimizer, step_cfg, mesh, params)
  state = init_state(params)
  batch = to_rows(random_batch(case, model_cfg.vocab_size), mesh)
  jax.block_until_ready((state, batch))

  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  first = time.perf_counter() - t0
  log(f"[{case.name}] first step (compile + run) {first:.2f}s, loss {float(metrics['loss']):.4f}")
  if int(metrics["skipped_nonfinite"]) or int(metrics["prompt_layout_errors"]):
    raise RuntimeError("the step skipped its update: the timing would be wrong")

  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
  log(f"[{case.name}] steps: " + " ".join(f"{x * 1e3:.1f}ms" for x in times))
  med = statistics.median(times)
  comp, seq = B * N, B * (Lp + N)
  temp = step.jitted.lower(state, batch).compile().memory_analysis()
  return {
      "rows": B,
      "microbatches": microbatches,
      "shared_prompts": shared,
      "xla_temp_bytes": None if temp is None else int(temp.temp_size_in_bytes),
      "prompt_len": Lp,
      "new_tokens": N,
      "completion_tokens_per_step": comp,
      "sequence_tokens_per_step": seq,
      "first_step_s": round(first, 3),
      "compile_s_est": round(max(first - med, 0.0), 3),
      "median_step_s": round(med, 5),
      "step_s": [round(x, 5) for x in times],
      "completion_tokens_per_s": round(comp / med, 1),
      "sequence_tokens_per_s": round(seq / med, 1),
      "steps_per_s": round(1.0 / med, 2),
      "final_loss": float(metrics["loss"]),
      "applied_steps": int(state.step),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="default,long", help="comma list of: default, long")
  ap.add_argument("--steps", type=int, default=10, help="timed steps per case (>= 5)")
  ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
  ap.add_argument("--logprob-impl", default="auto",
                  help="fused log-prob kernel: auto (the trainer's choice), reference, xla")
  ap.add_argument("--microbatches", default="1",
                  help="comma list of train.num_microbatches to time, e.g. 1,8 (each divides B)")
  ap.add_argument("--shared-prompts", default="8",
                  help="comma list of StepConfig.shared_prompts to time (0 = each row runs its "
                       f"own prompt; {GROUP} = the group's prompt runs once, as the trainer)")
  args = ap.parse_args()
  try:
    shared_list = [int(g) for g in args.shared_prompts.split(",") if g.strip()]
  except ValueError:
    ap.error(f"--shared-prompts must be integers; got {args.shared_prompts!r}")
  try:
    counts = [int(m) for m in args.microbatches.split(",") if m.strip()]
  except ValueError:
    ap.error(f"--microbatches must be integers; got {args.microbatches!r}")
  if not counts or min(counts) < 1:
    ap.error("--microbatches needs counts >= 1")
  if args.steps < 1:
    ap.error("--steps must be >= 1")
  t_start = time.perf_counter()

  cfg = get_config()
  model_cfg = ModelConfig.from_config(cfg.model, DEFAULT_VOCAB)
  cases = make_cases(args.quick, cfg)
  names = [c.strip() for c in args.cases.split(",") if c.strip()]
  for n in names:
    if n not in cases:
      ap.error(f"unknown case {n!r}; choose from {sorted(cases)}")

  report = {
      "benchmark": "train_step",
      "quick": args.quick,
      "steps": args.steps,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "model": {k: getattr(model_cfg, k) for k in (
          "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "mlp_dim", "tie_embeddings", "scan_layers", "dtype")},
      "step_config": {"loss": "rl (default objective: ppo, token_mean)",
                      "logprob_impl": args.logprob_impl, "optimizer": "clip + adamw",
                      "learning_rate": cfg.train.learning_rate,
                      "warmup_steps": cfg.train.get("warmup_steps", 0),
                      "group_size": GROUP, "mesh": [1, 1, 1]},
      "cases": {},
  }
  for n in names:
    c = cases[n]
    impl = None if args.logprob_impl == "auto" else args.logprob_impl
    for m in counts:
      if c.rows % m:
        ap.error(f"--microbatches {m} does not divide the {c.name} case's {c.rows} rows")
      for g in shared_list:
        key = c.name + ("" if counts == [1] else f", micro-batches {m}") + \
            ("" if len(shared_list) == 1 else f", shared prompts {g}")
        report["cases"][key] = run_case(c, model_cfg, cfg, args.steps, impl, m, g)
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
