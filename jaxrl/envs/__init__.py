"""Built-in tasks with verifiable rewards, and the environment layer behind multi-turn rollouts.

`TASKS` / `AdditionTask` / `Problem` are the trainer's single-turn task interface. The
environment layer: `Task` rows (from a source, `jaxrl.data.sources`) are graded by an
`Environment` looked up by name (`make_env`), one batched `step` per environment per turn
(`call_step`). Built-in environments, each with its source in `SOURCES`:

  add        single turn  n-digit addition, exact match
  countdown  single turn  reach a target with + - * / over given numbers (safe parser)
  math       single turn  GSM8K-style final-answer check (exact, or math-verify if installed)
  guess      multi-turn   find a secret number from higher/lower hints
"""

from jaxrl.envs.arithmetic import AddEnvironment, AddSource, AdditionTask, Problem
from jaxrl.envs.base import (AsyncEnvironment, Environment, StepResult, Task, Turn, call_step,
                             single_turn_result)
from jaxrl.envs.countdown import CountdownEnvironment, CountdownSource
from jaxrl.envs.guess import GuessEnvironment, GuessSource
from jaxrl.envs.mathqa import MathEnvironment, MathSource
from jaxrl.envs.registry import ENVIRONMENTS, make_env, register

TASKS = {"add": AdditionTask}

# name -> callable building that environment's source (keyword arguments only).
SOURCES = {
    "add": AddSource,
    "countdown": CountdownSource,
    "math": MathSource.from_jsonl,
    "guess": GuessSource,
}


def make_source(name: str, **kwargs):
  """The built-in source for environment `name`; unknown name -> KeyError listing known ones."""
  try:
    factory = SOURCES[name]
  except KeyError:
    raise KeyError(f"unknown source {name!r}; known: {sorted(SOURCES)}") from None
  return factory(**kwargs)


__all__ = [
    "AddEnvironment", "AddSource", "AdditionTask", "AsyncEnvironment", "CountdownEnvironment",
    "CountdownSource", "ENVIRONMENTS", "Environment", "GuessEnvironment", "GuessSource",
    "MathEnvironment", "MathSource", "Problem", "SOURCES", "StepResult", "TASKS", "Task", "Turn",
    "call_step", "make_env", "make_source", "register", "single_turn_result",
]
