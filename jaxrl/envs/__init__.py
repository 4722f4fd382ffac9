"""Built-in tasks with verifiable rewards."""

from jaxrl.envs.arithmetic import AdditionTask, Problem

TASKS = {"add": AdditionTask}

__all__ = ["AdditionTask", "Problem", "TASKS"]
