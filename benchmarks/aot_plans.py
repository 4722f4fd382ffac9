"""The plan table: each shipped recipe at real scale compiled for its documented targets by
`python -m jaxrl.plan` (XLA:TPU through libtpu, XLA:GPU through the CUDA plugin, on this CPU),
one process per plan, run one after another (each compile uses the whole machine).

Prints one JSON object per plan as it finishes, then a markdown table (docs/plan.md holds the
latest); `--out FILE` also writes every plan as one JSON object. Every figure is compiled or
estimated, none measured.

  PYTHONPATH=. python benchmarks/aot_plans.py                    # the whole table (about an hour)
  PYTHONPATH=. python benchmarks/aot_plans.py --only 0.5b        # one recipe's rows
  PYTHONPATH=. python benchmarks/aot_plans.py --quick            # the default run on v5e-4
  # GPU rows from a venv with the CUDA plugin (pip install -e ".[cuda]"):
  PYTHONPATH=. python benchmarks/aot_plans.py --gpu-python <a venv with the cuda extra>/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30

# (short name, recipe file, targets it is documented to fit)
MATRIX = [
    ("default", "jaxrl/recipes/default.py", ["v5e-4"]),
    ("0.5b", "configs/qwen2_5_0_5b_gsm8k.py", ["v5e-4", "v5p-8", "h100-1", "h200-1"]),
    ("0.5b-lora", "configs/qwen2_5_0_5b_gsm8k_lora.py", ["v5e-4", "v5p-8", "h100-1"]),
    ("1b", "configs/llama3_2_1b_gsm8k.py", ["v5e-8", "v5e-16", "v5p-8", "v5p-16", "h100-1",
                                            "h200-1"]),
    ("1b-lora", "configs/llama3_2_1b_gsm8k_lora.py", ["v5e-16", "v5p-8", "v5p-16", "h200-1"]),
    ("7b", "configs/qwen2_5_7b_gsm8k.py", ["v5p-16", "v5p-32", "h100-8"]),
    ("30b-a3b", "configs/qwen3_30b_a3b_plan.py", ["v5p-64", "v5p-128", "h200-8x2"]),
]


def run_plan(recipe: str, target: str, python: str, extra: list[str]) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = ROOT
  cmd = [python, "-m", "jaxrl.plan", "--config", recipe, "--target", target, "--json", *extra]
  t0 = time.perf_counter()
  r = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)
  wall = time.perf_counter() - t0
  lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
  shown = " ".join(["python -m jaxrl.plan", "--config", recipe, "--target", target, *extra])
  if not lines:
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("jaxrl:")] or \
        r.stderr.strip().splitlines()[-1:]
    return {"recipe": recipe, "target": target, "command": shown, "error": " ".join(errors),
            "wall_s": round(wall, 1)}
  plan = json.loads(lines[-1])
  return {"recipe": recipe, "target": target, "command": shown, "wall_s": round(wall, 1),
          "plan": plan}


def row(r: dict) -> str:
  if "plan" not in r:
    return f"| {r['recipe']} | {r['target']} | not planned: {r['error']} | | | | | | | |"
  p = r["plan"]
  peak, usable = p["peak"]["total"], p["target"]["usable_bytes"]
  e = p["estimates"]
  step = f">= {seconds(e['train_step_s'])}"
  decode = f"{e['decode_tokens_per_s']:,.0f}" + (
      f" ({e['decode_compiler_tokens_per_s']:,.0f})" if e.get("decode_compiler_tokens_per_s")
      else "")
  coll = p["programs"].get("train_step", {}).get("collectives") or {}
  coll = ", ".join(f"{k} {v['ops']}" for k, v in coll.items()) or "none"
  compile_s = sum(c["compile_s"] for c in p["programs"].values())
  refused = [n for n, c in p["programs"].items() if c["error"]]
  fits = ("yes" if p["fits"] else "**no**") + (f" (refused: {', '.join(refused)})" if refused else "")
  mp = p.get("memory_plan") or {}
  ratios = " / ".join(f"{mp[k]['ratio']:.2f}" if k in mp else "-"
                      for k in ("train_step", "sampler", "total"))
  size = f"{peak / GIB:.1f}" if peak >= GIB / 10 else f"{peak / (1 << 20):.1f} MiB"
  return (f"| {r['recipe']} | {r['target']} | {fits} | {size} / {usable / GIB:.1f} GiB "
          f"({1 - peak / usable:.0%}) | {step} | {decode} | {coll} | {ratios} | "
          f"{compile_s:.0f} s |")


def seconds(s: float) -> str:
  return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


HEADER = ("| recipe | target | fits | peak / usable per chip (headroom) | est. train step (at "
          "the bf16 peak) | est. decode tok/s: roofline (XLA:TPU) | train-step collectives (ops) | "
          "memory plan / compiled: train, sampler, peak | compile (2 CPU cores) |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", default="", help="comma list of recipe short names "
                  f"({', '.join(m[0] for m in MATRIX)})")
  ap.add_argument("--targets", default="", help="comma list: only these targets")
  ap.add_argument("--gpu-python", default=sys.executable,
                  help="the python of a venv with the CUDA plugin, for the h100/h200 rows")
  ap.add_argument("--quick", action="store_true", help="the default run on v5e-4 only")
  ap.add_argument("--out", default=None)
  ap.add_argument("--table-from", default=None,
                  help="print the table of plans already made: a JSON file this script wrote "
                       "with --out, or `python -m jaxrl.plan --json` outputs (comma list)")
  args, extra = ap.parse_known_args()
  if args.table_from:
    print(HEADER)
    for path in args.table_from.split(","):
      with open(path) as f:
        text = f.read()
      found = json.loads(text) if text.lstrip().startswith("[") else [
          {"recipe": (p := json.loads(ln))["config"], "target": p["target"]["name"], "plan": p}
          for ln in text.splitlines() if ln.startswith("{")]
      for r in found:
        print(row(r))
    return
  only = {s for s in args.only.split(",") if s}
  keep = {s for s in args.targets.split(",") if s}
  matrix = MATRIX[:1] if args.quick else MATRIX
  results = []
  for short, recipe, tgts in matrix:
    if only and short not in only:
      continue
    for t in tgts:
      if keep and t not in keep:
        continue
      python = args.gpu_python if t.startswith("h") else sys.executable
      print(f"planning {recipe} for {t} ...", file=sys.stderr, flush=True)
      r = run_plan(recipe, t, python, extra)
      r["recipe"] = short
      print(json.dumps(r), flush=True)
      results.append(r)
  print(HEADER)
  for r in results:
    print(row(r))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
