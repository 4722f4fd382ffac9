"""Reading the files of a Hugging Face model directory without jax.

The tokenizer's, as transformers does: `jaxrl.data.hf_tokenizer.HFTokenizer.from_dir` reads a
directory with these: the special-token strings (`tokenizer_config.json`, legacy
`special_tokens_map.json`), the chat templates (`chat_template.jinja`, `additional_chat_templates/`,
or `chat_template` in the config) and the ids in `generation_config.json`, each checked and
reported with the file it came from. The precedence rules are described in
`jaxrl.data.hf_tokenizer`'s module docstring.

The weights' headers: `safetensors_problems` checks that every `*.safetensors` file the model
needs is there and holds exactly what its header promises, so that config validation can name a
truncated or corrupt file before a run creates anything (the safetensors library only says
"incomplete metadata", without the file, once the model is being loaded).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from jaxrl.core.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# The named special tokens transformers exposes as `special_tokens_map` (and so to templates).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# Bytes per element of each safetensors dtype (its spec's names).
_SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                            "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                            "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_SAFETENSORS_HEADER = 100 * 2**20  # the safetensors library's own limit


class HFTokenizerError(UserError, ValueError):
  """A tokenizer directory whose files are missing, malformed or inconsistent."""


def read_json(path: str) -> dict | None:
  """The JSON object in `path`, or None when there is no such file."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise HFTokenizerError(f"{path}: cannot read JSON: {e}") from e
  if not isinstance(data, dict):
    raise HFTokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def _token_string(value: Any, field: str, where: str) -> str | None:
  """A special token as written in a config: a string, an AddedToken dict, or null."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise HFTokenizerError(f"{where}: {field} must be a string, a {{\"content\": ...}} dict or null, "
                         f"got {value!r}")


def read_special_tokens(config: dict, config_path: str, tokens_map: dict | None,
                        map_path: str) -> tuple[dict[str, str], dict[str, str]]:
  """-> (token name -> string, token name -> file it came from), transformers' precedence."""
  tokens: dict[str, str | None] = {}
  where: dict[str, str] = {}

  def take(source: Mapping, path: str):
    for key, value in source.items():
      if key == "extra_special_tokens" and isinstance(value, Mapping):
        take(value, path)  # model-specific named tokens, e.g. image_token
        continue
      if not key.endswith("_token"):
        continue
      if key not in NAMED_SPECIAL_TOKENS and not isinstance(value, (str, Mapping)):
        continue  # e.g. add_bos_token: a flag, not a token
      tokens[key] = _token_string(value, key, path)
      where[key] = path

  # Named tokens (bos_token, ...) and model-specific `*_token` strings all reach templates, as in
  # transformers 5. special_tokens_map.json is legacy: it applies (and wins) only for configs
  # written before `added_tokens_decoder` existed.
  take(config, config_path)
  if tokens_map is not None and "added_tokens_decoder" not in config:
    take(tokens_map, map_path)
  return {k: v for k, v in tokens.items() if v is not None}, where


def read_chat_templates(path: str, config: dict,
                        config_path: str) -> tuple[dict[str, str], dict[str, str]]:
  """-> (name -> template, name -> where it was read), with "default" the unnamed template."""
  templates: dict[str, str] = {}
  where: dict[str, str] = {}
  value = config.get("chat_template")
  if isinstance(value, str):
    templates["default"], where["default"] = value, f"{config_path} (chat_template)"
  elif isinstance(value, list):
    for i, entry in enumerate(value):
      if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
              and isinstance(entry.get("template"), str)):
        raise HFTokenizerError(f"{config_path}: chat_template[{i}] must be a "
                               f"{{\"name\": str, \"template\": str}} dict")
      templates[entry["name"]] = entry["template"]
      where[entry["name"]] = f"{config_path} (chat_template {entry['name']!r})"
  elif value is not None:
    raise HFTokenizerError(f"{config_path}: chat_template must be a string or a list of "
                           f"{{\"name\", \"template\"}} dicts, got {type(value).__name__}")

  # Separate files win over the config, as in transformers' from_pretrained.
  files: dict[str, str] = {}
  jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
  if os.path.isfile(jinja_file):
    files["default"] = jinja_file
  extra_dir = os.path.join(path, CHAT_TEMPLATE_DIR)
  if os.path.isdir(extra_dir):
    for name in sorted(os.listdir(extra_dir)):
      if name.endswith(".jinja"):
        files[name[:-len(".jinja")]] = os.path.join(extra_dir, name)
  if files:
    templates, where = {}, {}
    for name, file in files.items():
      with open(file, encoding="utf-8") as f:
        templates[name], where[name] = f.read(), file
  return templates, where


def id_list(value: Any, field: str, where: str) -> list[int]:
  """A token-id field of a generation config (an int, a list of ints, or null) as a list."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise HFTokenizerError(f"{where}: {field} must be a non-negative int or a list of them, "
                           f"got {value!r}")
  return list(values)


def safetensors_problem(path: str) -> str | None:
  """What is wrong with the safetensors file `path`, as "<path>: <problem>", or None.

  Reads only the header: an 8-byte little-endian length, then that many bytes of JSON mapping
  each tensor to its dtype, shape and `data_offsets` [begin, end) in the data that follows.
  The tensors must tile the data exactly (the library refuses anything else), so a truncated or
  padded file shows as a size that differs from 8 + header + the last tensor's end.
  """
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      n = int.from_bytes(head, "little") if len(head) == 8 else -1
      if n < 0 or n > min(size - 8, _MAX_SAFETENSORS_HEADER):
        return (f"{path}: not a complete safetensors file ({size:,} bytes; its first 8 bytes "
                f"give a header of {max(n, 0):,} bytes); truncated or corrupt, download it again")
      header = json.loads(f.read(n).decode("utf-8"))
  except OSError as e:
    return f"{path}: cannot be read: {e.strerror or e}"
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    return f"{path}: the safetensors header is not valid JSON ({e}); corrupt, download it again"
  if not isinstance(header, dict):
    return f"{path}: the safetensors header is not a JSON object; corrupt, download it again"
  spans = []
  for name, info in header.items():
    if name == "__metadata__":
      continue
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and
            all(isinstance(x, int) and x >= 0 for x in offsets) and offsets[0] <= offsets[1]
            and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
      return f"{path}: tensor {name!r} has a malformed header entry {info!r}"
    width = _SAFETENSORS_DTYPE_BYTES.get(info.get("dtype"))
    if width is not None and offsets[1] - offsets[0] != width * math.prod(shape):
      return (f"{path}: tensor {name!r} ({info.get('dtype')} {shape}) spans "
              f"{offsets[1] - offsets[0]:,} bytes, expected {width * math.prod(shape):,}")
    spans.append((offsets[0], offsets[1], name))
  end = 0
  for begin, stop, name in sorted(spans):
    if begin != end:
      return f"{path}: tensor {name!r} starts at byte {begin:,} of the data, expected {end:,}"
    end = stop
  if 8 + n + end != size:
    what = "truncated" if 8 + n + end > size else "longer than its header says"
    return (f"{path}: {what}: its header describes {8 + n + end:,} bytes, the file has "
            f"{size:,}; download it again")
  return None


def safetensors_problems(model_dir: str) -> list[str]:
  """Problems of the weights of a model directory: `model.safetensors`, or every shard that
  `model.safetensors.index.json` names (each checked by `safetensors_problem`)."""
  index = os.path.join(model_dir, SAFETENSORS_INDEX_FILE)
  if os.path.exists(index):
    try:
      weight_map = read_json(index).get("weight_map")
    except HFTokenizerError as e:
      return [str(e)]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
      return [f"{index}: no 'weight_map' of tensor name -> file"]
    problems = []
    for shard in sorted(set(weight_map.values())):
      path = os.path.join(model_dir, shard)
      problem = (f"{index}: shard file {path} is missing" if not os.path.isfile(path)
                 else safetensors_problem(path))
      if problem:
        problems.append(problem)
    return problems
  single = os.path.join(model_dir, SAFETENSORS_FILE)
  if not os.path.exists(single):
    return [f"{model_dir}: neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE} exists (the "
            "weights)"]
  problem = safetensors_problem(single)
  return [problem] if problem else []
