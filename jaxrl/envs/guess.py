"""`guess`: find a secret integer in [1, high] from "higher"/"lower" hints (multi-turn).

Task data: {"secret": int, "high": int}. Each turn the first integer in the response (an
optional "-" then ASCII digits) is the guess. The observation is "higher" (the secret is larger),
"lower", "no number" when the response has none (or one of over 100 digits), or "too long" when
the turn was truncated - a truncated turn counts as a wrong guess whatever its text, since its
text is cut. A correct guess ends the episode (done: terminated) with reward 1.0 on that turn;
otherwise the reward is 0 and the hint is the next observation. The environment never ends an
episode for running out of turns: the rollout loop stops it after `max_turns` model turns and
counts it as truncated, so "terminated" always means the secret was found.

Stateless: the verdict depends only on the row and this turn's text, so rows at different turns
are graded in one call. Components: "correct" (1 on the turn that found the secret).
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from jaxrl.data.sources import SplitSource, alphabet_of
from jaxrl.envs.base import StepResult, Task, Turn
from jaxrl.envs.registry import register

_INT = re.compile(r"-?\d+")
MAX_DIGITS = 100
OBSERVATIONS = ("higher", "lower", "no number", "too long")


def first_int(text: str) -> int | None:
  m = _INT.search(text)
  if m is None or len(m.group(0).lstrip("-")) > MAX_DIGITS:
    return None
  return int(m.group(0))


@register("guess", source=lambda cfg: GuessSource(seed=cfg.seed))
class GuessEnvironment:
  """Multi-turn; see the module docstring."""
  name = "guess"

  def __init__(self, max_turns: int = 4):
    if max_turns < 1:
      raise ValueError(f"guess: max_turns must be >= 1, got {max_turns}")
    self.max_turns = max_turns

  def step(self, turns: Sequence[Turn]) -> StepResult:
    n = len(turns)
    obs, rewards, done, meta = [], np.zeros(n, np.float32), np.zeros(n, bool), []
    for i, t in enumerate(turns):
      secret = int(t.task.data["secret"])
      guess = first_int(t.response)
      meta.append({"guess": guess})
      if t.truncated:
        hint = "too long"
      elif guess is None:
        hint = "no number"
      elif guess == secret:
        rewards[i], done[i], hint = 1.0, True, ""
      else:
        hint = "higher" if secret > guess else "lower"
      obs.append("" if done[i] else hint)
    return StepResult(obs, rewards, done, {"correct": rewards.copy()}, meta)


class GuessSource(SplitSource):
  """Secrets 1..high split by a seeded permutation: `val_fraction` of the values (at least one)
  are val secrets, the rest train secrets, each once per split - disjoint, so validation
  measures search on secrets never rewarded in training.
  """

  template = "Guess a number from 1 to {high}."

  def __init__(self, seed: int = 0, high: int = 100, val_fraction: float = 0.2,
               name: str = "guess"):
    if high < 2:
      raise ValueError(f"guess: high must be >= 2 (one val and one train secret), got {high}")
    if not 0 < val_fraction < 1:
      raise ValueError(f"guess: val_fraction must be in (0, 1), got {val_fraction}")
    self.name = name
    self.high = high
    secrets = np.random.default_rng(seed).permutation(np.arange(1, high + 1))
    n_val = min(high - 1, max(1, int(high * val_fraction)))
    self._splits = {"val": self._rows("val", secrets[:n_val]),
                    "train": self._rows("train", secrets[n_val:])}
    self.alphabet = alphabet_of([self.template.format(high=high), *OBSERVATIONS],
                                base="0123456789- \n")

  def _rows(self, split: str, secrets: np.ndarray) -> list[Task]:
    prompt = self.template.format(high=self.high)
    return [Task(env="guess", prompt=prompt, data={"secret": int(s), "high": self.high},
                 uid=f"{self.name}/{split}/{i}") for i, s in enumerate(secrets)]
