"""Recipe files: `load_recipe(path)` runs a `--config path.py` file as a module of its own and
returns the config its `get_config()` makes, or raises `RecipeError` naming the file (missing, a
syntax error, an exception while it runs, no `get_config`). No jax here: it runs before the
config is validated.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from collections.abc import Mapping

from ml_collections import ConfigDict

from jaxrl.config.schema import flatten, is_section
from jaxrl.core.errors import UserError
from jaxrl.recipes import default as default_config


class RecipeError(UserError, ValueError):
  """A recipe file (`--config path.py`) that is missing, does not run, or defines no
  `get_config()`; the message names the file."""


RECIPE_MODULE = "jaxrl_recipe"


def _recipe_line(tb, path: str) -> str:
  """" at line N" of the innermost traceback frame in the recipe file `path`, else ""."""
  lines = [f.lineno for f in traceback.extract_tb(tb)
           if os.path.abspath(f.filename) == os.path.abspath(path)]
  return f" at line {lines[-1]}" if lines else ""


# Modules a recipe imports that moved when jaxrl's modules went into folders by role.
MOVED = {"jaxrl.configs": "jaxrl.recipes", "jaxrl.config_schema": "jaxrl.config.schema",
         "jaxrl.parts": "jaxrl.run.parts", "jaxrl.trainer": "jaxrl.run.driver",
         "jaxrl.types": "jaxrl.core.types", "jaxrl.names": "jaxrl.core.names",
         "jaxrl.errors": "jaxrl.core.errors"}


def _moved_hint(e: Exception) -> str:
  """"; <old> is now <new>" when `e` is the import of a module that moved, else ""."""
  name = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
  for old, new in MOVED.items():
    if name is not None and (name == old or name.startswith(old + ".")):
      return f" ({old} is now {new})"
  return ""


def _check_plain(cfg: Mapping, where: str) -> None:
  """A plain mapping from `get_config()` must hold every key of the schema (a whole config, e.g.
  a saved config.json's); one written from scratch is one error line, not a line per missing
  key."""
  want = [k for k, v in flatten(default_config.get_config()).items() if not is_section(v)]
  have = flatten(cfg)
  missing = [k for k in want if k not in have]
  if missing:
    raise RecipeError(
        f"{where}: get_config() returned a plain {type(cfg).__name__} without {len(missing)} of "
        f"the config's {len(want)} keys (first: {missing[0]}); start from "
        "jaxrl.recipes.default.get_config() and change its values")


def load_recipe(path: str) -> ConfigDict:
  """The config that the recipe file `path` returns from `get_config()`.

  `path` may end in `:ARG` (as in `recipe.py:small`), which is passed on as `get_config("small")`.
  The file runs as a fresh module of its own (`jaxrl_recipe`, in `sys.modules` so its classes,
  e.g. a registered task, can be found by name): nothing of an earlier recipe survives into it, so
  a file without `get_config` is an error, never the default recipe.

  Raises:
    RecipeError: naming the file: it does not exist, does not compile (with the line), raises
      while it loads or in `get_config()` (with the exception and the file's line), defines no
      `get_config()` (suggesting a close name), or returns something other than a config.
  """
  file, _, arg = path.partition(":") if not os.path.isfile(path) else (path, "", "")
  where = f"config file {file}"
  if not os.path.exists(file):
    raise RecipeError(f"{where}: no such file (--config takes a recipe file such as "
                      "configs/default.py)")
  if not os.path.isfile(file):
    raise RecipeError(f"{where}: not a file (--config takes a recipe file such as "
                      "configs/default.py)")
  loader = importlib.machinery.SourceFileLoader(RECIPE_MODULE, file)
  spec = importlib.util.spec_from_loader(RECIPE_MODULE, loader)
  module = importlib.util.module_from_spec(spec)
  sys.modules[RECIPE_MODULE] = module
  try:
    loader.exec_module(module)
  except SyntaxError as e:
    raise RecipeError(f"{where}: syntax error at line {e.lineno}: {e.msg}") from e
  except OSError as e:
    raise RecipeError(f"{where}: cannot be read: {e.strerror or e}") from e
  except Exception as e:
    raise RecipeError(f"{where}: raised {type(e).__name__}{_recipe_line(e.__traceback__, file)} "
                      f"while loading: {e}{_moved_hint(e)}") from e
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    names = [n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n])]
    close = difflib.get_close_matches("get_config", names, n=1, cutoff=0.6)
    hint = f" (found {close[0]}(): misspelt?)" if close else ""
    raise RecipeError(f"{where}: defines no get_config(){hint}; a recipe returns its "
                      "ConfigDict from get_config()")
  try:
    cfg = get_config(arg) if arg else get_config()
  except Exception as e:
    raise RecipeError(f"{where}: get_config() raised {type(e).__name__}"
                      f"{_recipe_line(e.__traceback__, file)}: {e}") from e
  if isinstance(cfg, Mapping) and not isinstance(cfg, ConfigDict):
    _check_plain(cfg, where)
    cfg = ConfigDict(cfg)
  if not isinstance(cfg, ConfigDict):
    raise RecipeError(f"{where}: get_config() returned {type(cfg).__name__}, not a ConfigDict "
                      "(start from jaxrl.recipes.default.get_config() and return it)")
  return cfg
