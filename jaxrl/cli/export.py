"""A run's checkpoint as a Hugging Face model directory any serving stack loads, or a LoRA run's
adapters as a PEFT adapter directory.

    python -m jaxrl.export --run runs/qwen-gsm8k-... --out exported/ [--step N]
    python -m jaxrl.export --run runs/qwen-lora-... --out adapter/ --adapter
    python -m jaxrl.export --run runs/qwen-lora-... --out merged/ --merged

(`--run_dir` is a deprecated spelling of `--run`.) An error the user can fix ends as one line
`jaxrl: ...` with exit status 1; `--debug` or `JAXRL_DEBUG=1` shows its traceback.

A run started from `model.hf_path` keeps a copy of that directory's metadata (config, generation
config, tokenizer files, chat template) under `<run_dir>/hf_base/`. Export restores only the
policy parameters of a checkpoint (the latest by default) onto one device, writes them with
`jaxrl.models.hf_checkpoint.save_hf`, then puts the original `config.json` back (with the dtype of the
exported tensors) and copies the tokenizer files, so the result differs from the starting model
in its weights only.

A LoRA run (`model.lora.rank` > 0) checkpoints its adapters (the train state's `params`) apart
from its frozen base (`frozen`). Its plain export, like `--merged`, is the whole model with every
adapter folded into the weight it adapts (`jaxrl.models.lora.merged_weights`). `--adapter` writes
the adapters alone in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`), which
`peft.PeftModel.from_pretrained` (or vLLM, SGLang, ...) applies to the starting Hugging Face
model. jaxrl's LoRA is PEFT's: per adapted projection `x @ W + (x @ A) @ B * alpha / rank`, with
heads flattened in the base weight's order, so each tensor is only transposed (PEFT's
`lora_A.weight` is [rank, in], `lora_B.weight` [out, rank]). That holds only while the run's base
is the starting model: a run whose supervised warm-up trained the base (`sft/steps` > 0 in its
checkpoint) is refused with `--adapter` (its adapters would be applied to weights they were not
trained on); export it with `--merged`.
"""

from __future__ import annotations

import json
import os
import sys
import types

from jaxrl.cli import common
from jaxrl.core.errors import UserError
from jaxrl.run.directory import METADATA_DIR, METADATA_FILES, copy_metadata  # noqa: F401

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names of a causal LM's weights: `PeftModelForCausalLM.base_model` (the LoRA model) ->
# `.model` (the transformers model) -> the model's own names, adapter name dropped.
PEFT_PREFIX = "base_model.model."


class ExportError(UserError, ValueError):
  """An export the run cannot give (e.g. `--adapter` of a run without LoRA); the message says
  why and what to do instead."""


def read_run(run_dir: str):
  """`(run_config, hf_config, model_config)` of a run started from a Hugging Face model, without
  reading a checkpoint: `run_config` is the run's saved config (a dict), `hf_config` the starting
  `config.json`, `model_config` the base model's (no LoRA)."""
  from jaxrl.models import hf_checkpoint as hf_lib

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
  return run_cfg, hf_config, model_cfg


def lora_config(run_cfg: dict, model_cfg):
  """The LoRA model config of a run (its saved config dict `run_cfg` and base model config), or
  None for a run without LoRA (rank 0, or a config from before LoRA)."""
  from jaxrl.models import lora as lora_lib

  section = run_cfg["model"].get("lora") or {}
  if not section.get("rank"):
    return None
  return lora_lib.with_lora(model_cfg, types.SimpleNamespace(**section))


def _one_device(abstract):
  import jax

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                      abstract)


def _restore(run_dir: str, step: int | None, targets: dict) -> tuple[int, dict, dict]:
  """`(step, fields, host)`: the train-state `fields` of checkpoint `step` (None: the latest)
  shaped as `targets` (abstract, one device), and its host JSON."""
  from jaxrl.runtime import checkpoint

  reader = checkpoint.Checkpointer(checkpoint.checkpoint_dir(run_dir), read_only=True)
  try:
    step, host = reader.read_host(step)
    try:
      step, fields = reader.restore_fields(step, {k: _one_device(v) for k, v in targets.items()})
    except (ValueError, TypeError) as e:
      raise ExportError(f"checkpoint {step} of {run_dir} does not hold the model its config.json "
                        f"describes ({', '.join(targets)}): {str(e).strip().splitlines()[0]}"
                        ) from e
  finally:
    reader.close()
  return step, fields, host


def restore_lora(run_dir: str, step: int | None = None, *, base: bool = True):
  """The adapters (and, with `base`, the frozen base) of checkpoint `step` (None: the latest) of
  a LoRA run started from a Hugging Face model, on one device: `(run_config, hf_config,
  lora_model_config, step, adapters, base or None, host)`; see `restore_run`. Raises
  `ExportError` for a run without LoRA."""
  from jaxrl.models import abstract_model
  from jaxrl.models import lora as lora_lib

  run_cfg, hf_config, model_cfg = read_run(run_dir)
  lora_cfg = lora_config(run_cfg, model_cfg)
  if lora_cfg is None:
    raise ExportError(f"run {run_dir} has no LoRA adapters (config model.lora.rank is 0): it "
                      "trained the whole model; export it without --adapter")
  targets = {"params": lora_lib.abstract_adapters(lora_cfg)}
  if base:
    targets["frozen"] = abstract_model(model_cfg)[1]
  step, fields, host = _restore(run_dir, step, targets)
  return run_cfg, hf_config, lora_cfg, step, fields["params"], fields.get("frozen"), host


def restore_run(run_dir: str, step: int | None = None):
  """The policy of checkpoint `step` (None: the latest) of a run started from a Hugging Face
  model, on one device: `(run_config, hf_config, model_config, graphdef, step, params)`, where
  `run_config` is the run's saved config (a dict) and `hf_config` the starting `config.json`.
  Only the parameters are read (no optimizer state, reference or saved rollouts). A LoRA run's
  policy is its base with the adapters merged in (`lora.merged_weights`): a plain model of the
  base's config, as any caller of this function expects."""
  from jaxrl.models import abstract_model
  from jaxrl.models import lora as lora_lib

  run_cfg, hf_config, model_cfg = read_run(run_dir)
  graphdef, abstract = abstract_model(model_cfg)
  if lora_config(run_cfg, model_cfg) is None:
    step, fields, _ = _restore(run_dir, step, {"params": abstract})
    return run_cfg, hf_config, model_cfg, graphdef, step, fields["params"]
  _, _, lora_cfg, step, adapters, base, _ = restore_lora(run_dir, step)
  params = lora_lib.merge(lora_cfg, lora_lib.join(base, adapters))
  return run_cfg, hf_config, model_cfg, graphdef, step, params


def export_hf(run_dir: str, out_dir: str, step: int | None = None) -> tuple[int, str]:
  """Writes checkpoint `step` (None: the latest) of `run_dir` to `out_dir` in Hugging Face
  format (a LoRA run: merged, see `restore_run`); returns `(step, out_dir)`."""
  from jaxrl.models import hf_checkpoint as hf_lib

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


def _peft_modules(lora_cfg) -> dict[str, str]:
  """LoRA target -> the module path of its layer-`{i}` projection in Hugging Face's names
  (`model.layers.{i}.self_attn.q_proj`), from the one table of tensor names (`hf._hf_layout`)."""
  from jaxrl.models import hf_checkpoint as hf_lib
  from jaxrl.models import lora as lora_lib

  layout = hf_lib._hf_layout(lora_cfg)
  return {t: layout[lora_lib.WEIGHTS[t]][0].removesuffix(".weight")
          for t in lora_cfg.lora_targets}


def adapter_config(lora_cfg, base_model: str) -> dict:
  """PEFT's `adapter_config.json` (a `LoraConfig` of task CAUSAL_LM) for the adapters of
  `lora_cfg` on `base_model` (a path or hub id): PEFT's scaling alpha / r, no rsLoRA, DoRA or
  bias, weights stored [out, in] (`fan_in_fan_out` false)."""
  alpha = lora_cfg.lora_alpha
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "revision": None, "r": lora_cfg.lora_rank,
      "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
      "lora_dropout": lora_cfg.lora_dropout,
      "target_modules": [m.rsplit(".", 1)[1] for m in _peft_modules(lora_cfg).values()],
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "lora_bias": False, "init_lora_weights": True, "inference_mode": True,
      "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
      "exclude_modules": None, "rank_pattern": {}, "alpha_pattern": {},
  }


def adapter_tensors(lora_cfg, adapters) -> dict:
  """PEFT tensor name -> numpy array of every adapter in `adapters` (an `nnx.State` of
  `lora_cfg`'s adapters): per layer i and target, `{PEFT_PREFIX}model.layers.{i}.<module>.
  lora_A.weight` = A[i].T [rank, in] and `... lora_B.weight` = B[i].T [out, rank], in the
  adapters' dtype."""
  import jax
  import numpy as np

  out = {}
  for t, module in _peft_modules(lora_cfg).items():
    a = np.asarray(jax.device_get(adapters[f"lora_{t}"]["lora_a"][...]))
    b = np.asarray(jax.device_get(adapters[f"lora_{t}"]["lora_b"][...]))
    for i in range(lora_cfg.num_layers):
      name = PEFT_PREFIX + module.format(i=i)
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
  return out


def export_adapter(run_dir: str, out_dir: str, step: int | None = None,
                   base_model: str | None = None) -> tuple[int, str]:
  """Writes the adapters of checkpoint `step` (None: the latest) of LoRA run `run_dir` to
  `out_dir` as a PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`) of
  `base_model` (None: the run's `model.hf_path`); returns `(step, out_dir)`. Only the adapters
  are read. Raises `ExportError` for a run without LoRA or one whose warm-up trained the base."""
  from safetensors.numpy import save_file

  run_cfg, _, lora_cfg, step, adapters, _, host = restore_lora(run_dir, step, base=False)
  warm_steps = (host.get("warmup") or {}).get("sft/steps", 0)
  if warm_steps:
    raise ExportError(f"checkpoint {step} of {run_dir}: the supervised warm-up trained the base "
                      f"model ({warm_steps} steps), so it is not {run_cfg['model']['hf_path']!r} "
                      "and a PEFT adapter on that model would not be this policy; export the "
                      "whole model with --merged")
  os.makedirs(out_dir, exist_ok=True)
  save_file(adapter_tensors(lora_cfg, adapters), os.path.join(out_dir, ADAPTER_WEIGHTS_FILE),
            metadata={"format": "pt"})
  config = adapter_config(lora_cfg, base_model or run_cfg["model"]["hf_path"])
  with open(os.path.join(out_dir, ADAPTER_CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write("\n")
  return step, out_dir


def main(argv: list[str] | None = None) -> int:
  parser = common.ArgumentParser(
      prog="python -m jaxrl.export",
      description="Write a jaxrl checkpoint of a run started from a Hugging Face model "
                  "(config.model.hf_path) as a Hugging Face model directory. A LoRA run "
                  "(model.lora.rank > 0) is written with its adapters merged into the weights, "
                  "or with --adapter as a PEFT adapter directory.")
  parser.add_argument("--run", required=True, help="the run directory (holds checkpoints/)")
  parser.add_argument("--out", required=True, help="directory to write (created if missing)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  kind = parser.add_mutually_exclusive_group()
  kind.add_argument("--adapter", action="store_true",
                    help="LoRA runs only: write the adapters alone as a PEFT adapter directory "
                         "(adapter_config.json, adapter_model.safetensors) for the starting "
                         "model; refused when the run's warm-up trained the base")
  kind.add_argument("--merged", action="store_true",
                    help="LoRA runs only: write the base with the adapters merged in, as a "
                         "plain Hugging Face model (what an export without a flag writes for a "
                         "LoRA run; the flag makes it an error for a run without LoRA)")
  parser.add_argument("--base_model", default=None,
                      help="with --adapter: base_model_name_or_path to write in "
                           "adapter_config.json (default: the run's model.hf_path), e.g. the "
                           "model's hub id")
  argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
  args = parser.parse_args(common.deprecated_flag(argv, "--run_dir", "--run"))
  if args.base_model is not None and not args.adapter:
    parser.error("--base_model goes with --adapter")
  try:
    if args.adapter:
      step, out = export_adapter(args.run, args.out, args.step, args.base_model)
    else:
      if args.merged:
        run_cfg, _, model_cfg = read_run(args.run)
        if lora_config(run_cfg, model_cfg) is None:
          raise ExportError(f"--merged: run {args.run} has no LoRA adapters (config "
                            "model.lora.rank is 0); export it without --merged")
      step, out = export_hf(args.run, args.out, args.step)
  except Exception as e:
    message = None if common.debug_requested(args.debug) else common.user_message(e)
    if message is None:
      raise
    print(message, file=sys.stderr)
    return 1
  what = " (PEFT adapter)" if args.adapter else ""
  print(f"jaxrl.export: step {step} of {args.run} -> {out}{what}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
