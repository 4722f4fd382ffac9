"""A run's checkpoint as a Hugging Face model directory any serving stack loads.

    python -m jaxrl.export --run_dir runs/qwen-gsm8k-... --out exported/ [--step N]

A run started from `model.hf_path` keeps a copy of that directory's metadata (config, generation
config, tokenizer files, chat template) under `<run_dir>/hf_base/`. Export restores only the
policy parameters of a checkpoint (the latest by default) onto one device, writes them with
`jaxrl.models.hf.save_hf`, then puts the original `config.json` back (with the dtype of the
exported tensors) and copies the tokenizer files, so the result differs from the starting model
in its weights only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

METADATA_DIR = "hf_base"
# Everything of a Hugging Face model directory except the weights.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "chat_template.json", "added_tokens.json")


def copy_metadata(src: str, dst: str) -> list[str]:
  """Copies the metadata files present in `src` to `dst`; returns their names."""
  os.makedirs(dst, exist_ok=True)
  copied = []
  for name in METADATA_FILES:
    path = os.path.join(src, name)
    if os.path.isfile(path):
      shutil.copyfile(path, os.path.join(dst, name))
      copied.append(name)
  return copied


def restore_run(run_dir: str, step: int | None = None):
  """The policy of checkpoint `step` (None: the latest) of a run started from a Hugging Face
  model, on one device: `(run_config, hf_config, model_config, graphdef, step, params)`, where
  `run_config` is the run's saved config (a dict) and `hf_config` the starting `config.json`.
  Only the parameters are read (no optimizer state, reference or saved rollouts)."""
  import jax

  from jaxrl import checkpoint
  from jaxrl.models import abstract_model
  from jaxrl.models import hf as hf_lib

  base = os.path.join(run_dir, METADATA_DIR)
  config_path = os.path.join(run_dir, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} is missing: {run_dir!r} is not a jaxrl run directory")
  if not os.path.isdir(base):
    raise FileNotFoundError(f"{base} is missing: the run was not started from a Hugging Face "
                            "model (config.model.hf_path), so its architecture and tokenizer "
                            "are unknown")
  with open(config_path) as f:
    run_cfg = json.load(f)
  with open(os.path.join(base, hf_lib.CONFIG_FILE)) as f:
    hf_config = json.load(f)
  model = run_cfg["model"]
  model_cfg = hf_lib.config_from_hf(hf_config, param_dtype=model["param_dtype"],
                                    scan_layers=model["scan_layers"],
                                    config_path=os.path.join(base, hf_lib.CONFIG_FILE))
  graphdef, abstract = abstract_model(model_cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        abstract)
  reader = checkpoint.Checkpointer(checkpoint.checkpoint_dir(run_dir), read_only=True)
  try:
    step, params = reader.restore_params(step, target)
  finally:
    reader.close()
  return run_cfg, hf_config, model_cfg, graphdef, step, params


def export_hf(run_dir: str, out_dir: str, step: int | None = None) -> tuple[int, str]:
  """Writes checkpoint `step` (None: the latest) of `run_dir` to `out_dir` in Hugging Face
  format; returns `(step, out_dir)`."""
  from jaxrl.models import hf as hf_lib

  _, hf_config, model_cfg, _, step, params = restore_run(run_dir, step)
  hf_lib.save_hf(out_dir, model_cfg, params, architecture=hf_config["architectures"][0])
  copy_metadata(os.path.join(run_dir, METADATA_DIR), out_dir)
  # The starting config.json, which may hold fields jaxrl does not use (token ids, context
  # length), with the dtype the tensors were written in.
  hf_config.update(dtype=model_cfg.param_dtype, torch_dtype=model_cfg.param_dtype)
  with open(os.path.join(out_dir, hf_lib.CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
    f.write("\n")
  return step, out_dir


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxrl.export",
      description="Write a jaxrl checkpoint of a run started from a Hugging Face model "
                  "(config.model.hf_path) as a Hugging Face model directory.")
  parser.add_argument("--run_dir", required=True, help="the run directory (holds checkpoints/)")
  parser.add_argument("--out", required=True, help="directory to write (created if missing)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  args = parser.parse_args(argv)
  try:
    step, out = export_hf(args.run_dir, args.out, args.step)
  except FileNotFoundError as e:
    print(f"jaxrl.export: {e}", file=sys.stderr)
    return 1
  print(f"jaxrl.export: step {step} of {args.run_dir} -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
