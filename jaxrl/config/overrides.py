"""`--config.a.b=value` command-line overrides of a run config.

`parse_overrides` exists because `ml_collections.config_flags` reports an unknown override key as
a bare traceback naming only the leaf (`AttributeError: "'nonexistent'"`) and stops at the first
bad override; here every bad override is named, with a suggestion for a misspelt key, in the same
one-line-per-problem form as `jaxrl.config.validate`. No jax is imported here.
"""

from __future__ import annotations

from typing import Any

from ml_collections import ConfigDict

from jaxrl.config.schema import (PREFIX, WORDS, ConfigError, flatten, is_section,
                                 unknown_key)
from jaxrl.recipes import default as default_config

_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _parse_value(text: str, ref: Any) -> Any:
  """Parses `text` as the type of the default value `ref`; raises ValueError with a reason."""
  if isinstance(ref, bool):
    if text.lower() in _TRUE + _FALSE:
      return text.lower() in _TRUE
    raise ValueError(f"expected bool (true/false/1/0), got {text!r}")
  if isinstance(ref, int):
    try:
      return int(text)
    except ValueError:
      raise ValueError(f"expected int, got {text!r}") from None
  if isinstance(ref, float):
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"expected float, got {text!r}") from None
  return text


def parse_overrides(cfg: ConfigDict, argv: list[str],
                    problems: list[str] | None = None) -> ConfigDict:
  """Returns a copy of `cfg` with `--config.a.b=value` arguments from `argv` applied.

  Values are parsed by the type of the key in `jaxrl.recipes.default` (int, float, bool as
  true/false/1/0 in any case, str verbatim). Arguments not starting with `--config.` are
  ignored, so `argv` may be the full command line. Later overrides of the same key win.

  absl must not see the overrides: `DEFINE_config_file` scans `sys.argv` for them when it is
  defined, so pass it `sys_argv=sys.argv[:1]` and give `app.run` a `flags_parser` that drops
  `--config.*` arguments before calling `flags.FLAGS(...)`.

  With a `problems` list, bad overrides are appended to it and the good ones still applied, so
  the caller can validate the rest and report everything at once.

  Raises:
    ConfigError: naming every bad override (unknown key, section, unparsable value, no `=`),
      when no `problems` list is given.
  """
  known = flatten(default_config.get_config())
  out = cfg.to_dict()  # plain dicts: ConfigDict refuses a float into a field holding an int
  collect = problems is not None
  problems = [] if problems is None else problems
  for arg in argv:
    if not arg.startswith("--" + PREFIX):
      continue
    path, sep, text = arg[len("--" + PREFIX):].partition("=")
    if path not in known:
      problems.append(unknown_key(path, known))
    elif is_section(known[path]):
      problems.append(f"{PREFIX}{path}: is a section; override its keys one by one")
    elif not sep:
      problems.append(f"{PREFIX}{path}: override needs a value, as in {arg}=VALUE")
    else:
      try:
        value = text if WORDS.get(path) == text else _parse_value(text, known[path])
      except ValueError as e:
        problems.append(f"{PREFIX}{path}: {e} (from {arg})")
        continue
      *parents, leaf = path.split(".")
      node = out
      for p in parents:
        node = node.setdefault(p, {}) if isinstance(node, dict) else None
      if isinstance(node, dict):
        node[leaf] = value
      # Otherwise the loaded config has a scalar where a section belongs; validate reports it.
  if problems and not collect:
    raise ConfigError(problems)
  return ConfigDict(out)
