"""`python -m jaxrl.plan --config <recipe> --target <target> [--json] [--config.KEY=VALUE ...]`:
every program of a run compiled for a TPU slice or a GPU host on this machine, without the
accelerator, and whether it fits (`jaxrl.aot`).

A command of its own rather than a flag of `jaxrl.train`: it starts another compiler (libtpu or
the CUDA plugin, with their environment set before JAX starts), needs none of the files a run
reads (weights, data, run directory) and never creates any, and compiles for a device list that
is not this machine's. Exit status 0 when the plan fits, 1 when it does not or cannot be made
(one `jaxrl:` line each), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxrl.aot import targets

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "default.py")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  ap = argparse.ArgumentParser(
      prog="python -m jaxrl.plan",
      description="Compile every program of a run for a TPU or GPU target on this machine and "
                  "report per-chip memory, estimated step time and whether it fits. Config keys "
                  "are set as --config.KEY=VALUE, as for jaxrl.train.")
  ap.add_argument("--config", default=None, help="recipe file (default: the default recipe)")
  ap.add_argument("--target", required=True,
                  help=f"accelerator: {', '.join(targets.known())}")
  ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  ap.add_argument("--programs", default="",
                  help="comma list of programs to compile (default: all): train_step, publish, "
                       "prefill, decode, val_prefill, val_decode")
  overrides = [a for a in argv if a.startswith("--config.")]
  args = ap.parse_args([a for a in argv if not a.startswith("--config.")])
  return args, overrides


def main(argv: list[str] | None = None) -> int:
  args, overrides = parse(sys.argv[1:] if argv is None else argv)
  say = lambda m: print(m, file=sys.stderr, flush=True)
  try:
    target = targets.parse_target(args.target)
  except targets.TargetError as e:
    return _fail(str(e))
  # The config is checked before the compiler is looked for or started (validation starts no
  # JAX backend), so every mistake in the command is named at once, compiler or not.
  targets.prepare_environment(target.platform)  # before JAX starts a backend
  from jaxrl import config as config_lib
  from jaxrl.aot import plan as plan_lib
  from jaxrl.aot.programs import PROGRAM_NAMES
  from jaxrl.cli import common

  only = tuple(p.strip() for p in args.programs.split(",") if p.strip())
  unknown = [p for p in only if p not in PROGRAM_NAMES]
  if unknown:
    return _fail(f"--programs: unknown program(s) {', '.join(map(repr, unknown))}; known: "
                 f"{', '.join(PROGRAM_NAMES)}")

  try:
    problems: list[str] = []
    cfg = config_lib.parse_overrides(config_lib.load_recipe(args.config or DEFAULT_CONFIG),
                                     overrides, problems)
    if problems:
      raise config_lib.ConfigError(problems)
    mesh_shape = plan_lib.prepare(cfg, target, say)
  except targets.TargetError as e:
    return _fail(str(e))
  except Exception as e:  # noqa: BLE001  (a user's error is one line; anything else a bug)
    message = common.user_message(e)
    if message is None:
      raise
    print(message, file=sys.stderr)
    return 1
  missing = targets.missing_compiler(target.platform)
  if missing:
    return _fail(f"target {target.name}: {missing}")
  devices = targets.devices(target)
  plan = plan_lib.make_plan(cfg, target, mesh_shape, devices, only, progress=say)
  if args.json:
    print(json.dumps(plan, default=str))
  else:
    print(plan_lib.render(plan))
  if not plan["fits"]:
    for line in plan["lines"]:
      if line.startswith("jaxrl:"):
        print(line, file=sys.stderr)
  return 0 if plan["fits"] else 1


def _fail(message: str) -> int:
  print(f"jaxrl: {message}", file=sys.stderr)
  return 1


def run() -> None:
  sys.exit(main())
