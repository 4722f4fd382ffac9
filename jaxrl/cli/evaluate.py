"""Evaluate a run's checkpoint, or a Hugging Face model, on any task and split:

    python -m jaxrl.evaluate --run RUN_DIR [--step N] [--task NAME] [--split val] \\
        [--samples K] [--temperature T] [--batch_size B] [--out FILE] [--config.key=value ...]
    python -m jaxrl.evaluate --hf MODEL_DIR --task math --config.task.path=data.jsonl ...
    python -m jaxrl.evaluate --endpoint http://HOST:PORT/v1 [--model NAME] [--concurrency 16] ...

It is the run's own validation pass (`jaxrl.run.validation.Evaluator.evaluate`, on parts built by
`jaxrl.run.parts.build_parts`), so `--run` on the checkpoint of step s with the run's own settings
gives exactly the accuracy that run logged for step s. The config is the run's `config.json`
(keys it lacks take their defaults, keys the schema no longer has are dropped), or with `--hf`
the recipe of `--config FILE` (default `jaxrl/recipes/default.py`) with `model.hf_path` set.
`--config FILE` with `--run` is only loaded for the tasks it registers. Then `--config.key=value`
overrides, then the flags: `--task` (`task.name`), `--samples` (`val.samples_per_prompt`),
`--temperature` (`val.temperature`), `--batch_size` (`val.batch_size`; `--batch-size` is a
deprecated spelling).

`--endpoint` evaluates whatever an OpenAI-compatible server serves (`python -m jaxrl.serve
--openai`, vLLM, ...) with the same pass, its sampler replaced by requests made with the `openai`
client (`jaxrl.serving.endpoint_eval`; the `serve` extra): the config is that of `--hf` without
a model, and the JSON also holds one record per row (`rows`). The endpoint is asked for its
models before anything else: an unreachable one, or one without `--model`, is one line naming
its URL, and nothing is written.

Prints accuracy, pass@k and mean completion length, overall and per task, as a table, and writes
them as JSON to `--out` (default `<run_dir>/eval-<step>-<task>-<split>.json`, or
`./eval-hf-<task>-<split>.json` with `--hf`, `./eval-endpoint-<task>-<split>.json` with
`--endpoint`). Params come from the checkpoint's policy alone (no optimizer state or ring is
read). One process only.

Errors a user can fix (no run directory or checkpoint, a missing step, an unknown task or split,
a bad config key) end as one line `jaxrl: ...` with exit status 1; `--debug`,
`--config.debug=true` or `JAXRL_DEBUG=1` re-raises (`jaxrl.cli.common`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from ml_collections import ConfigDict

from jaxrl import config as config_lib
from jaxrl.cli import common
from jaxrl.core.errors import UserError

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "default.py")


def _finite(x):
  """`x` with NaN and infinities as None (JSON has no NaN)."""
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  return None if isinstance(x, float) and not math.isfinite(x) else x


def build_config(args: argparse.Namespace, overrides: list[str]) -> ConfigDict:
  """The evaluation's run config (see the module docstring); raises `UserError`s."""
  from jaxrl.envs import registry
  from jaxrl.recipes import default as default_config

  if args.config or args.hf or args.endpoint:
    base = config_lib.load_recipe(args.config or DEFAULT_CONFIG)
  if args.run:
    path = os.path.join(args.run, "config.json")
    if not os.path.isfile(path):
      raise UserError(f"{path} is missing: {args.run!r} is not a jaxrl run directory")
    with open(path) as f:
      try:
        saved = json.load(f)
      except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    cfg = ConfigDict(config_lib.merge_saved(default_config.get_config().to_dict(), saved))
  else:
    cfg = base
    # Through an endpoint no model is read here: the recipe gives the task, its evaluation
    # settings and how prompts are rendered (`tokenizer.chat_template`, `tokenizer.system_prompt`).
    cfg.model.hf_path = args.hf or ""
  problems: list[str] = []
  cfg = config_lib.parse_overrides(cfg, overrides, problems)
  config_lib.resolve_model_file(cfg, problems)  # a .gguf file: its converted directory
  if problems:
    raise config_lib.ConfigError(problems)
  if args.task is not None:
    cfg.task.name = args.task
  # Names of a task family (`reasoning_gym:<dataset>`) are resolved by validation, which names
  # an unknown one with its close matches.
  unknown = [n for n in cfg.task.name.split("+")
             if n not in registry.task_names() and not registry.in_family(n)]
  if unknown:
    raise UserError(f"unknown task {', '.join(map(repr, unknown))}; registered tasks: "
                    f"{', '.join(registry.task_names())} (several joined by '+')")
  v = cfg.val
  if args.samples is not None:
    v.samples_per_prompt = args.samples
  if args.temperature is not None:
    v.temperature = args.temperature
  if args.batch_size is not None:
    v.batch_size = args.batch_size
  if v.samples_per_prompt > 1 and v.temperature == 0:
    raise UserError(f"{v.samples_per_prompt} samples per prompt need a temperature > 0 (greedy "
                    "samples of one prompt are all the same); pass --temperature")
  # What a training run would do and check first is not evaluation's: no warm-up, no resume,
  # one process. (The caller sets run_dir to where the results go: the directory checked.)
  cfg.sft.enabled = False
  cfg.resume, cfg.overwrite = "none", False
  cfg.distributed.auto = False
  cfg.distributed.num_processes, cfg.distributed.process_id = 1, 0
  cfg.distributed.coordinator_address = ""
  return cfg


def _checkpoint_step(run_dir: str, step: int | None) -> tuple[str, int]:
  """(checkpoint directory, step): `step` of `run_dir`'s checkpoints, or the newest usable."""
  from jaxrl.runtime import checkpoint

  directory = checkpoint.checkpoint_dir(run_dir)
  if not os.path.isdir(directory) or not checkpoint.complete_steps(directory):
    raise UserError(f"no checkpoint in {directory} (a run saves one every checkpoint.every "
                    "steps and at its end)")
  step, _ = checkpoint.choose_step(directory, step,
                                   say=lambda s: print(f"jaxrl.evaluate: {s}", file=sys.stderr))
  return directory, step


def _restore(directory: str, step: int, params):
  """The policy params of checkpoint `step`, laid out like `params` (the built model's)."""
  import jax

  from jaxrl.runtime import checkpoint

  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        params)
  from absl import logging

  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only directory is read-only
  reader = checkpoint.Checkpointer(directory, read_only=True)
  try:
    return reader.restore_params(step, target)[1]
  except ValueError as e:
    raise checkpoint.CheckpointError(
        f"checkpoint {os.path.join(directory, str(step))} does not fit the model this config "
        f"builds (a model.* key or the task's tokenizer changed?): {str(e).splitlines()[0]}"
    ) from e
  finally:
    reader.close()
    logging.set_verbosity(verbosity)


def summarize(metrics: dict, k: int, tasks: list) -> dict:
  """Overall and per-task accuracy, pass@k, mean completion length and prompt count, from an
  evaluation pass's `val/*` metrics over the rows `tasks` (their `env` names the task)."""
  counts: dict[str, int] = {}
  for t in tasks:
    counts[t.env] = counts.get(t.env, 0) + 1

  def entry(prefix: str, n: int) -> dict:
    return {"prompts": n, "accuracy": metrics[f"{prefix}accuracy"],
            f"pass@{k}": metrics[f"{prefix}pass@{k}"], "avg_length": metrics[f"{prefix}avg_length"]}

  overall = entry("val/", len(tasks))
  if len(counts) == 1:
    per_task = {next(iter(counts)): overall}
  else:
    per_task = {name: entry(f"val/{name}/", n) for name, n in counts.items()
                if f"val/{name}/accuracy" in metrics}
  return {**overall, "per_task": per_task}


def table(summary: dict, k: int) -> str:
  """The summary as a text table: one line per task, then "all" when there are several."""
  rows = list(summary["per_task"].items())
  if len(rows) > 1:
    rows.append(("all", summary))
  width = max(len("task"), *(len(name) for name, _ in rows))
  head = f"{'task':<{width}}  {'prompts':>7}  {'accuracy':>8}  {f'pass@{k}':>8}  {'avg_len':>8}"
  lines = [head] + [f"{name:<{width}}  {r['prompts']:>7}  {r['accuracy']:>8.4f}  "
                    f"{r[f'pass@{k}']:>8.4f}  {r['avg_length']:>8.2f}" for name, r in rows]
  return "\n".join(lines)


def evaluate_endpoint(args: argparse.Namespace, overrides: list[str]) -> tuple[dict, str]:
  """`evaluate` through an OpenAI-compatible endpoint (`jaxrl.serving.endpoint_eval`)."""
  from jaxrl.serving import endpoint_eval

  if args.concurrency < 1:
    raise UserError(f"--concurrency={args.concurrency} must be >= 1")
  if not args.timeout > 0:
    raise UserError(f"--timeout={args.timeout:g} must be > 0")
  endpoint = endpoint_eval.Endpoint(args.endpoint, args.model, api_key=args.api_key,
                                    timeout_s=args.timeout)
  cfg = build_config(args, overrides)
  config_lib.validate(cfg, 1)
  tasks = _split_rows(cfg, args.split)
  model = endpoint.probe()
  out = args.out or f"eval-endpoint-{cfg.task.name}-{args.split}.json"
  t0 = time.perf_counter()
  metrics, rows = endpoint_eval.evaluate(endpoint, cfg, tasks, concurrency=args.concurrency)
  k = cfg.val.samples_per_prompt
  return {"run": None, "step": None, "hf": None, "endpoint": endpoint.url, "model": model,
          "task": cfg.task.name, "split": args.split, "samples": k,
          "temperature": cfg.val.temperature, "batch_size": cfg.val.batch_size,
          **summarize(metrics, k, tasks), "time_s": time.perf_counter() - t0,
          "metrics": metrics, "rows": rows}, out


def _split_rows(cfg, split: str) -> list:
  """The rows of `split` of the config's task; a missing or empty split is one line."""
  from jaxrl.run.inputs import task_source

  try:
    tasks = task_source(cfg).split(split)
  except KeyError as e:
    raise UserError(f"no split {split!r}: {e.args[0]}") from None
  if not tasks:
    raise UserError(f"split {split!r} of task {cfg.task.name!r} is empty")
  return tasks


def evaluate(args: argparse.Namespace, overrides: list[str]) -> tuple[dict, str]:
  """Runs the evaluation `args` describe; returns the JSON to write and the file to write it
  to."""
  if args.endpoint:
    return evaluate_endpoint(args, overrides)
  cfg = build_config(args, overrides)
  directory, step = _checkpoint_step(args.run, args.step) if args.run else (None, None)
  out = args.out or os.path.join(args.run or ".", f"eval-{step if args.run else 'hf'}-"
                                 f"{cfg.task.name}-{args.split}.json")
  cfg.run_dir = os.path.dirname(os.path.abspath(out))

  import jax

  from jaxrl.run.parts import build_parts
  from jaxrl.run.validation import Evaluator

  device_memory = None if jax.default_backend() == "cpu" else 0
  mesh_shape = config_lib.validate(cfg, jax.device_count(), device_memory=device_memory)
  tasks = _split_rows(cfg, args.split)
  parts, params = build_parts(cfg, mesh_shape)
  tasks = parts.source.split(args.split)  # the rows the pass uses (bad rows skipped)
  if directory is not None:
    params = _restore(directory, step, params)
  t0 = time.perf_counter()
  metrics = Evaluator(parts, asynchronous=False).evaluate(params, args.split)
  k = cfg.val.samples_per_prompt
  return {"run": os.path.abspath(args.run) if args.run else None, "step": step,
          "hf": os.path.abspath(args.hf) if args.hf else None, "endpoint": None, "model": None,
          "task": cfg.task.name,
          "split": args.split, "samples": k, "temperature": cfg.val.temperature,
          "batch_size": cfg.val.batch_size, **summarize(metrics, k, tasks),
          "time_s": time.perf_counter() - t0, "metrics": metrics}, out


def user_message(e: BaseException) -> str | None:
  """The one-line `jaxrl: ...` for an error the user can fix (as `python -m jaxrl.train` prints
  them); None for a bug."""
  return common.user_message(e)


def parser() -> argparse.ArgumentParser:
  p = common.ArgumentParser(
      prog="python -m jaxrl.evaluate",
      description="Evaluate a jaxrl checkpoint or a Hugging Face model on a task's split with "
                  "the run's own validation pass; config keys as --config.key=value.")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--run", help="run directory (holds config.json and checkpoints/)")
  src.add_argument("--hf", help="Hugging Face model directory (config.json, *.safetensors, "
                   "tokenizer files), or a .gguf file (the gguf extra)")
  src.add_argument("--endpoint", help="an OpenAI-compatible API's base URL, e.g. "
                   "http://127.0.0.1:8000/v1 (python -m jaxrl.serve --openai, vLLM, ...)")
  p.add_argument("--model", default=None, help="with --endpoint: the model to ask for "
                 "(default: the first the endpoint lists)")
  p.add_argument("--concurrency", type=int, default=16, help="with --endpoint: requests in "
                 "flight at once (agent tasks: episodes; default 16)")
  p.add_argument("--timeout", type=float, default=300.0, help="with --endpoint: seconds a "
                 "request may take (default 300)")
  p.add_argument("--api_key", default=os.environ.get("OPENAI_API_KEY", "none"),
                 help="with --endpoint: the API key (default: $OPENAI_API_KEY, else 'none')")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--config", default=None, help="recipe file: the base config with --hf "
                 "(default jaxrl/recipes/default.py); with --run only its task registrations")
  p.add_argument("--task", default=None, help="task name(s), '+'-joined (default: the config's)")
  p.add_argument("--split", default="val", help="split to evaluate: val, dev, ... (default val)")
  p.add_argument("--samples", type=int, default=None, help="samples per prompt: k of pass@k")
  p.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 = "
                 "greedy")
  p.add_argument("--batch_size", type=int, default=None, help="prompts per generation batch")
  p.add_argument("--out", default=None, help="JSON file to write (default "
                 "<run_dir>/eval-<step>-<task>-<split>.json)")
  return p


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  argv = common.deprecated_flag(argv, "--batch-size", "--batch_size")
  overrides = [a for a in argv if a.startswith("--config.")]
  args = parser().parse_args([a for a in argv if not a.startswith("--config.")])
  if args.step is not None and not args.run:
    parser().error("--step needs --run")
  if not args.endpoint and (args.model is not None or args.concurrency != 16
                            or args.timeout != 300.0):
    parser().error("--model, --concurrency and --timeout need --endpoint")
  debug = common.debug_requested(args.debug, overrides)
  try:
    result, out = evaluate(args, overrides)
  except Exception as e:
    message = None if debug else user_message(e)
    if message is None:
      raise
    print(message, file=sys.stderr)
    return 1
  where = (f"step {result['step']} of {args.run}" if args.run else args.hf if args.hf
           else f"{result['model']!r} at {result['endpoint']}")
  print(f"jaxrl.evaluate: {where} | task {result['task']} | split {result['split']} | "
        f"{result['samples']} sample(s) per prompt at temperature {result['temperature']:g}")
  print(table(result, result["samples"]))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(_finite(result), f, indent=2)
    f.write("\n")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
