"""What every jaxrl command shares: the one-line `jaxrl: ...` text of an error the user can fix,
and the debug switch (`--debug` or `JAXRL_DEBUG=1`) that shows its traceback instead.

Every command (train, evaluate, export, plot, serve) ends a user error as one line starting
`jaxrl: ` with exit status 1; anything else is a bug in jaxrl and keeps its traceback. No jax.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxrl.config.schema import ConfigError
from jaxrl.core.errors import UserError

# File errors whose message (path and reason) tells the user what to change.
USER_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                  NotADirectoryError)
DEBUG_ENV = "JAXRL_DEBUG"
# Optional modules by the pyproject extra that installs them (hyphenated names: the spelling
# every pip accepts).
EXTRA_OF = {"safetensors": "hf", "tokenizers": "hf", "jinja2": "hf", "math_verify": "math",
            "tensorboardX": "tensorboard", "wandb": "wandb", "reasoning_gym": "reasoning-gym",
            "torch": "parity", "transformers": "parity", "peft": "parity", "starlette": "serve",
            "uvicorn": "serve", "openai": "serve"}


def debug_env(environ=os.environ) -> bool:
  """`JAXRL_DEBUG` set to anything but "", "0" or "false"."""
  return environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")


def debug_requested(flag: bool, overrides: list[str] = (), environ=os.environ) -> bool:
  """Tracebacks wanted: `--debug`, `JAXRL_DEBUG`, or the last `--config.debug=` override."""
  if flag or debug_env(environ):
    return True
  for arg in reversed(list(overrides)):
    if arg.startswith("--config.debug="):
      return arg.partition("=")[2].strip().lower() in ("true", "1")
  return False


class ArgumentParser(argparse.ArgumentParser):
  """argparse with jaxrl's ending for a bad command line: one line `jaxrl: <prog>: <what>`,
  exit status 1 (as `python -m jaxrl.train` ends a bad flag), and a `--debug` flag."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.add_argument("--debug", action="store_true",
                      help="show tracebacks instead of one-line `jaxrl:` errors (also "
                           "JAXRL_DEBUG=1)")

  def error(self, message: str):
    print(f"jaxrl: {self.prog}: {message} (--help lists the flags)", file=sys.stderr)
    sys.exit(1)


def deprecated_flag(argv: list[str], old: str, new: str) -> list[str]:
  """`argv` with the old spelling `old` of a flag (alone or as `old=VALUE`) renamed to `new`,
  and one line on stderr saying so."""
  out = []
  for a in argv:
    if a == old or a.startswith(old + "="):
      print(f"jaxrl: {old} is deprecated; use {new}", file=sys.stderr)
      a = new + a[len(old):]
    out.append(a)
  return out


def config_error_text(e: ConfigError) -> str:
  """One line `jaxrl: config.<key>: ...` for one problem; a header and a line per problem for
  several."""
  if len(e.problems) == 1:
    return f"jaxrl: {e.problems[0]}"
  return f"jaxrl: invalid config\n{e}"


def os_error_text(e: OSError) -> str:
  """"<path>: <reason>" (and the second path of a rename); the bare message when there is none
  (e.g. a FileNotFoundError raised with a sentence)."""
  if e.strerror and e.filename is not None:
    paths = os.fspath(e.filename) + (f" -> {os.fspath(e.filename2)}" if e.filename2 else "")
    return f"{paths}: {e.strerror}"
  return str(e) or type(e).__name__


def user_message(e: BaseException) -> str | None:
  """The `jaxrl: ...` text of a config error, a `UserError`, a file error or a missing optional
  module (naming its extra); None otherwise."""
  if isinstance(e, ConfigError):
    return config_error_text(e)
  if isinstance(e, UserError):
    return f"jaxrl: {e}"
  if isinstance(e, USER_OS_ERRORS):
    return f"jaxrl: {os_error_text(e)}"
  if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in EXTRA_OF:
    extra = EXTRA_OF[e.name.split(".")[0]]
    return f"jaxrl: {e.name} is not installed (the {extra} extra): pip install -e \".[{extra}]\""
  return None
