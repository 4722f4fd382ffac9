"""`add`: n-digit addition with an exact-match reward.

Prompt `"07+35="`, answer `"42"` then EOS. Operands are zero-padded to `num_digits`, so every
prompt has the same length. All (a, b) pairs are permuted once with the task seed and cut into
`val` (held out, reported), `dev` (used only by the warm-up stopping rule) and `train`.

`AdditionTask` is the trainer's single-turn task; `AddSource` and `AddEnvironment` serve the same
problems as `Task` rows through the environment protocol (`jaxrl.envs.base`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxrl.data.sources import unknown_split
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs.base import StepResult, Task, Turn, single_turn_result
from jaxrl.envs.registry import register


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str
  answer: str


class AdditionTask:
  name = "add"

  def __init__(self, num_digits: int = 2, seed: int = 0, dev_size: int = 1000,
               val_size: int = 1000):
    self.num_digits = num_digits
    self.tokenizer = CharTokenizer("0123456789+=")
    n = 10 ** num_digits
    if dev_size + val_size >= n * n:
      raise ValueError(f"task.dev_size + task.val_size = {dev_size + val_size} leaves no "
                       f"training problems out of {n * n}")
    pairs = np.random.default_rng(seed).permutation(n * n)
    self._splits = {
        "val": pairs[:val_size],
        "dev": pairs[val_size:val_size + dev_size],
        "train": pairs[val_size + dev_size:],
    }
    self._n = n

  @property
  def max_answer_tokens(self) -> int:
    return self.num_digits + 2  # up to num_digits + 1 digits, then EOS

  def problem(self, index: int) -> Problem:
    a, b = divmod(int(index), self._n)
    w = self.num_digits
    return Problem(f"{a:0{w}d}+{b:0{w}d}=", str(a + b))

  def split(self, name: str) -> list[Problem]:
    return [self.problem(i) for i in self._splits[name]]

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """n training problems drawn with replacement (deterministic given rng)."""
    return [self.problem(i) for i in rng.choice(self._splits["train"], size=n)]

  def rewards(self, problems: Sequence[Problem], completions: np.ndarray,
              mask: np.ndarray) -> np.ndarray:
    """1.0 iff the completion is exactly the answer followed by EOS, else 0.0.

    completions/mask: [B, N] from the sampler; a completion cut off by the budget has no EOS
    and scores 0.
    """
    eos = self.tokenizer.eos_id
    out = np.zeros(len(problems), np.float32)
    for i, p in enumerate(problems):
      ids = completions[i][mask[i]]
      if len(ids) and ids[-1] == eos and self.tokenizer.decode(ids) == p.answer:
        out[i] = 1.0
    return out

  def demonstration(self, p: Problem) -> list[int]:
    """Completion tokens for supervised warm-up: the answer then EOS."""
    return self.tokenizer.encode(p.answer) + [self.tokenizer.eos_id]


class AddSource:
  """`add` problems as `Task` rows: the splits of `AdditionTask` (same seed, same split)."""

  def __init__(self, num_digits: int = 2, seed: int = 0, dev_size: int = 1000,
               val_size: int = 1000, name: str = "add"):
    self.task = AdditionTask(num_digits=num_digits, seed=seed, dev_size=dev_size,
                             val_size=val_size)
    self.name = name
    self.alphabet = self.task.tokenizer.alphabet

  def _row(self, split: str, i: int) -> Task:
    p = self.task.problem(self.task._splits[split][i])
    return Task(env="add", prompt=p.prompt, data={"answer": p.answer},
                uid=f"{self.name}/{split}/{i}")

  def split(self, name: str) -> list[Task]:
    if name not in self.task._splits:
      raise unknown_split(self.name, name, list(self.task._splits))
    return [self._row(name, i) for i in range(len(self.task._splits[name]))]

  def sample(self, rng: np.random.Generator, n: int) -> list[Task]:
    """n training rows drawn with replacement (deterministic given rng)."""
    idx = rng.integers(len(self.task._splits["train"]), size=n)
    return [self._row("train", int(i)) for i in idx]


def add_lengths(num_digits: int) -> tuple[int, int, int]:
  """Task 'add' with n-digit operands: (prompt tokens, answer tokens, number of problems), known
  without building the task (which permutes all of its problems): prompt "07+35=", answer up to
  n + 1 digits then EOS, every operand pair one problem."""
  return 2 * num_digits + 2, num_digits + 2, 100 ** num_digits


def add_checks(values) -> list[str]:
  """What task 'add' needs from a run config (`jaxrl.envs.registry.Registration.checks`)."""
  if "task.num_digits" not in values:
    return []
  problems, p, n = [], "config.", values["task.num_digits"]
  prompt_len, answer_len, total = add_lengths(n)
  if values.get("rollout.max_prompt_len", prompt_len) < prompt_len:
    problems.append(f"{p}rollout.max_prompt_len: task 'add' prompts have {prompt_len} tokens "
                    f"with {p}task.num_digits = {n}, got {values['rollout.max_prompt_len']}")
  if values.get("rollout.max_new_tokens", answer_len) < answer_len:
    problems.append(f"{p}rollout.max_new_tokens: task 'add' answers need up to {answer_len} "
                    f"tokens (with EOS) with {p}task.num_digits = {n}, got "
                    f"{values['rollout.max_new_tokens']}")
  if "task.dev_size" in values and "task.val_size" in values and \
      values["task.dev_size"] + values["task.val_size"] >= total:
    problems.append(f"{p}task.dev_size: {p}task.dev_size + {p}task.val_size = "
                    f"{values['task.dev_size']} + {values['task.val_size']} leaves no training "
                    f"problems: task 'add' has {total} with {p}task.num_digits = {n}")
  return problems


def add_source(cfg) -> AddSource:
  """Task 'add' of a run config: `task.num_digits`, `task.dev_size`, `task.val_size`, `seed`."""
  t = cfg.task
  return AddSource(num_digits=t.num_digits, seed=cfg.seed, dev_size=t.dev_size,
                   val_size=t.val_size)


@register("add", source=add_source, checks=add_checks, demonstrations=True)
class AddEnvironment:
  """Single turn: reward 1.0 iff the stripped response is the answer and the turn ended by EOS.

  Same rule as `AdditionTask.rewards`, on decoded text: a response cut off by the token budget
  scores 0 even if its text happens to be right.
  """
  name = "add"
  max_turns = 1

  def step(self, turns: Sequence[Turn]) -> StepResult:
    correct = [float(not t.truncated and t.response.strip() == t.task.data["answer"])
               for t in turns]
    return single_turn_result(correct, {"correct": correct})
