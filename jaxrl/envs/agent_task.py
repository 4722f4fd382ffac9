"""Task names `agent:<module>:<function>`: a user's async agent function as a task.

The family (`jaxrl.envs.registry.register_family`) registers such a name when config validation
first meets it, once `<module>.<function>` imports and is an async function. Its rows are those
of the built-in task `agent.task` (default `add`), relabelled with the agent's name; the reward
is what the function returns. The episodes themselves are played by `jaxrl.serving.agents
.AgentLoop` (the run's multi-turn loop for this task), not by an environment's `step`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
from typing import Callable

from jaxrl.envs.registry import make_source, register, register_family

PREFIX = "agent:"


def is_agent(name: str) -> bool:
  return name.startswith(PREFIX)


def load_agent(name: str) -> Callable:
  """The async function `agent:<module>:<function>` names; ValueError naming what is wrong."""
  if not is_agent(name) or name.count(":") != 2:
    raise ValueError(f"task {name!r}: an agent task is named agent:<module>:<function>")
  _, module, function = name.split(":")
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"task {name!r}: cannot import module {module!r}: {e}") from None
  fn = getattr(mod, function, None)
  if fn is None or not asyncio.iscoroutinefunction(fn):
    raise ValueError(f"task {name!r}: {module}.{function} is not an async function")
  return fn


class AgentSource:
  """The rows of another task's source, relabelled as task `name`."""

  def __init__(self, inner, name: str):
    self.inner, self.name, self.alphabet = inner, name, inner.alphabet
    # The inner task's warm-up task (demonstrations), if it has one: the supervised warm-up
    # trains the same prompts the agent sends.
    self.task = getattr(inner, "task", None)

  def _mine(self, rows):
    return [dataclasses.replace(t, env=self.name) for t in rows]

  def split(self, name: str):
    return self._mine(self.inner.split(name))

  def sample(self, rng, n: int):
    return self._mine(self.inner.sample(rng, n))


class AgentEnvironment:
  """Stands for an agent task in the run's environments; its episodes are played by the agent
  loop, so `step` is never called."""

  max_turns = 1 << 20

  def step(self, turns):
    raise RuntimeError(f"task {self.name!r} is an agent: its episodes are played by "
                       f"jaxrl.serving.agents.AgentLoop, not by an environment's step")


def _source(name: str):
  def make(cfg):
    inner = cfg.agent.task
    if is_agent(inner):
      raise ValueError(f"config.agent.task={inner!r} must name a task with rows, not an agent")
    source = AgentSource(make_source(inner, cfg), name)
    if cfg.sft.enabled and source.task is None:
      raise ValueError(f"config.sft.enabled: the agent's rows (config.agent.task={inner!r}) have "
                       f"no demonstrations for the supervised warm-up; set it to false")
    return source
  return make


def _resolve(name: str) -> str | None:
  try:
    load_agent(name)
  except ValueError as e:
    return str(e)
  # Demonstrations: those of agent.task's rows, when it has them (checked by the source).
  register(name, source=_source(name), demonstrations=True)(
      type("Agent", (AgentEnvironment,), {}))
  return None


register_family(PREFIX[:-1], _resolve, f"{PREFIX}<module>:<function>")
