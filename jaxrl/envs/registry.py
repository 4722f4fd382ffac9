"""Name -> environment class, so configs and task rows can name an environment by a string.

A separate module (not `jaxrl/envs/__init__.py`) so environment modules can register themselves
at import without importing the package that imports them.
"""

from __future__ import annotations

from typing import Any, Callable

ENVIRONMENTS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
  """Class decorator: `@register("countdown")` makes `make_env("countdown")` build the class.

  Sets the class's `name` so a row's `Task.env` and the environment agree. Registering another
  class under a taken name is an error: silently replacing a grader would change rewards.
  """
  def deco(cls: type) -> type:
    old = ENVIRONMENTS.get(name)
    if old is not None and old is not cls:
      raise ValueError(f"environment {name!r} is already registered to {old.__qualname__}")
    cls.name = name
    ENVIRONMENTS[name] = cls
    return cls
  return deco


def make_env(name: str, **kwargs: Any):
  """A new environment instance; an unknown name is a KeyError listing the known ones."""
  try:
    cls = ENVIRONMENTS[name]
  except KeyError:
    raise KeyError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}") from None
  return cls(**kwargs)
