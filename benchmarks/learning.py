"""Learning acceptance of the default recipe: README command 1 for many seeds on two code paths.

Runs `python -m jaxrl.train --config.seed=N` (the default recipe, one host device: exactly the
README command) for every seed, once on the machine's native XLA CPU code path and once with
`XLA_FLAGS=--xla_cpu_max_isa=AVX2` (XLA's CPU code differs by instruction set, so this stands in
for a second machine), plus the `--config.rollout.lag=2` run on each path. Prints ONE JSON object
on stdout (progress goes to stderr): per run the held-out accuracy before and after RL, the gain,
the warm-up's length, the wall time of the whole command, and for lag runs whether first-token
staleness was exactly min(batch_id, L) on every step; then the weakest run's margin over each bar.
`learning_bars_met` judges accuracy, gain, the before-RL ceiling and staleness; the wall-time bar
is reported as a margin only (it depends on what else the machine is doing).

  python benchmarks/learning.py                       # seeds 0-7 x {native, avx2} + lag 2 (~50 min)
  python benchmarks/learning.py --seeds 0 --isas native --lag-seeds ""   # one run
  python benchmarks/learning.py --jobs 2              # two runs at a time (wall times then shared)
  python benchmarks/learning.py --quick               # smoke test: seed 0, both paths, tiny runs
  python benchmarks/learning.py --seeds 0 -- --config.train.steps=300   # overrides after --

Runs go one at a time by default so that each wall time is the command's own on this machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

# The acceptance bars of the default recipe (held-out greedy exact match, 1,000 problems).
BARS = {"after_rl": 0.80, "gain": 0.40, "before_rl_max": 0.45, "wall_s_native": 180.0}
ISA_FLAGS = {"native": None, "avx2": "--xla_cpu_max_isa=AVX2"}
QUICK = ["--config.sft.max_steps=20", "--config.train.steps=5", "--config.val.every=5",
         "--config.task.dev_size=100", "--config.task.val_size=100", "--config.val.batch_size=100",
         "--config.rollout.num_prompts=8", "--config.checkpoint.every=0"]


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def cpu_info() -> dict:
  model, flags = platform.processor(), ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
          flags = line + " "
          break
  except OSError:
    pass
  return {"cpu": model, "avx512f": " avx512f " in flags, "avx2": " avx2 " in flags,
          "cores": os.cpu_count(), "python": platform.python_version()}


def env_for(isa: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if ISA_FLAGS[isa]:
    env["XLA_FLAGS"] = ISA_FLAGS[isa]
  return env


def one_run(seed: int, isa: str, lag: int, root: str, extra: list[str]) -> dict:
  name = f"seed{seed}-{isa}" + (f"-lag{lag}" if lag else "")
  run_dir = os.path.join(root, name)
  cmd = [sys.executable, "-m", "jaxrl.train", f"--config.seed={seed}",
         f"--config.run_dir={run_dir}", *([f"--config.rollout.lag={lag}"] if lag else []), *extra]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=root, env=env_for(isa), capture_output=True, text=True)
  wall = time.perf_counter() - t0
  out = {"run": name, "seed": seed, "isa": isa, "lag": lag, "wall_s": round(wall, 1),
         "returncode": proc.returncode}
  if proc.returncode != 0:
    out["error"] = (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()
    return out
  with open(os.path.join(run_dir, "summary.json")) as f:
    s = json.load(f)
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  rl = [r for r in rows if r["phase"] == "rl" and r["step"] > 0]
  val = [(r["step"], round(r["val/accuracy"], 3)) for r in rows if r["phase"] == "val"]
  out.update({
      "before_rl": round(s["val/accuracy_before_rl"], 4),
      "after_rl": round(s["val/accuracy_after_rl"], 4),
      "gain": round(s["val/rl_gain"], 4),
      "sft_steps": s.get("sft/steps"),
      "sft_dev_accuracy": s.get("sft/dev_accuracy"),
      "rl_steps": len(rl),
      "total_time_s": round(s["total_time_s"], 1),
      "val_curve": val,
  })
  if lag:
    out["staleness_exact"] = all(
        r["staleness/first_token/max"] == min(r["batch_id"], lag) for r in rl)
  return out


def summarize(runs: list[dict]) -> dict:
  ok = [r for r in runs if r["returncode"] == 0]
  weakest = {}
  if ok:
    after = min(ok, key=lambda r: r["after_rl"])
    gain = min(ok, key=lambda r: r["gain"])
    before = max(ok, key=lambda r: r["before_rl"])
    weakest = {
        "after_rl": {"run": after["run"], "value": after["after_rl"],
                     "margin": round(after["after_rl"] - BARS["after_rl"], 4)},
        "gain": {"run": gain["run"], "value": gain["gain"],
                 "margin": round(gain["gain"] - BARS["gain"], 4)},
        "before_rl": {"run": before["run"], "value": before["before_rl"],
                      "margin": round(BARS["before_rl_max"] - before["before_rl"], 4)},
    }
    native = [r for r in ok if r["isa"] == "native" and r["lag"] == 0]
    if native:
      slow = max(native, key=lambda r: r["wall_s"])
      weakest["wall_s_native"] = {"run": slow["run"], "value": slow["wall_s"],
                                  "margin": round(BARS["wall_s_native"] - slow["wall_s"], 1)}
  passed = bool(ok) and len(ok) == len(runs) and all(
      r["after_rl"] >= BARS["after_rl"] and r["gain"] >= BARS["gain"]
      and r["before_rl"] <= BARS["before_rl_max"] and r.get("staleness_exact", True)
      for r in ok)
  return {"weakest": weakest, "learning_bars_met": passed,
          "failed_runs": [r["run"] for r in runs if r["returncode"] != 0]}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma list of seeds")
  ap.add_argument("--isas", default="native,avx2", help="comma list of: native, avx2")
  ap.add_argument("--lag", type=int, default=2, help="the forced lag of the lag runs")
  ap.add_argument("--lag-seeds", default="0", help="seeds of the lag runs (on every ISA); '' = none")
  ap.add_argument("--jobs", type=int, default=1, help="runs at a time (wall times then shared)")
  ap.add_argument("--out-dir", default="", help="keep run directories here (default: a temp dir)")
  ap.add_argument("--quick", action="store_true",
                  help="smoke test: seed 0 and a lag run of 5 RL steps after a 20-step warm-up")
  ap.add_argument("--partial", default="", help="also rewrite this JSON file after every run")
  ap.add_argument("extra", nargs="*",
                  help="more --config.key=value overrides for every run, after `--`")
  args = ap.parse_args()
  if args.quick:
    args.seeds = "0"
    args.extra = [*QUICK, *args.extra]
  isas = [x for x in args.isas.split(",") if x]
  bad = [x for x in isas if x not in ISA_FLAGS]
  if bad:
    ap.error(f"unknown ISA(s) {bad}; choose from {sorted(ISA_FLAGS)}")
  seeds = [int(x) for x in args.seeds.split(",") if x != ""]
  lag_seeds = [int(x) for x in args.lag_seeds.split(",") if x != ""]
  plan = [(s, i, 0) for i in isas for s in seeds] + [(s, i, args.lag) for i in isas
                                                     for s in lag_seeds]
  plan.sort(key=lambda p: (p[1] != isas[0], p[2] != 0, p[0]))
  root = args.out_dir or tempfile.mkdtemp(prefix="jaxrl-learning-")
  os.makedirs(root, exist_ok=True)
  log(f"{len(plan)} runs, {args.jobs} at a time, run directories in {root}")
  if not plan:
    ap.error("nothing to run: --seeds and --lag-seeds are both empty")
  runs = []
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
    futures = [pool.submit(one_run, s, i, lag, root, args.extra) for s, i, lag in plan]
    for fut in futures:
      r = fut.result()
      runs.append(r)
      if r["returncode"] == 0:
        log(f"[{len(runs)}/{len(plan)}] {r['run']}: {r['before_rl']:.3f} -> {r['after_rl']:.3f} "
            f"({r['gain']:+.3f}), warm-up {r['sft_steps']} steps, {r['wall_s']:.0f} s")
      else:
        log(f"[{len(runs)}/{len(plan)}] {r['run']}: FAILED (exit {r['returncode']})")
      report = {"machine": cpu_info(), "bars": BARS, "jobs": args.jobs, "overrides": args.extra,
                "elapsed_s": round(time.perf_counter() - t0, 1), "runs": runs, **summarize(runs)}
      if args.partial:
        with open(args.partial, "w") as f:
          json.dump(report, f, indent=1)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
