"""What a run depends on outside its config's own values, checked before anything is created:
a Hugging Face model directory that is complete and not contradicted, a run directory that can be
created and written, a resume path that holds a checkpoint, and a rollout batch that fits in
memory. Called by `jaxrl.config.validate` (so no jax here either); each check adds one line per
problem, starting with the full `config.` key.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any

from jaxrl.config.schema import PREFIX
from jaxrl.observe import sinks
from jaxrl.data import gguf_files, hf_files
from jaxrl.runtime import compile_cache

RUN_ROOT = "runs"  # where a run without config.run_dir goes: ./runs/<name>-<timestamp>


def default_run_dir(name: str, stamp: str) -> str:
  """`runs/<name>-<stamp>`: the run directory of a config without `run_dir`."""
  return os.path.join(RUN_ROOT, f"{name}-{stamp}")


# The keys a Hugging Face model directory decides (model.hf_path).
HF_ARCHITECTURE_KEYS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                        "head_dim", "mlp_dim", "rope_theta", "rms_eps", "qkv_bias", "qk_norm",
                        "tie_embeddings", "init_std", "num_experts", "num_experts_per_tok",
                        "moe_intermediate_size", "norm_topk_prob")


# The `hf` extra's modules: a Hugging Face model's weights, tokenizer and chat template.
HF_EXTRA_MODULES = ("safetensors", "tokenizers", "jinja2")


def missing_modules(names: tuple[str, ...]) -> list[str]:
  """Those of `names` that cannot be imported."""
  out = []
  for name in names:
    try:
      importlib.import_module(name)
    except ImportError:
      out.append(name)
  return out


# The `gguf` extra's modules: a GGUF file read as a model (jaxrl.data.gguf_files).
GGUF_EXTRA_MODULES = ("gguf",)


def gguf_cache_root() -> str:
  """Where GGUF files are converted to: `$JAXRL_GGUF_CACHE`, else `~/.cache/jaxrl/gguf`."""
  return compile_cache.cache_dir("auto", "JAXRL_GGUF_CACHE", "gguf")


def resolve_model_file(cfg, problems: list[str], say=print) -> None:
  """`model.hf_path` naming a `.gguf` file becomes the Hugging Face directory made from it
  (`jaxrl.data.gguf_files.model_dir`, cached by the file's content), so validation and the run
  read that directory; the line `say` prints names both. A file that cannot be read as a model
  is one problem naming it. Nothing is converted when the config already has problems."""
  path = cfg.get("model", {}).get("hf_path", "") if hasattr(cfg, "get") else ""
  if problems or not isinstance(path, str) or not path.endswith(".gguf"):
    return
  p = PREFIX
  if not os.path.isfile(path):
    problems.append(f"{p}model.hf_path: no file {path!r}")
    return
  missing = missing_modules(GGUF_EXTRA_MODULES + HF_EXTRA_MODULES)
  if missing:
    problems.append(f"{p}model.hf_path: a GGUF file needs the gguf and hf extras "
                    f"({', '.join(missing)} not installed): pip install -e \".[gguf]\"")
    return
  try:
    gguf_files.check(path)
    out = gguf_files.model_dir(path, gguf_cache_root(),
                               progress=lambda m: say(f"jaxrl | model.hf_path: {m}", flush=True))
  except gguf_files.GGUFError as e:
    problems.append(f"{p}model.hf_path: {e}")
    return
  except OSError as e:
    problems.append(f"{p}model.hf_path: cannot write the converted model ({e}); set "
                    "JAXRL_GGUF_CACHE to a writable directory")
    return
  cfg.model.hf_path = out


def check_hf(good: dict[str, Any], ref: dict[str, Any], problems: list[str]) -> None:
  """A Hugging Face model directory: present, complete enough to start, and not contradicted.

  The architecture comes from the directory's config.json, so an architecture key changed in the
  run config would be silently ignored; it is named instead. The warm-up's demonstrations are
  character-tokenizer ids, which a Hugging Face tokenizer cannot train on.
  """
  p = PREFIX
  path = good.get("model.hf_path", "")
  if not path or path.endswith(".gguf"):  # a GGUF file: resolve_model_file named its problem
    return
  if not os.path.isdir(path):
    problems.append(f"{p}model.hf_path: no directory {path!r}")
    return
  missing = missing_modules(HF_EXTRA_MODULES)
  if missing:
    problems.append(f"{p}model.hf_path: a Hugging Face model needs the hf extra "
                    f"({', '.join(missing)} not installed): pip install -e \".[hf]\"")
    return
  for name in ("config.json", "tokenizer.json"):
    if not os.path.isfile(os.path.join(path, name)):
      problems.append(f"{p}model.hf_path: {os.path.join(path, name)} is missing (a Hugging Face "
                      "model directory holds config.json, the *.safetensors weights, "
                      "tokenizer.json and tokenizer_config.json)")
  # The files' contents, as far as they can be read without building the model: JSON that
  # parses, weights whose headers promise no more than the files hold, a tokenizer that loads.
  try:
    hf_files.read_json(os.path.join(path, hf_files.MODEL_CONFIG_FILE))
  except hf_files.HFTokenizerError as e:
    problems.append(f"{p}model.hf_path: {e}")
  problems.extend(f"{p}model.hf_path: {e}" for e in hf_files.safetensors_problems(path))
  if os.path.isfile(os.path.join(path, hf_files.TOKENIZER_FILE)):
    problems.extend(f"{p}model.hf_path: {e}" for e in _tokenizer_problems(path, good))
  for key in HF_ARCHITECTURE_KEYS:
    k = f"model.{key}"
    if k in good and good[k] != ref[k]:
      problems.append(f"{p}{k}: is read from {path}/config.json with {p}model.hf_path set; "
                      f"leave it at its default {ref[k]!r}, got {good[k]!r}")
  # (Other tasks have no demonstrations at all, which _check_task reports.)
  if good.get("sft.enabled") and good.get("sft.max_steps", 0) > 0 and \
      good.get("task.name") == "add":
    problems.append(f"{p}sft.enabled: the supervised warm-up's demonstrations are "
                    f"character-tokenizer ids, not available with {p}model.hf_path; set it to "
                    f"false or {p}sft.max_steps to 0")


def check_run_dir(good: dict[str, Any], problems: list[str]) -> None:
  """The run directory (or, for `run_dir = ""`, `./runs`, where the run's own one goes) exists as
  a writable directory, or can be created: its nearest existing ancestor is a writable directory.

  Checked here because the run directory is the first thing a run creates; root passes every
  permission check, as it would when writing. Remote paths (`gs://...`) are not checked.
  """
  if "run_dir" not in good or "://" in good["run_dir"]:
    return
  path = good["run_dir"] or RUN_ROOT
  key = f"{PREFIX}run_dir: " + ("" if good["run_dir"] else
                                f"'' puts the run under ./{RUN_ROOT}, but ")
  full = os.path.abspath(path)
  if os.path.lexists(full):
    if not os.path.isdir(full):
      what = "a broken symbolic link" if os.path.islink(full) else "a file"
      problems.append(f"{key}{path} is {what}, not a directory; choose another "
                      f"{PREFIX}run_dir")
    elif not os.access(full, os.W_OK | os.X_OK):
      problems.append(f"{key}{path} is not writable; choose another {PREFIX}run_dir")
    return
  parent = os.path.dirname(full)
  while not os.path.lexists(parent) and parent != os.path.dirname(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    problems.append(f"{key}{path} cannot be created: {parent} is a file, not a directory")
  elif not os.access(parent, os.W_OK | os.X_OK):
    problems.append(f"{key}{path} cannot be created: {parent} is not writable")


def check_logging(good: dict[str, Any], problems: list[str]) -> None:
  """Each metrics backend of `logging.backends` has its package installed (the message names the
  pip extra), so a run never starts, creates its directory and then fails at its first row."""
  if sinks.KEY in good:
    problems.extend(sinks.missing_packages(good[sinks.KEY]))


def _step_dirs(path: str) -> list[str]:
  """Names of the finished checkpoint steps in `path` (directories named by a step number;
  an interrupted save's `<step>.orbax-checkpoint-tmp-*` is not one); [] when unreadable."""
  try:
    return [n for n in os.listdir(path) if n.isdigit() and os.path.isdir(os.path.join(path, n))]
  except OSError:
    return []


def check_resume(good: dict[str, Any], problems: list[str]) -> None:
  """A `resume` path holds a checkpoint: it is a checkpoint directory (step subdirectories), a
  run directory with one in `checkpoints/`, or one step of either.

  Plain directory listing, so that no jax or Orbax is imported here; which step is used (and
  whether it is intact) is decided when the run opens it.
  """
  path = good.get("resume")
  if path is None or path in ("auto", "none") or "://" in path:
    return
  if not os.access(path, os.R_OK | os.X_OK):
    problems.append(f"{PREFIX}resume: {path} is not readable")
    return
  nested = os.path.join(path, "checkpoints")
  step = os.path.basename(os.path.normpath(path))
  if _step_dirs(path) or _step_dirs(nested) or step.isdigit():
    return
  problems.append(f"{PREFIX}resume: {path} holds no checkpoint (expected a run directory whose "
                  "checkpoints/ holds step directories, a checkpoints/ directory, or one of its "
                  "steps)")


def _hf_dims(path: str) -> tuple[int, int, int] | None:
  """(layers, kv heads, head dim) from a Hugging Face `config.json`, None if it does not say."""
  try:
    with open(os.path.join(path, hf_files.MODEL_CONFIG_FILE), encoding="utf-8") as f:
      hf = json.load(f)
    layers, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
  except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
    return None
  return layers, kv, head_dim


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Per token of a training batch row on the devices: token id (int32), sampler log-prob (float32),
# loss mask (bool) and params version (int32), as the data plane holds them.
_BATCH_BYTES_PER_TOKEN = 4 + 4 + 1 + 4
# Per token on the host: the token ids it decodes for the environments (int32).
_HOST_BYTES_PER_TOKEN = 4


def host_memory_bytes() -> int | None:
  """This machine's physical memory, None where the OS does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def _gib(n: float) -> str:
  return f"{n / 2**30:,.1f} GiB"


def check_memory(good: dict[str, Any], problems: list[str], num_processes: int,
                  device_memory: int | None, host_memory: int | None) -> None:
  """Rejects a rollout batch that cannot fit in memory, naming its largest key and the estimate.

  The estimate is a lower bound, so only what clearly cannot fit is refused: per process (each
  generates its share of the rows), one batch of `rows x (max_prompt_len + completion budget)`
  tokens, at `_HOST_BYTES_PER_TOKEN` on the host and, on the devices, `_BATCH_BYTES_PER_TOKEN`
  (training rows) plus one decode's KV cache, `layers x 2 x kv_heads x head_dim x dtype bytes`
  per token of each row (or slot of the continuous engine) when the model's shape is known (the
  config's, or a Hugging Face directory's config.json). Parameters, optimizer state,
  activations and the lag ring's other batches come on top. Training rows are
  `rollout.num_prompts * rollout.group_size`, validation rows `val.batch_size *
  val.samples_per_prompt`.

  `device_memory` None: the devices are the host's CPU, so both parts count against
  `host_memory`; 0: unknown, only the host part is checked.
  """
  need = ("rollout.num_prompts", "rollout.group_size", "rollout.max_prompt_len",
          "rollout.max_new_tokens", "rollout.max_total_tokens", "val.batch_size",
          "val.samples_per_prompt", "model.dtype", "rollout.engine", "rollout.engine_slots")
  if not host_memory or not all(k in good for k in need):
    return
  if good.get("model.hf_path"):
    dims = _hf_dims(good["model.hf_path"])
  elif all(f"model.{k}" in good for k in ("num_layers", "num_kv_heads", "head_dim")):
    dims = good["model.num_layers"], good["model.num_kv_heads"], good["model.head_dim"]
  else:
    dims = None
  kv = 0 if dims is None else 2 * math.prod(dims) * _DTYPE_BYTES[good["model.dtype"]]
  slots = good["rollout.engine_slots"] if good["rollout.engine"] == "continuous" else 0
  p = PREFIX
  budget = "rollout.max_total_tokens" if good["rollout.max_total_tokens"] else \
      "rollout.max_new_tokens"
  tokens = good["rollout.max_prompt_len"] + good[budget]
  batches = (("rollout.num_prompts", "rollout.group_size", _BATCH_BYTES_PER_TOKEN),
             ("val.batch_size", "val.samples_per_prompt", 0))
  for rows_key, per_key, batch_bytes in batches:
    share = -(-good[rows_key] * good[per_key] // max(num_processes, 1))
    kv_rows = slots or share
    host = share * tokens * _HOST_BYTES_PER_TOKEN
    device = share * tokens * batch_bytes + kv_rows * tokens * kv
    of_slots = f" for each of {slots:,} slots ({p}rollout.engine_slots)" if slots else ""
    parts = [f"{_HOST_BYTES_PER_TOKEN} bytes of token ids on the host",
             f"{batch_bytes} of log-probs/masks/versions", f"{kv} of KV cache{of_slots}"]
    if device_memory is None:
      total, limit, have = host + device, host_memory, "this machine's {} of memory"
    elif host > host_memory:
      total, limit, have, parts = host, host_memory, "this machine's {} of memory", parts[:1]
    else:
      total, limit, have = device, device_memory, "the {} of this process's devices"
      parts = parts[1:]
    if not limit or total <= limit:
      continue
    sizes = {rows_key: good[rows_key], per_key: good[per_key],
             "rollout.max_prompt_len": good["rollout.max_prompt_len"], budget: good[budget]}
    processes = f" / {num_processes} processes" if num_processes > 1 else ""
    per_token = " + ".join(x for x in parts if not x.startswith("0 "))
    problems.append(
        f"{p}{max(sizes, key=sizes.get)}: a batch cannot fit in memory: {share:,} rows "
        f"({p}{rows_key} * {p}{per_key}{processes}) x {tokens:,} tokens "
        f"({p}rollout.max_prompt_len + {p}{budget}) need at least {_gib(total)} (per token: "
        f"{per_token}), over {have.format(_gib(limit))}")
    return  # one line says it; a smaller batch may fix both


def _tokenizer_problems(path: str, good: dict[str, Any]) -> list[str]:
  """The Hugging Face tokenizer of `path` loads as the run will load it (files, special tokens,
  chat template); [] without the `hf` extra, which the run itself then reports."""
  try:
    # Imported here, not at the top: it needs tokenizers and jinja2, the optional `hf` extra.
    from jaxrl.data.hf_tokenizer import HFTokenizer
  except ImportError:
    return []
  try:
    HFTokenizer.from_dir(path, use_chat_template=good.get("tokenizer.chat_template", True),
                         system_prompt=good.get("tokenizer.system_prompt") or None)
  except hf_files.HFTokenizerError as e:
    return [str(e)]
  return []
