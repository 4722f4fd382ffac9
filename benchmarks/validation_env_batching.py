"""Validation with a slow environment: one call per task per turn vs one call per sample.

An environment whose cost is mostly per call (a judge model, a sandbox, a remote verifier) costs
little when it sees all of a turn's rows at once. This benchmark validates the same samples two
ways through the real trainer parts (`jaxrl.run.validation.Evaluator`, the default model without the
supervised warm-up, task `add`, so the generations come from the real sampler):

- `batched`: what jaxrl does. `MultiTurn` calls the task's environment once per turn with all
  its active rows.
- `per_sample`: the same loop, but the environment is wrapped so a call with n rows is carried
  out as n one-row calls, one after another, as a per-sample dispatcher would.

Both ways use the same environment cost: a fixed `--call-ms` per call plus `--row-ms` per row
(sleeps, then the real `add` grading). Calls are counted in the wrappers (for `per_sample`, the
one-row calls). One untimed warm-up pass compiles the sampler first; `gen_only` passes with a
cost-free environment show what generation alone takes. Repeats alternate gen_only, batched,
per_sample; times are medians of wall time per `validate` call. Both ways must give identical
validation metrics and identical per-row responses and rewards, and the per-sample wrapper must
match one batched call on rows half of which are right; else the script exits nonzero.

Prints ONE JSON object (progress on stderr). Target: per_sample / batched >= 10x calls and
>= 5x wall time.

  PYTHONPATH=. python benchmarks/validation_env_batching.py [--repeats 3]
  PYTHONPATH=. python benchmarks/validation_env_batching.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl.run.validation import Evaluator
from jaxrl.run.parts import build_parts
from jaxrl.recipes.default import get_config
from jaxrl.envs.base import StepResult, Turn

CALLS_TARGET = 10.0
TIME_TARGET = 5.0


def log(*a):
  print(*a, file=sys.stderr, flush=True)


class Costly:
  """The `add` environment's grading behind a fixed per-call and a per-row cost.

  Records every call's size and every row's (uid, response, reward), so the two ways can be
  checked to have graded the same generations with the same results.
  """

  def __init__(self, step, call_s: float, row_s: float):
    self.inner, self.call_s, self.row_s = step, call_s, row_s
    self.reset()

  def reset(self):
    self.calls, self.rows, self.graded = 0, 0, []

  def __call__(self, turns) -> StepResult:
    self.calls += 1
    self.rows += len(turns)
    time.sleep(self.call_s + self.row_s * len(turns))
    res = self.inner(turns)
    self.graded += [(t.task.uid, t.response, float(r)) for t, r in zip(turns, res.rewards)]
    return res


def per_sample(step):
  """Wraps a batched step so n rows become n one-row calls, in order, results concatenated."""

  def run(turns) -> StepResult:
    parts = [step([t]) for t in turns]
    components = {k: np.concatenate([np.asarray(p.components[k]) for p in parts])
                  for k in (parts[0].components if parts else {})}
    metadata = None
    if parts and all(p.metadata is not None for p in parts):
      metadata = [m for p in parts for m in p.metadata]
    return StepResult(observations=[o for p in parts for o in p.observations],
                      rewards=np.concatenate([np.asarray(p.rewards) for p in parts]),
                      done=np.concatenate([np.asarray(p.done) for p in parts]),
                      components=components, metadata=metadata)

  return run


def same_result(a: StepResult, b: StepResult) -> bool:
  return (a.observations == b.observations and np.array_equal(a.rewards, b.rewards)
          and np.array_equal(a.done, b.done) and a.components.keys() == b.components.keys()
          and all(np.array_equal(a.components[k], b.components[k]) for k in a.components)
          and a.metadata == b.metadata)


def check_wrapper(step, tasks) -> tuple[bool, float]:
  """The per-sample wrapper against one batched call on turns that are right every other row.

  The untrained model solves (almost) nothing, so equal validation rewards alone would not show
  that the wrapper keeps rows in order; here half the rewards are 1. Returns (equal, reward mean).
  """
  turns = [Turn(task=t, turn=0, response=t.data["answer"] if i % 2 == 0 else "x",
                truncated=False, history=(("user", t.prompt),)) for i, t in enumerate(tasks)]
  want = step(turns)
  return same_result(per_sample(step)(turns), want), float(np.mean(want.rewards))


def build(samples: int, k: int):
  cfg = get_config()
  cfg.sft.enabled = False
  prompts = samples // k
  if k > 1:
    cfg.val.temperature = 1.0  # k > 1 samples per prompt need sampling; k = 1 stays greedy
  cfg.val.samples_per_prompt = k
  cfg.val.batch_size = prompts
  cfg.task.val_size = prompts
  # A per-sample pass makes one sleeping call per row; keep it well inside the env timeout so a
  # loaded machine cannot turn it into failed rows.
  cfg.env.timeout_s = 600.0
  mesh = config_lib.validate(cfg, jax.device_count())
  parts, params = build_parts(cfg, mesh)
  return cfg, parts, params


def timed(parts, params) -> tuple[float, dict]:
  t0 = time.perf_counter()
  metrics = Evaluator(parts, asynchronous=False).evaluate(params)
  return time.perf_counter() - t0, metrics


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--samples", type=int, default=256, help="validation samples per pass")
  ap.add_argument("--samples-per-prompt", type=int, choices=(1, 4), default=1,
                  help="1: samples prompts, greedy; 4: samples / 4 prompts at temperature 1")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--call-ms", type=float, default=50.0, help="fixed cost of every call")
  ap.add_argument("--row-ms", type=float, default=0.2, help="cost per row of a call")
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  if args.quick:
    args.samples, args.repeats = 64, 1
  t0 = time.perf_counter()
  load = os.getloadavg()[0]
  cfg, parts, params = build(args.samples, args.samples_per_prompt)
  env = parts.envs["add"]
  costly = Costly(env.step, args.call_ms / 1e3, args.row_ms / 1e3)
  wrapper_ok, wrapper_reward = check_wrapper(env.step, parts.source.split("val")[:16])
  log(f"per-sample wrapper vs one batched call (16 rows, half correct): "
      f"{'equal' if wrapper_ok else 'DIFFERENT'}")
  steps = {"gen_only": env.step, "batched": costly, "per_sample": per_sample(costly)}

  env.step = steps["gen_only"]
  warm_s, _ = timed(parts, params)
  log(f"warm-up pass (compiles the sampler): {warm_s:.2f} s")

  runs = {name: [] for name in steps}
  for i in range(args.repeats):
    for name, step in steps.items():
      env.step = step
      costly.reset()
      wall, metrics = timed(parts, params)
      runs[name].append({"wall_s": wall, "env_calls": costly.calls, "rows": costly.rows,
                         "loop_env_calls": metrics["val/env_calls"], "metrics": metrics,
                         "graded": list(costly.graded)})
      log(f"repeat {i} {name}: {wall:.3f} s, {costly.calls} environment calls "
          f"({costly.rows} rows), accuracy {metrics['val/accuracy']:.4f}")

  ref = runs["batched"][0]
  metrics_equal = all(r["metrics"] == ref["metrics"] for name in steps for r in runs[name])
  graded_equal = all(r["graded"] == ref["graded"] for name in ("batched", "per_sample")
                     for r in runs[name])
  rows_graded = len(ref["graded"])
  med = {name: statistics.median(r["wall_s"] for r in runs[name]) for name in steps}
  calls = {name: runs[name][0]["env_calls"] for name in ("batched", "per_sample")}
  calls_ratio = calls["per_sample"] / max(calls["batched"], 1)
  time_ratio = med["per_sample"] / med["batched"]
  k = cfg.val.samples_per_prompt
  report = {
      "benchmark": "validation_env_batching",
      "quick": args.quick,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "load_avg_1m_at_start": round(load, 2)},
      "versions": {"jax": jax.__version__, "numpy": np.__version__,
                   "python": platform.python_version()},
      "task": "add",
      "layout": f"{cfg.val.batch_size} prompts x {k} samples per prompt "
                f"(val.temperature {cfg.val.temperature:g})",
      "samples": cfg.val.batch_size * k,
      "rows_graded_per_pass": rows_graded,
      "env_cost": {"per_call_ms": args.call_ms, "per_row_ms": args.row_ms},
      "repeats": args.repeats,
      "warmup_pass_s": round(warm_s, 3),
      "gen_only_s": round(med["gen_only"], 4),
      "batched": {"env_calls": calls["batched"], "median_wall_s": round(med["batched"], 4),
                  "wall_s": [round(r["wall_s"], 4) for r in runs["batched"]]},
      "per_sample": {"env_calls": calls["per_sample"],
                     "median_wall_s": round(med["per_sample"], 4),
                     "wall_s": [round(r["wall_s"], 4) for r in runs["per_sample"]]},
      # What MultiTurn itself counts (`val/env_calls`): one per task per turn in both ways, since
      # the per-sample split happens inside the wrapped environment.
      "loop_env_calls": runs["batched"][0]["loop_env_calls"],
      "calls_ratio_per_sample_over_batched": round(calls_ratio, 2),
      "time_ratio_per_sample_over_batched": round(time_ratio, 2),
      "target": {"calls_ratio": CALLS_TARGET, "time_ratio": TIME_TARGET},
      "target_met": calls_ratio >= CALLS_TARGET and time_ratio >= TIME_TARGET,
      "metrics_equal": metrics_equal,
      "generations_equal": graded_equal,
      # The per-sample wrapper vs one batched call on 16 rows of which 8 are answered right.
      "wrapper_check": {"equal": wrapper_ok, "reward_mean": wrapper_reward},
      "val_metrics": ref["metrics"],
      "total_wall_s": round(time.perf_counter() - t0, 1),
  }
  print(json.dumps(report, indent=2))
  if not (metrics_equal and graded_equal and wrapper_ok):
    log("FAIL: the two ways gave different results")
    sys.exit(1)


if __name__ == "__main__":
  main()
