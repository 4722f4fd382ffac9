"""Tasks by name: the environment that grades a task's rows, the source that serves them, and
what the task needs from a run's config. One `@register` in the task's own module is all it takes.

    @register("reverse", source=lambda cfg: ReverseSource(seed=cfg.seed))
    class ReverseEnvironment:
      max_turns = 1
      def step(self, turns): ...

`config.task.name` accepts every registered task (several joined by "+" mix per row), so a recipe
file can register its own task before the run validates its config: `python -m jaxrl.train
--config my_recipe.py` (README, "Your own task"). The registry imports no jax: config validation
asks it.

A family of tasks named `<prefix>:<name>` (e.g. `reasoning_gym:leg_counting`) registers one
resolver (`register_family`) instead of every name: a name of the family is registered when first
used (`resolve`, called by config validation, `make_env` and `make_source`).

A separate module (not `jaxrl/envs/__init__.py`) so environment modules register themselves at
import without importing the package that imports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.data.sources import check_source, source_problems

# name -> environment class (also reachable as `TASKS[name].env`).
ENVIRONMENTS: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class Registration:
  """One task.

  env: the environment class (`jaxrl.envs.base.Environment`), built by `make_env(name)`.
  source: `source(cfg) -> TaskSource` builds the task's rows from a run config (it reads
    `cfg.seed` and whichever `cfg.task.*` keys it wants). None: the environment grades rows that
    come from elsewhere (it cannot be a run's `task.name`).
  checks: `checks(values) -> [problem, ...]`, what the task needs from the config, run by
    `jaxrl.config.validate` before anything is built. `values` maps flat keys ("task.path",
    "rollout.max_new_tokens") to the config's values that passed their own checks (a key is absent
    when its value is bad); each problem is one line starting with the full key ("config.x.y:").
  demonstrations: the source has a `task` with `demonstration(problem)`, `sample(rng, n)` and a
    `dev` split, so the supervised warm-up (`sft.*`) can run on it.
  """
  name: str
  env: type
  source: Callable[[Any], Any] | None = None
  checks: Callable[[Mapping[str, Any]], list[str]] | None = None
  demonstrations: bool = False


TASKS: dict[str, Registration] = {}


def register(name: str, *, source: Callable[[Any], Any] | None = None,
             checks: Callable[[Mapping[str, Any]], list[str]] | None = None,
             demonstrations: bool = False) -> Callable[[type], type]:
  """Class decorator registering an environment class as task `name` (see `Registration`).

  Sets the class's `name` so a row's `Task.env` and the environment agree. Registering another
  class under a taken name is an error: silently replacing a grader would change rewards. The
  same class again (a module imported twice, a recipe file loaded twice) replaces the entry.
  """
  if not isinstance(name, str) or not name or "+" in name:
    raise ValueError(f"a task name is a non-empty string without '+', got {name!r}")
  if isinstance(source, type):  # a class: its methods can be checked now, the rest when built
    missing = source_problems(source, methods_only=True)
    if missing:
      raise ValueError(f"task {name!r}: source {source.__name__} has no {', '.join(missing)} "
                       "(jaxrl.data.sources.TaskSource)")

  def deco(cls: type) -> type:
    old = TASKS.get(name)
    if old is not None and old.env.__qualname__ != cls.__qualname__:
      raise ValueError(f"task {name!r} is already registered to {old.env.__qualname__}")
    cls.name = name
    ENVIRONMENTS[name] = cls
    TASKS[name] = Registration(name, cls, source, checks, demonstrations)
    return cls
  return deco


@dataclasses.dataclass(frozen=True)
class Family:
  """Tasks named `<prefix>:<rest>`, registered on first use.

  resolve: `resolve(name) -> problem | None` registers task `name` (with `register`) and returns
    None, or returns why it cannot (one line, without the config key: the caller adds it).
  pattern: how a name of the family looks, for messages (e.g. "reasoning_gym:<dataset>").
  """
  prefix: str
  resolve: Callable[[str], str | None]
  pattern: str


FAMILIES: dict[str, Family] = {}


def register_family(prefix: str, resolve: Callable[[str], str | None], pattern: str) -> None:
  """Registers the family of task names `<prefix>:<rest>` (see `Family`)."""
  if not prefix or ":" in prefix or "+" in prefix:
    raise ValueError(f"a family prefix is a non-empty string without ':' or '+', got {prefix!r}")
  FAMILIES[prefix] = Family(prefix, resolve, pattern)


def resolve(name: str) -> str | None:
  """Registers task `name` if it belongs to a family and is not registered yet. None: nothing to
  do (registered already, or no family's name: the caller reports unknown names); else the
  family's problem with the name."""
  if name in TASKS or ":" not in name:
    return None
  family = FAMILIES.get(name.split(":", 1)[0])
  return None if family is None else family.resolve(name)


def _resolved(name: str) -> None:
  problem = resolve(name)
  if problem is not None:
    raise KeyError(problem)


def in_family(name: str) -> bool:
  """Whether `name` is `<prefix>:<rest>` of a registered family."""
  return ":" in name and name.split(":", 1)[0] in FAMILIES


def task_names() -> tuple[str, ...]:
  """Names a run's `task.name` may use: the registered tasks that have a source. A family's
  names are not listed (they are as many as the family says; see `FAMILIES`), even once
  registered, so the list does not depend on what a process has resolved."""
  return tuple(sorted(n for n, r in TASKS.items() if r.source is not None and not in_family(n)))


def make_env(name: str, **kwargs: Any):
  """A new environment instance; an unknown name is a KeyError listing the known ones."""
  _resolved(name)
  try:
    cls = ENVIRONMENTS[name]
  except KeyError:
    raise KeyError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}") from None
  return cls(**kwargs)


def make_source(name: str, cfg: Any):
  """The rows of task `name` for run config `cfg` (its registered `source`), checked against
  `jaxrl.data.sources.TaskSource` (`TaskSourceError` names what it lacks)."""
  _resolved(name)
  reg = TASKS.get(name)
  if reg is None or reg.source is None:
    raise KeyError(f"unknown task {name!r}; registered: {list(task_names())}")
  source = reg.source(cfg)
  check_source(name, source)  # one line naming what is missing, not an AttributeError later
  return source


def task_problems(names: list[str], values: Mapping[str, Any]) -> list[str]:
  """Every registered task's `checks` for the tasks `names` (unknown names are skipped: the
  caller reports them)."""
  problems: list[str] = []
  for name in names:
    reg = TASKS.get(name)
    if reg is not None and reg.checks is not None:
      problems.extend(reg.checks(values))
  return problems
