"""Built-in tasks with verifiable rewards, and the environment layer behind multi-turn rollouts.

Tasks register once, in their own module (`register`, `jaxrl.envs.registry`): the environment
that grades `Task` rows (`make_env`, one batched `step` per environment per turn, `call_step`),
the source that serves them from a run config (`make_source`) and what they need from the config
(checked by `jaxrl.config.validate`). `AdditionTask` / `Problem` are the warm-up's single-turn
task with demonstrations. Built in:

  add        single turn  n-digit addition, exact match
  countdown  single turn  reach a target with + - * / over given numbers (safe parser)
  math       single turn  GSM8K-style final-answer check (exact, or math-verify if installed)
  guess      multi-turn   find a secret number from higher/lower hints
  reasoning_gym:<dataset>  single turn  a reasoning-gym dataset, graded by its own scorer
             (optional: `pip install -e ".[reasoning-gym]"`; registered when first named)
  agent:<module>:<function>  multi-turn  a user's async agent function with an OpenAI client
             (the serve extra; jaxrl.envs.agent_task, jaxrl.serving.agents)
"""

from jaxrl.envs.arithmetic import AddEnvironment, AddSource, AdditionTask, Problem
from jaxrl.envs.base import (AsyncEnvironment, Environment, StepResult, Task, Turn, call_step,
                             single_turn_result)
from jaxrl.envs.countdown import CountdownEnvironment, CountdownSource
from jaxrl.envs.guess import GuessEnvironment, GuessSource
from jaxrl.envs.mathqa import MathEnvironment, MathSource
from jaxrl.envs.word_problems import WordMathEnvironment, WordProblemSource
# Registers the `reasoning_gym:` family; reasoning-gym itself is imported only when one is named.
from jaxrl.envs import reasoning_gym as _reasoning_gym  # noqa: F401
# Registers the `agent:` family (task.name=agent:<module>:<function>).
from jaxrl.envs import agent_task as _agent_task  # noqa: F401
from jaxrl.envs.registry import (ENVIRONMENTS, TASKS, Registration, make_env, make_source,
                                 register, task_names)

__all__ = [
    "AddEnvironment", "AddSource", "AdditionTask", "AsyncEnvironment", "CountdownEnvironment",
    "CountdownSource", "ENVIRONMENTS", "Environment", "GuessEnvironment",
    "GuessSource", "MathEnvironment", "MathSource", "Problem", "Registration", "StepResult",
    "TASKS", "Task", "Turn", "call_step", "make_env", "make_source", "register",
    "WordMathEnvironment", "WordProblemSource", "single_turn_result", "task_names",
]
