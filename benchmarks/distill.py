"""On-policy distillation against GRPO alone on the default task: steps to the teacher's accuracy.

For each seed, the default run (usual warm-up, then RL) twice: GRPO alone, and distilling from
`--teacher` (a jaxrl run directory, e.g. the default model after a longer supervised warm-up:
`python -m jaxrl.train --config.sft.stop_accuracy=0.9 --config.sft.max_steps=6000
--config.train.steps=1 --config.run_dir=runs/teacher`). Held-out accuracy is measured every
`--val-every` RL steps; the result is the first step at which each run reaches the teacher's
held-out accuracy minus `--margin` (None: not within `--steps`). Prints one JSON object.

  python benchmarks/distill.py --teacher runs/teacher --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _rows(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _teacher_accuracy(teacher: str) -> float:
  """The teacher's last held-out accuracy (its run's val rows)."""
  vals = [r for r in _rows(teacher) if r.get("phase") == "val"]
  if not vals:
    raise SystemExit(f"{teacher}: no val rows in metrics.jsonl (run it with validation on)")
  return max(vals, key=lambda r: r["step"])["val/accuracy"]


def _run(args: argparse.Namespace, seed: int, distill: bool, root: str) -> dict:
  run_dir = os.path.join(root, f"{'distill' if distill else 'grpo'}-{seed}")
  cmd = [sys.executable, "-m", "jaxrl.train", f"--config.seed={seed}",
         f"--config.train.steps={args.steps}", f"--config.val.every={args.val_every}",
         f"--config.run_dir={run_dir}", *args.extra]
  if distill:
    cmd += [f"--config.distill.teacher={args.teacher}", f"--config.distill.coef={args.coef}",
            f"--config.distill.reward_weight={args.reward_weight}"]
  t0 = time.monotonic()
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
  rows = _rows(run_dir)
  curve = sorted((r["step"], r["val/accuracy"]) for r in rows if r.get("phase") == "val")
  return {"command": " ".join(cmd[1:]), "wall_s": round(time.monotonic() - t0, 1),
          "curve": curve}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--teacher", required=True)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--val-every", type=int, default=25)
  p.add_argument("--margin", type=float, default=0.05)
  p.add_argument("--coef", type=float, default=1.0)
  p.add_argument("--reward-weight", type=float, default=0.0)
  p.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
  p.add_argument("extra", nargs="*", help="more --config.key=value overrides for every run")
  args = p.parse_args()
  target = _teacher_accuracy(args.teacher) - args.margin
  root = args.out or tempfile.mkdtemp(prefix="jaxrl-distill-")
  result = {"teacher": args.teacher, "teacher_accuracy": _teacher_accuracy(args.teacher),
            "target": round(target, 4), "seeds": {}}
  for seed in args.seeds:
    runs = {}
    for distill in (False, True):
      run = _run(args, seed, distill, root)
      reached = next((s for s, a in run["curve"] if a >= target), None)
      runs["distill" if distill else "grpo"] = {**run, "steps_to_target": reached,
                                                "final_accuracy": run["curve"][-1][1]}
      print(f"seed {seed} {'distill' if distill else 'grpo'}: target reached at step "
            f"{reached}, final {run['curve'][-1][1]:.3f}", file=sys.stderr, flush=True)
    result["seeds"][seed] = runs
  faster = [r["distill"]["steps_to_target"] is not None and
            (r["grpo"]["steps_to_target"] is None or
             r["distill"]["steps_to_target"] < r["grpo"]["steps_to_target"])
            for r in result["seeds"].values()]
  result["distill_faster_on_every_seed"] = all(faster)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
