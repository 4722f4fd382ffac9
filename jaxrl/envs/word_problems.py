"""`word_math`: one-step arithmetic word problems for a real instruct model (single turn).

"Mia has 34 stickers and gets 27 more. How many stickers does Mia have now?" A problem is a
template (a sum or a difference, with its own names and objects) and two operands, each from 1
to `task.max_operand` (0: each of `task.num_digits` digits); a difference never goes below
zero. Replies are free text, graded by
the `math` environment's extractor and equivalence (`jaxrl.envs.mathqa`): the last closed
`\\boxed{}`, else the number after the last "####" or "answer is", else the last number of the
reply. `task.instruction` is appended to each question on a new line.

Splits are disjoint in the arithmetic itself, not only in wording: every (operation, a, b) is
one problem, the problems are permuted once with the seed, the first `task.val_size` are `val`
(held out), the next `task.dev_size` are `dev`, and the rest are `train`; each problem's
template comes from a hash of the problem, so it is the same in every run.
"""

from __future__ import annotations

import zlib

import numpy as np

from jaxrl.data.sources import SplitSource, alphabet_of
from jaxrl.envs.base import Task
from jaxrl.envs.mathqa import MathEnvironment
from jaxrl.envs.registry import register

# (operation, template): {a} and {b} are the operands, {n} a name.
TEMPLATES = (
  ("+", "{n} has {a} stickers and gets {b} more. How many stickers does {n} have now?"),
  ("+", "A shop sold {a} apples in the morning and {b} apples in the afternoon. How many apples "
        "did it sell in all?"),
  ("+", "{n} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {n} read?"),
  ("+", "There are {a} red marbles and {b} blue marbles in a jar. How many marbles are in the "
        "jar?"),
  ("-", "{n} had {a} coins and spent {b} of them. How many coins does {n} have left?"),
  ("-", "A bus had {a} passengers. At the next stop {b} got off. How many passengers are still "
        "on the bus?"),
  ("-", "A baker made {a} muffins and sold {b}. How many muffins are left?"),
  ("-", "{n} needs {a} points to win and has {b} points. How many more points does {n} need?"),
)
NAMES = ("Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Ivy", "Sam")
INSTRUCTION = "Give the final answer as a number at the end."


class WordProblemSource(SplitSource):
  """The splits of the module docstring for `num_digits`-digit operands."""

  def __init__(self, num_digits: int = 2, seed: int = 0, dev_size: int = 200,
               val_size: int = 200, instruction: str = INSTRUCTION, name: str = "word_math",
               max_operand: int = 0):
    self.name = name
    self.instruction = instruction
    lo, hi = operand_range(num_digits, max_operand)
    problems = [(op, a, b) for op in "+-" for a in range(lo, hi) for b in range(lo, hi)
                if op == "+" or a >= b]
    order = np.random.default_rng(seed).permutation(len(problems))
    cuts = {"val": (0, val_size), "dev": (val_size, val_size + dev_size),
            "train": (val_size + dev_size, len(problems))}
    self._splits = {split: [self._task(split, i, problems[j])
                            for i, j in enumerate(order[start:stop])]
                    for split, (start, stop) in cuts.items()}
    self.alphabet = alphabet_of([t.prompt for rows in self._splits.values() for t in rows],
                                base="0123456789 .,-+=\nThe answer is")

  def _task(self, split: str, i: int, problem: tuple[str, int, int]) -> Task:
    op, a, b = problem
    h = zlib.crc32(f"{op}{a},{b}".encode())
    templates = [t for o, t in TEMPLATES if o == op]
    question = templates[h % len(templates)].format(a=a, b=b, n=NAMES[(h >> 8) % len(NAMES)])
    prompt = f"{question}\n{self.instruction}" if self.instruction else question
    answer = a + b if op == "+" else a - b
    return Task(env="word_math", prompt=prompt, data={"answer": str(answer)},
                uid=f"{self.name}/{split}/{i}")


def operand_range(num_digits: int, max_operand: int = 0) -> tuple[int, int]:
  """[lo, hi) of each operand: 1 .. max_operand, else the num_digits-digit numbers."""
  if max_operand:
    return 1, max_operand + 1
  return (10 ** (num_digits - 1) if num_digits > 1 else 0), 10 ** num_digits


def word_checks(values) -> list[str]:
  """What task 'word_math' needs from a run config."""
  p, n = "config.", values.get("task.num_digits")
  if n is None or not 1 <= n <= 3:
    return [f"{p}task.num_digits: task 'word_math' takes 1 to 3 digits, got {n}"] \
        if n is not None else []
  lo, hi = operand_range(n, values.get("task.max_operand", 0))
  span = hi - lo
  total = span * span + span * (span + 1) // 2
  if values.get("task.dev_size", 0) + values.get("task.val_size", 0) >= total:
    return [f"{p}task.dev_size: {p}task.dev_size + {p}task.val_size leaves no training problems: "
            f"task 'word_math' has {total} with {p}task.num_digits = {n}"]
  return []


def word_source(cfg) -> WordProblemSource:
  """Task 'word_math' of a run config: `task.num_digits`, `task.max_operand`,
  `task.dev_size`, `task.val_size`, `task.instruction` (empty: `INSTRUCTION`), `seed`."""
  t = cfg.task
  return WordProblemSource(num_digits=t.num_digits, seed=cfg.seed, dev_size=t.dev_size,
                           val_size=t.val_size, instruction=t.instruction or INSTRUCTION,
                           max_operand=t.max_operand)


@register("word_math", source=word_source, checks=word_checks)
class WordMathEnvironment(MathEnvironment):
  """The `math` grading (see `jaxrl.envs.mathqa`) of `word_math` rows."""
  name = "word_math"
