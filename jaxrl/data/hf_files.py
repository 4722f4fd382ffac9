"""Reading the tokenizer files of a Hugging Face model directory, as transformers does.

`jaxrl.data.hf_tokenizer.HFTokenizer.from_dir` reads a directory with these: the special-token
strings (`tokenizer_config.json`, legacy `special_tokens_map.json`), the chat templates
(`chat_template.jinja`, `additional_chat_templates/`, or `chat_template` in the config) and the
ids in `generation_config.json`, each checked and reported with the file it came from. The
precedence rules are described in `jaxrl.data.hf_tokenizer`'s module docstring.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

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


class HFTokenizerError(ValueError):
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
