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

import dataclasses
from typing import Callable, Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from jaxrl.core.errors import UserError

class TaskRow(Protocol):
  """A row a source holds: `jaxrl.envs.Task` is one. This module names what it reads of a row
  rather than importing the class, since the environments' modules import this one."""

  @property
  def env(self) -> str: ...

  @property
  def prompt(self) -> str: ...

  @property
  def uid(self) -> str: ...


@runtime_checkable
class TaskSource(Protocol):
  """What a task's source (`jaxrl.envs.register(name, source=...)`) must provide; checked when
  the task's source is built (`check_source`), before the run writes anything.

  name: the task's name (messages, `MixedSource`'s name).
  alphabet: every character its prompts, answers and observations can hold (a tiny model's
    character tokenizer is built over it; "" is allowed with a Hugging Face tokenizer).
  split(name): all rows of split `name` ("train", "val"; "dev" for the warm-up), fixed order.
  sample(rng, n): `n` training rows drawn with replacement, deterministic given `rng`.
  `SplitSource` provides `split` and `sample` over `self._splits`.
  """
  name: str
  alphabet: str

  def split(self, name: str) -> list[TaskRow]:
    """All rows of split `name` ("train" or "val"), in a fixed order."""
    ...

  def sample(self, rng: np.random.Generator, n: int) -> list[TaskRow]:
    """n training rows drawn with replacement (deterministic given rng)."""
    ...


# The attributes of `TaskSource`: (name, what it must be).
SOURCE_ATTRIBUTES = (("name", "a str"), ("alphabet", "a str"), ("split", "a method"),
                     ("sample", "a method"))


class TaskSourceError(UserError, TypeError):
  """A task's source that is not a `TaskSource`: the message names the task and what is
  missing."""


def source_problems(source: object, methods_only: bool = False) -> list[str]:
  """What `source` lacks of `TaskSource`, one entry per attribute ("alphabet", "split (not a
  method)"); `methods_only` for a class, whose str attributes may be set per instance."""
  out = []
  for attr, kind in SOURCE_ATTRIBUTES:
    if methods_only and kind != "a method":
      continue
    if not hasattr(source, attr):
      out.append(attr)
    elif kind == "a str" and not isinstance(getattr(source, attr), str):
      out.append(f"{attr} (not a str)")
    elif kind == "a method" and not callable(getattr(source, attr)):
      out.append(f"{attr} (not a method)")
  return out


def check_source(task: str, source: object) -> None:
  """Raises `TaskSourceError` naming what `source`, task `task`'s source, lacks of
  `TaskSource`."""
  missing = source_problems(source)
  if missing:
    raise TaskSourceError(
        f"task {task!r}: its source {type(source).__name__} has no {', '.join(missing)}; a task "
        "source has name and alphabet (str), split(name) and sample(rng, n) "
        "(jaxrl.data.sources.TaskSource)")


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
  """Base of sources that hold their rows per split in `self._splits` (name -> list of rows)."""

  name: str
  _splits: dict[str, list[TaskRow]]

  def split(self, name: str) -> list[TaskRow]:
    if name not in self._splits:
      raise unknown_split(self.name, name, list(self._splits))
    return list(self._splits[name])

  def sample(self, rng: np.random.Generator, n: int) -> list[TaskRow]:
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
    self._splits: dict[str, list[TaskRow]] = {}

  def split(self, name: str) -> list[TaskRow]:
    if name not in self._splits:
      rows = [t for s in self.sources for t in s.split(name)]
      order = np.random.default_rng(self.seed).permutation(len(rows))
      self._splits[name] = [rows[i] for i in order]
    return list(self._splits[name])

  def sample(self, rng: np.random.Generator, n: int) -> list[TaskRow]:
    """Per row a source index drawn by weight, then each source samples its rows in one call."""
    which = rng.choice(len(self.sources), size=n, p=self.weights)
    out: list[TaskRow | None] = [None] * n
    for k, source in enumerate(self.sources):
      rows = np.flatnonzero(which == k)
      if rows.size:
        for i, task in zip(rows, source.sample(rng, int(rows.size))):
          out[i] = task
    return out  # type: ignore[return-value]


class BadRow(UserError, ValueError):
  """A task row that cannot be used (`data.on_bad_row = "raise"`); the message names the row."""


class TooManySkipped(BadRow):
  """More of a run's rows would be skipped than `data.max_skipped_frac` allows; the message says
  how many, why, and the worst row (e.g. the longest prompt and the budget it is over)."""


PREVIEW_CHARS = 60  # of a reported row's prompt


class RowProblem(NamedTuple):
  """What makes a row unusable: `reason` (a metric name: data/skipped/<reason>), a `detail` for
  people, and a `size` that ranks rows of one reason (a too-long prompt's tokens), so a report
  can name the worst one."""
  reason: str
  detail: str = ""
  size: int = 0


@dataclasses.dataclass
class SkipReport:
  """Rows of one split (or of the training draws) checked, and those skipped by reason, with the
  worst row of each reason as (size, uid, prompt)."""
  where: str  # "train rows", "val rows", "training draws"
  rows: int = 0
  skipped: dict[str, int] = dataclasses.field(default_factory=dict)
  worst: dict[str, tuple[int, str, str]] = dataclasses.field(default_factory=dict)
  sampled: int = 0  # > 0: the split's size, of which only `rows` (evenly spaced) were checked

  def add(self, task: TaskRow, problem: RowProblem | None) -> None:
    self.rows += 1
    if problem is None:
      return
    reason = problem.reason
    self.skipped[reason] = self.skipped.get(reason, 0) + 1
    if reason not in self.worst or problem.size > self.worst[reason][0]:
      self.worst[reason] = (problem.size, task.uid, task.prompt[:PREVIEW_CHARS])

  @property
  def total(self) -> int:
    return sum(self.skipped.values())

  @property
  def frac(self) -> float:
    return self.total / self.rows if self.rows else 0.0

  def describe(self, verb: str = "skipped") -> str:
    """E.g. "408 of 512 train rows (80%) skipped (too_long: 408)"."""
    checked = f" (checked {self.rows:,} evenly spaced of {self.sampled:,})" if self.sampled else ""
    reasons = ", ".join(f"{k}: {n:,}" for k, n in sorted(self.skipped.items()))
    return (f"{self.total:,} of {self.rows:,} {self.where} ({self.frac:.0%}) {verb} "
            f"({reasons}){checked}")


SCAN_ROWS = 20_000  # rows of a split checked up front at most (evenly spaced beyond)
MIN_DRAWS = 256  # training draws before an unscanned source's skipped fraction is judged


class CheckedSource:
  """A source whose rows are checked before use: bad ones are skipped and counted, or raise.

  `check(task) -> reason | (reason, detail[, size]) | None` names what is wrong with a row (e.g.
  "empty_prompt", "too_long", "undecodable", "unknown_task"; see `RowProblem`). With
  `on_bad_row="skip"`, `sample` draws a replacement for every bad draw (from the same RNG, so the
  stream stays deterministic) and `split` leaves bad rows out; `skipped` counts them by reason
  (the `data/skipped/<reason>` metrics). With "raise", the first bad row raises BadRow naming its
  uid, the reason and the detail. Nothing is silently truncated: a prompt over the budget is
  skipped or raises, never cut.

  `max_skipped_frac` bounds the share of rows skipped: `scan(name)` checks a split up front (the
  caller raises `too_many(report)` before training); a source that cannot be scanned ahead (a
  stream: no train split) is judged on its training draws instead, once `min_draws` rows were
  drawn, and `sample` raises `TooManySkipped` when their skipped fraction is over the bar.
  `hint(report)` adds how to fix it (e.g. the key of the budget a prompt is over).
  """

  def __init__(self, source, check, on_bad_row: str = "skip", max_redraws: int = 1000, *,
               max_skipped_frac: float = 1.0, min_draws: int = MIN_DRAWS,
               hint: Callable[[SkipReport], str] | None = None):
    if on_bad_row not in ("skip", "raise"):
      raise ValueError(f"data.on_bad_row must be 'skip' or 'raise', got {on_bad_row!r}")
    self.source, self.check, self.on_bad_row = source, check, on_bad_row
    self.max_redraws = max_redraws
    self.max_skipped_frac, self.min_draws, self.hint = max_skipped_frac, min_draws, hint
    self.name, self.alphabet = source.name, source.alphabet
    self.skipped: dict[str, int] = {}
    self.draws = SkipReport("training draws")  # every row `sample` drew, good or bad
    self.scanned: dict[str, SkipReport] = {}  # by split, from `scan` or `split`
    self._splits: dict[str, list[TaskRow]] = {}

  def __getattr__(self, name):  # e.g. the `add` source's `task` (demonstrations)
    return getattr(self.source, name)

  def problem(self, task: TaskRow) -> RowProblem | None:
    """What is wrong with `task` (the check's answer as a `RowProblem`), or None."""
    found = self.check(task)
    if found is None:
      return None
    return RowProblem(found) if isinstance(found, str) else RowProblem(*found)

  def _bad(self, task: TaskRow, where: str, report: SkipReport | None = None) -> bool:
    found = self.problem(task)
    if report is not None:
      report.add(task, found)
    if found is None:
      return False
    if self.on_bad_row == "raise":
      raise BadRow(f"{where} row {task.uid!r}: {found.reason}"
                   f"{': ' + found.detail if found.detail else ''} "
                   "(data.on_bad_row=skip skips and counts such rows)")
    self.skipped[found.reason] = self.skipped.get(found.reason, 0) + 1
    return True

  def split(self, name: str) -> list[TaskRow]:
    if name not in self._splits:
      report = SkipReport(f"{name} rows")
      self._splits[name] = [t for t in self.source.split(name)
                            if not self._bad(t, name, report)]
      self.scanned.setdefault(name, report)
    return list(self._splits[name])

  def scan(self, name: str = "train", limit: int = SCAN_ROWS) -> SkipReport | None:
    """Checks split `name` up front, without counting its rows in `skipped`: at most `limit`
    rows, evenly spaced; None when the source cannot list it (a stream). With
    `on_bad_row="raise"` the first bad row raises, as it would when drawn."""
    if name in self.scanned:
      return self.scanned[name]
    try:
      rows = self.source.split(name)
    except (KeyError, NotImplementedError):
      return None
    if not rows:
      return None
    report = SkipReport(f"{name} rows")
    if len(rows) > limit:
      report.sampled = len(rows)
      rows = [rows[i] for i in np.linspace(0, len(rows) - 1, limit).astype(int)]
    for t in rows:
      found = self.problem(t)
      if found is not None and self.on_bad_row == "raise":
        self._bad(t, name)
      report.add(t, found)
    self.scanned[name] = report
    return report

  def too_many(self, report: SkipReport) -> TooManySkipped | None:
    """The error to stop with when `report` skips more than `max_skipped_frac` of its rows."""
    if report.frac <= self.max_skipped_frac:
      return None
    hint = self.hint(report) if self.hint is not None else ""
    verb = "skipped" if report is self.draws else "would be skipped"
    return TooManySkipped(
        f"{report.describe(verb)}, over data.max_skipped_frac={self.max_skipped_frac:g}"
        f"{': ' + hint if hint else ''}; or set data.max_skipped_frac=1 to train on the rest")

  def note(self) -> str | None:
    """A console line on the rows checked so far that were skipped, None when none was: per
    split, how many and why, then how to fix it (`hint`, over every split's worst rows)."""
    reports = [r for r in self.scanned.values() if r.total]
    if not reports:
      return None
    worst: dict[str, tuple[int, str, str]] = {}
    for r in reports:
      for reason, row in r.worst.items():
        worst[reason] = max(worst.get(reason, row), row)
    hint = self.hint(SkipReport("", worst=worst)) if self.hint is not None else ""
    return f"data: {'; '.join(r.describe() for r in reports)}{': ' + hint if hint else ''}"

  def sample(self, rng: np.random.Generator, n: int) -> list[TaskRow]:
    out = []
    redraws = 0
    while len(out) < n:
      for t in self.source.sample(rng, n - len(out)):
        if not self._bad(t, "train", self.draws):
          out.append(t)
        else:
          redraws += 1
      # A scanned train split was judged up front; a stream is judged on what it has given.
      if "train" not in self.scanned and self.draws.rows >= self.min_draws:
        error = self.too_many(self.draws)
        if error is not None:
          raise error
      if redraws > self.max_redraws * n:
        raise BadRow(f"source {self.name!r}: over {self.max_redraws} bad rows drawn per good "
                     f"row; skipped so far: {self.skipped}")
    return out
