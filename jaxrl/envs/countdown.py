"""`countdown`: combine the given numbers with + - * / to hit the target (single turn).

Task data: {"numbers": [int, ...], "target": int, "solution": str}. The answer is the response's
last non-empty line, stripped, with an optional trailing "= <number>" dropped (the stated
number is not checked: the expression's exact value is). The line is parsed by the safe parser in
`jaxrl.envs.expr` (integers, + - * /, unary minus, parentheses, exact fractions), never executed.

Correct means: it parses, uses every given number exactly once (as a multiset: a number given
twice must be used twice), its exact value equals the target (intermediate fractions allowed:
(8/4)*3 makes 6) and the turn ended by EOS. Reward = correct (0/1). Components: "format" (1 when
the line parses, whatever its value) and "correct". Any bad answer - malformed, division by zero,
too long, too deeply nested, a number not given - scores 0; grading never raises.

`CountdownSource` generates solvable puzzles from a seed: numbers are drawn, a random expression
over all of them gives the target, so every row has a known solution (kept in `data`).
"""

from __future__ import annotations

import collections
import random
import re
from fractions import Fraction
from typing import Sequence


from jaxrl.data.sources import SplitSource, alphabet_of
from jaxrl.envs import expr
from jaxrl.envs.base import StepResult, Task, Turn, single_turn_result
from jaxrl.envs.registry import register

_STATED_RESULT = re.compile(r"=\s*-?\d+(?:\.\d+)?\s*$")
_OPS = "+-*/"


def answer_line(response: str) -> str:
  """The last non-empty line, stripped, without a trailing "= <number>"."""
  lines = [ln.strip() for ln in response.splitlines() if ln.strip()]
  if not lines:
    return ""
  return _STATED_RESULT.sub("", lines[-1]).strip()


def grade(response: str, numbers: Sequence[int], target: int, max_len: int = expr.MAX_LEN,
          max_depth: int = expr.MAX_DEPTH) -> tuple[bool, bool, str | None]:
  """(parses, correct, reason it is not correct or None) for one response; never raises."""
  line = answer_line(response)
  try:
    ev = expr.evaluate(line, max_len=max_len, max_depth=max_depth)
  except expr.ExprError as e:
    return False, False, str(e)
  if collections.Counter(ev.numbers) != collections.Counter(int(x) for x in numbers):
    return True, False, f"uses {sorted(ev.numbers)}, given {sorted(numbers)}"
  if ev.value != target:
    return True, False, f"value {ev.value} != target {target}"
  return True, True, None


@register("countdown",
          source=lambda cfg: CountdownSource(seed=cfg.seed, val_size=cfg.task.val_size))
class CountdownEnvironment:
  """Single turn; see the module docstring for the rules."""
  name = "countdown"
  max_turns = 1

  def __init__(self, max_len: int = expr.MAX_LEN, max_depth: int = expr.MAX_DEPTH):
    self.max_len = max_len
    self.max_depth = max_depth

  def step(self, turns: Sequence[Turn]) -> StepResult:
    fmt, correct, meta = [], [], []
    for t in turns:
      ok, right, reason = grade(t.response, t.task.data["numbers"], t.task.data["target"],
                                self.max_len, self.max_depth)
      if right and t.truncated:
        right, reason = False, "truncated"
      fmt.append(float(ok))
      correct.append(float(right))
      meta.append({"error": reason})
    return single_turn_result(correct, {"format": fmt, "correct": correct}, meta)


class CountdownSource(SplitSource):
  """Seeded solvable puzzles: `val_size` val rows, then `train_size` train rows, disjoint.

  A puzzle is min_numbers..max_numbers numbers in 1..max_number; repeatedly two random
  sub-expressions are joined by a random operator until one expression uses them all, and a
  puzzle is kept when that value is an integer in 1..max_target and its (numbers as a multiset,
  target) was not produced before - so no puzzle is in both splits (or twice in one). Val is
  generated first: changing `train_size` never changes val. Draws use `random.Random(seed)`,
  whose integer seeding and draws are stable across Python versions.
  """

  template = "Use {numbers} to make {target}."

  def __init__(self, seed: int = 0, train_size: int = 10000, val_size: int = 500,
               min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20,
               max_target: int = 1000, name: str = "countdown"):
    if not 2 <= min_numbers <= max_numbers:
      raise ValueError(f"countdown needs 2 <= min_numbers <= max_numbers, got "
                       f"{min_numbers}, {max_numbers}")
    if max_number < 1 or max_target < 1 or train_size < 1 or val_size < 0:
      raise ValueError("countdown: max_number, max_target and train_size must be >= 1, "
                       "val_size >= 0")
    self.name = name
    rng = random.Random(seed)  # per-draw numpy calls would make generation 10x slower
    seen: set[tuple[tuple[int, ...], int]] = set()
    puzzles = []
    attempts = 0
    limit = 100 * (train_size + val_size)
    while len(puzzles) < train_size + val_size:
      attempts += 1
      if attempts > limit:
        raise ValueError(f"countdown: could not find {train_size + val_size} distinct puzzles "
                         f"with these settings (found {len(puzzles)})")
      p = _random_puzzle(rng, min_numbers, max_numbers, max_number, max_target)
      if p is None:
        continue
      key = (tuple(sorted(p[0])), p[1])
      if key not in seen:
        seen.add(key)
        puzzles.append(p)
    self._splits = {"val": self._rows("val", puzzles[:val_size]),
                    "train": self._rows("train", puzzles[val_size:])}
    self.alphabet = alphabet_of((t.prompt for rows in self._splits.values() for t in rows),
                                base="0123456789+-*/()= \n")

  def _rows(self, split: str, puzzles) -> list[Task]:
    return [Task(env="countdown",
                 prompt=self.template.format(numbers=" ".join(map(str, nums)), target=target),
                 data={"numbers": list(nums), "target": target, "solution": solution},
                 uid=f"{self.name}/{split}/{i}")
            for i, (nums, target, solution) in enumerate(puzzles)]


def _random_puzzle(rng: random.Random, lo: int, hi: int, max_number: int,
                   max_target: int) -> tuple[list[int], int, str] | None:
  k = rng.randint(lo, hi)
  numbers = [rng.randint(1, max_number) for _ in range(k)]
  parts: list[tuple[str, Fraction]] = [(str(x), Fraction(x)) for x in numbers]
  while len(parts) > 1:
    i, j = rng.sample(range(len(parts)), 2)
    (a, va), (b, vb) = parts[i], parts[j]
    op = rng.choice(_OPS)
    if op == "+":
      value = va + vb
    elif op == "-":
      value = va - vb
    elif op == "*":
      value = va * vb
    elif vb == 0:
      return None
    else:
      value = va / vb
    parts = [p for m, p in enumerate(parts) if m not in (i, j)] + [(f"({a} {op} {b})", value)]
  text, value = parts[0]
  if value.denominator != 1 or not 1 <= value <= max_target:
    return None
  return numbers, int(value), text[1:-1]
