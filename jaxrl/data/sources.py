"""Task sources: where the rows (`jaxrl.envs.Task`) that the rollout loop prompts with come from.

A source owns fixed train/val splits and samples training rows with replacement from a numpy
Generator, so a run's prompt stream is a pure function of its seed (resume and multi-process
runs replay it exactly). Each source also states its `alphabet`, the characters its prompts,
answers and observations can contain, so a character tokenizer can be built for a tiny model
without reading the whole dataset twice.

`MixedSource` draws, per row, which source a training row comes from (by weight); every row keeps
its own `Task.env`, so one batch can hold rows of several environments and the loop routes each
to its own grader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from jaxrl.errors import UserError

if TYPE_CHECKING:  # only for annotations: environment modules import this module
  from jaxrl.envs.base import Task


@runtime_checkable
class TaskSource(Protocol):
  name: str
  alphabet: str

  def split(self, name: str) -> list[Task]:
    """All rows of split `name` ("train" or "val"), in a fixed order."""
    ...

  def sample(self, rng: np.random.Generator, n: int) -> list[Task]:
    """n training rows drawn with replacement (deterministic given rng)."""
    ...


def alphabet_of(texts: Iterable[str], base: str = "") -> str:
  """The characters of `base` then those first seen in `texts`, each once, in a stable order.

  Order matters: a character tokenizer's ids follow it, so the same data must give the same
  alphabet (sorted, not set order).
  """
  seen = dict.fromkeys(base)
  extra = set()
  for t in texts:
    extra.update(t)
  for ch in sorted(extra):
    seen.setdefault(ch, None)
  return "".join(seen)


def unknown_split(source: str, name: str, known: Sequence[str]) -> KeyError:
  return KeyError(f"source {source!r} has no split {name!r}; known: {list(known)}")


class SplitSource:
  """Base of sources that hold their rows per split in `self._splits` (name -> list of Task)."""

  name: str
  _splits: dict[str, list[Task]]

  def split(self, name: str) -> list[Task]:
    if name not in self._splits:
      raise unknown_split(self.name, name, list(self._splits))
    return list(self._splits[name])

  def sample(self, rng: np.random.Generator, n: int) -> list[Task]:
    """n training rows drawn with replacement (deterministic given rng)."""
    train = self._splits["train"]
    return [train[i] for i in rng.integers(len(train), size=n)]


class MixedSource:
  """Rows of several sources: per training row a source drawn by weight, then a row of it.

  `split(name)` is every row of every source's split, shuffled once with `seed`: a validation
  capped at its first k rows then still covers each source in proportion to its size. Weights
  only shape training draws; a zero weight keeps a source in validation but out of training.
  """

  def __init__(self, sources: Sequence[TaskSource], weights: Sequence[float] | None = None,
               seed: int = 0):
    sources = list(sources)
    if not sources:
      raise ValueError("MixedSource needs at least one source")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
      raise ValueError(f"MixedSource sources must have distinct names (uids are prefixed by "
                       f"them): {names}")
    w = np.ones(len(sources)) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (len(sources),):
      raise ValueError(f"MixedSource: {w.size} weights for {len(sources)} sources")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
      raise ValueError(f"MixedSource weights must be finite, >= 0 and not all 0: {list(w)}")
    self.sources = sources
    self.weights = w / w.sum()
    self.seed = seed
    self.name = "+".join(names)
    self.alphabet = alphabet_of((), "".join(s.alphabet for s in sources))
    self._splits: dict[str, list[Task]] = {}

  def split(self, name: str) -> list[Task]:
    if name not in self._splits:
      rows = [t for s in self.sources for t in s.split(name)]
      order = np.random.default_rng(self.seed).permutation(len(rows))
      self._splits[name] = [rows[i] for i in order]
    return list(self._splits[name])

  def sample(self, rng: np.random.Generator, n: int) -> list[Task]:
    """Per row a source index drawn by weight, then each source samples its rows in one call."""
    which = rng.choice(len(self.sources), size=n, p=self.weights)
    out: list[Task | None] = [None] * n
    for k, source in enumerate(self.sources):
      rows = np.flatnonzero(which == k)
      if rows.size:
        for i, task in zip(rows, source.sample(rng, int(rows.size))):
          out[i] = task
    return out  # type: ignore[return-value]


class BadRow(UserError, ValueError):
  """A task row that cannot be used (`data.on_bad_row = "raise"`); the message names the row."""


class CheckedSource:
  """A source whose rows are checked before use: bad ones are skipped and counted, or raise.

  `check(task) -> reason | None` names what is wrong with a row (e.g. "empty_prompt",
  "too_long", "undecodable", "unknown_task"). With `on_bad_row="skip"`, `sample` draws a
  replacement for every bad draw (from the same RNG, so the stream stays deterministic) and
  `split` leaves bad rows out; `skipped` counts them by reason. With "raise", the first bad row
  raises BadRow naming its uid, the reason and the detail. Nothing is silently truncated: a
  prompt over the budget is skipped or raises, never cut.
  """

  def __init__(self, source, check, on_bad_row: str = "skip", max_redraws: int = 1000):
    if on_bad_row not in ("skip", "raise"):
      raise ValueError(f"data.on_bad_row must be 'skip' or 'raise', got {on_bad_row!r}")
    self.source, self.check, self.on_bad_row = source, check, on_bad_row
    self.max_redraws = max_redraws
    self.name, self.alphabet = source.name, source.alphabet
    self.skipped: dict[str, int] = {}
    self._splits: dict[str, list[Task]] = {}

  def __getattr__(self, name):  # e.g. the `add` source's `task` (demonstrations)
    return getattr(self.source, name)

  def _bad(self, task: Task, where: str) -> bool:
    found = self.check(task)
    if found is None:
      return False
    reason, detail = found if isinstance(found, tuple) else (found, "")
    if self.on_bad_row == "raise":
      raise BadRow(f"{where} row {task.uid!r}: {reason}{': ' + detail if detail else ''} "
                   "(data.on_bad_row=skip skips and counts such rows)")
    self.skipped[reason] = self.skipped.get(reason, 0) + 1
    return True

  def split(self, name: str) -> list[Task]:
    if name not in self._splits:
      self._splits[name] = [t for t in self.source.split(name) if not self._bad(t, name)]
    return list(self._splits[name])

  def sample(self, rng: np.random.Generator, n: int) -> list[Task]:
    out = []
    redraws = 0
    while len(out) < n:
      for t in self.source.sample(rng, n - len(out)):
        if not self._bad(t, "train"):
          out.append(t)
        else:
          redraws += 1
      if redraws > self.max_redraws * n:
        raise BadRow(f"source {self.name!r}: over {self.max_redraws} bad rows drawn per good "
                     f"row; skipped so far: {self.skipped}")
    return out
