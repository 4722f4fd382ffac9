"""`math`: grade a free-text solution's final answer against a gold answer (single turn).

Rows come from GSM8K-style JSONL, {"question": str, "answer": str}, the gold final answer being
the text after the last "####" of `answer` (the whole `answer` when it has no "####", so rows
that carry only a final answer work too). Task data: {"answer": gold final answer,
"solution": the full `answer` text}.

The predicted answer is, in order of preference: the content of the last closed \\boxed{...};
else the first number after the last "####" or "answer is" (any case); else the last number in
the text. Numbers may carry a sign, thousands commas ("1,000"), decimals, a "/" denominator and
a "%".

Equivalence is decided in two stages. First the exact fallback, which needs no dependency:
normalise both sides (drop "\\!", "$", commas, whitespace and trailing "."; unit words are
NOT stripped, so a boxed "18 dollars" is not "18" here), then compare as exact Fractions when both
read as numbers - integers, decimals, "a/b" and \\frac{a}{b} - else as strings. A percent sign
is dropped, not divided by 100: "50%" equals "50" (GSM8K writes percent answers as bare
numbers), not "0.5". Only a pair the fallback rejects goes to the `math-verify` package when it
is importable (`pip install -e ".[math]"`), which also accepts e.g. 2^{10} for 1024,
\\sqrt{4} for 2 or "18 \\text{ dollars}" for 18; `use_math_verify=False` forces the fallback alone.

A pair of plain integers (up to 15 digits, no "%") that the fallback rejects is final, since
math-verify compares integers exactly too: wrong GSM8K answers cost no symbolic parse. Verdicts
are cached per (gold, predicted) pair, so the repeated answers of a group are graded once.
math-verify's log records (e.g. its warning that the timeout is off, on a worker thread) are
dropped while this grader calls it, on that thread only: other uses of math-verify in the same
program keep its logging.

math-verify bounds its parse and comparison with SIGALRM, which only the main thread can arm;
on a worker thread (the rollout loop's) it must run without that timeout. So that no thread can
hang on a hostile answer, and so the verdict does not depend on the thread, answers that could
explode symbolically - longer than 100 characters, more than one "^" or "**", an exponent of 5+
digits, factorials, binomials, sums/products/integrals/limits - are graded by the fallback
alone (on the main thread math-verify's own 5 s timeouts remain as a backstop).

Reward = correct (0/1); a truncated turn scores 0. Components: "format" (an answer was found)
and "correct".
"""

from __future__ import annotations

import codecs
import importlib
import contextlib
import io
import json
import logging
import math
import os
import re
import stat
import threading
from fractions import Fraction
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl.data.sources import SplitSource, alphabet_of
from jaxrl.envs.base import StepResult, Task, Turn, single_turn_result
from jaxrl.envs.registry import register
from jaxrl.core.errors import DataFileError

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# A minus sign belongs to the number unless it follows a word or a closing bracket ("3-5").
NUMBER = re.compile(rf"(?:(?<![\w)\]])-)?(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?\s*%?")
_MARKER = re.compile(r"####|answer is", re.IGNORECASE)
_BOXED = "\\boxed{"

_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_FRAC = re.compile(r"(-?)\\[dt]?frac\{(-?(?:\d+(?:\.\d*)?|\.\d+))\}\{(-?(?:\d+(?:\.\d*)?|\.\d+))\}")
_RISKY = re.compile(r"!|\\binom|\\choose|binomial|factorial|\\prod|\\sum|\\int|\\lim"
                    r"|(?:\^|\*\*)\s*[{(]?\s*-?\d{5,}")
MAX_VERIFY_CHARS = 100
_INTEGER = re.compile(r"-?\d{1,15}")  # exact in float64 and in math-verify's comparison


def extract_answer(response: str) -> str | None:
  """The predicted final answer's text (see the module docstring), or None when there is none."""
  boxed = _last_boxed(response)
  if boxed is not None:
    return boxed
  marker = None
  for marker in _MARKER.finditer(response):
    pass
  if marker is not None:
    m = NUMBER.search(response, marker.end())
    if m:
      return m.group(0).strip()
  last = None
  for last in NUMBER.finditer(response):
    pass
  return last.group(0).strip() if last else None


def _last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} whose braces close and that is not empty."""
  start = text.rfind(_BOXED)
  while start >= 0:
    depth, i = 1, start + len(_BOXED)
    while i < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth == 0:
      content = text[start + len(_BOXED):i - 1].strip()
      if content:
        return content
    start = text.rfind(_BOXED, 0, start)
  return None


def normalize(text: str) -> str:
  """The fallback's canonical text: no "\\!", "$", commas, whitespace or trailing "."."""
  s = text.replace("\u2212", "-").replace("\\!", "").replace("\\$", "").replace("$", "")
  s = re.sub(r"\s+", "", s.replace(",", ""))
  s = s.rstrip(".")
  if s.endswith("\\%"):
    s = s[:-2]
  elif s.endswith("%"):
    s = s[:-1]
  return s


def as_fraction(text: str) -> Fraction | None:
  """The exact value of a normalised answer that is a number (int, decimal, a/b, \\frac)."""
  try:
    if _PLAIN_NUMBER.fullmatch(text):
      return Fraction(text)
    if text.count("/") == 1:
      a, b = text.split("/")
      if _PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b) and Fraction(b) != 0:
        return Fraction(a) / Fraction(b)
    m = _FRAC.fullmatch(text)
    if m and Fraction(m.group(3)) != 0:
      value = Fraction(m.group(2)) / Fraction(m.group(3))
      return -value if m.group(1) else value
  except (ValueError, ZeroDivisionError, OverflowError):  # e.g. > 4300 digits
    return None
  return None


def fallback_equal(gold: str, pred: str) -> bool:
  """Exact equivalence without math-verify: equal numbers, else equal normalised text."""
  g, p = normalize(gold), normalize(pred)
  if not g or not p:
    return False
  fg, fp = as_fraction(g), as_fraction(p)
  if fg is not None and fp is not None:
    return fg == fp
  return g == p


def both_integers(gold: str, pred: str) -> bool:
  """Whether both answers are plain integers (see the module docstring): the fallback's verdict
  on them is final."""
  return all("%" not in x and _INTEGER.fullmatch(normalize(x)) for x in (gold, pred))


def is_risky(answer: str) -> bool:
  """Whether math-verify could spend unbounded time on `answer` (see the module docstring)."""
  if len(answer) > MAX_VERIFY_CHARS or _RISKY.search(answer):
    return True
  return answer.count("^") + answer.count("**") > 1


_GRADING = threading.local()  # .depth > 0: this thread is inside a math-verify call of ours


class _DropWhileGrading(logging.Filter):
  """Drops the records math-verify's loggers make inside our calls, on the calling thread."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not getattr(_GRADING, "depth", 0)


_DROP = _DropWhileGrading()
_QUIET_PACKAGES = ("math_verify", "latex2sympy2_extended")


@contextlib.contextmanager
def _grading():
  _GRADING.depth = getattr(_GRADING, "depth", 0) + 1
  try:
    yield
  finally:
    _GRADING.depth -= 1


class _MathVerify:
  """math-verify's `parse` + `verify` on answers wrapped in \\boxed{} (its top-priority target)."""

  CACHE = 4096  # golds / verdicts kept; both caches start over when full

  def __init__(self, timeout_s: int):
    import math_verify  # an optional dependency: the math extra
    self.mv = math_verify
    self.timeout_s = timeout_s
    self._gold: dict[str, Any] = {}
    self._verdicts: dict[tuple[str, str], bool] = {}
    # A logger's filter sees the records made on it (not its children's), so each of the
    # packages' loggers gets one; records made outside our calls pass.
    for name in list(logging.Logger.manager.loggerDict):
      if name.split(".")[0] in _QUIET_PACKAGES:
        logger = logging.getLogger(name)
        if _DROP not in logger.filters:
          logger.addFilter(_DROP)

  def _parse(self, text: str, timeout):
    return self.mv.parse(f"\\boxed{{{text}}}", parsing_timeout=timeout)

  def equal(self, gold: str, pred: str) -> bool:
    verdict = self._verdicts.get((gold, pred))
    if verdict is None:
      with _grading():
        verdict = self._equal(gold, pred)
      if len(self._verdicts) >= self.CACHE:
        self._verdicts.clear()
      self._verdicts[gold, pred] = verdict
    return verdict

  def _equal(self, gold: str, pred: str) -> bool:
    # SIGALRM (math-verify's timeout) can only be armed on the main thread.
    timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else None
    g = self._gold.get(gold)
    if g is None:
      if len(self._gold) >= self.CACHE:
        self._gold.clear()
      g = self._gold[gold] = self._parse(gold, timeout)
    p = self._parse(pred, timeout)
    if not g or not p:
      return False
    return bool(self.mv.verify(g, p, timeout_seconds=timeout))


def math_verify_available() -> bool:
  try:
    importlib.import_module("math_verify")
  except ImportError:
    return False
  return True


VAL_FRACTION = 0.1  # of `task.path`'s rows held out for validation without `task.val_path`


def _not_a_file(path: str) -> str | None:
  """What stands at `path` when it is there but not a regular file (a directory, a named pipe,
  ...); None when nothing is there."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return None
  for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                     (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device")):
    if test(mode):
      return kind
  return "a special file"


def math_checks(values) -> list[str]:
  """Task 'math' reads its rows from `task.path` (and `task.val_path`, if set): each file must
  exist and every row be valid (read whole here: a bad row is named by file and line before the
  run creates anything), and without a `task.val_path` the held-out share of `task.path` must
  leave at least one validation row."""
  problems, p = [], "config."
  counts = {}
  for key, what in (("task.path", "rows"), ("task.val_path", "validation rows")):
    path = values.get(key)
    if key == "task.path" and path == "":
      problems.append(f"{p}task.path: task 'math' needs a JSONL file of {{\"question\", "
                      "\"answer\"} rows, got ''")
    if not path:
      continue
    if not os.path.isfile(path):
      kind = _not_a_file(path)
      problems.append(f"{p}{key}: no file {path!r} (task 'math' reads its {what} from it)"
                      if kind is None else
                      f"{p}{key}: {path!r} is {kind}, not a regular file (task 'math' reads its "
                      f"{what} from a file, checking every row before the run starts)")
      continue
    try:
      counts[key] = len(read_jsonl(path))
    except DataFileError as e:
      problems.append(f"{p}{key}: {e}")
    except OSError as e:
      problems.append(f"{p}{key}: {path} cannot be read: {e.strerror or e}")
  n = counts.get("task.path")
  if n is not None and "task.val_path" in values and not values["task.val_path"] and \
      int(n * VAL_FRACTION) == 0:
    problems.append(f"{p}task.path: its {n} row(s) leave no validation rows ({VAL_FRACTION:.0%} "
                    f"are held out); give at least {math.ceil(1 / VAL_FRACTION)} rows or a "
                    f"{p}task.val_path")
  return problems


def math_source(cfg) -> MathSource:
  """Task 'math' of a run config: `task.path`, `task.val_path`, `task.instruction`, `seed`."""
  t = cfg.task
  return MathSource.from_jsonl(t.path, val_path=t.val_path or None, seed=cfg.seed,
                               instruction=t.instruction)


@register("math", source=math_source, checks=math_checks)
class MathEnvironment:
  """Single turn; see the module docstring. `use_math_verify`: None = when importable, True =
  required (ImportError otherwise), False = the exact fallback only."""
  name = "math"
  max_turns = 1

  def __init__(self, use_math_verify: bool | None = None, timeout_s: int = 5):
    if use_math_verify is None:
      use_math_verify = math_verify_available()
    self.verifier = _MathVerify(timeout_s) if use_math_verify else None
    self.use_math_verify = bool(use_math_verify)

  def equal(self, gold: str, pred: str) -> bool:
    if fallback_equal(gold, pred):
      return True
    if self.verifier is None or is_risky(pred) or both_integers(gold, pred):
      return False
    return self.verifier.equal(gold, pred)

  def step(self, turns: Sequence[Turn]) -> StepResult:
    fmt, correct, meta = [], [], []
    for t in turns:
      pred = extract_answer(t.response)
      right = pred is not None and not t.truncated and self.equal(t.task.data["answer"], pred)
      fmt.append(float(pred is not None))
      correct.append(float(right))
      meta.append({"extracted": pred})
    return single_turn_result(correct, {"format": fmt, "correct": correct}, meta)


def gold_answer(answer: str) -> str:
  """The final answer of a GSM8K `answer` field: the text after its last "####"."""
  return answer.rsplit("####", 1)[-1].strip()


def check_row(row: Any, where: str) -> tuple[str, str]:
  """(question, answer) of a row, or a DataFileError (a ValueError) naming `where` (file and
  line) and the problem."""
  if not isinstance(row, Mapping):
    raise DataFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
  out = []
  for key in ("question", "answer"):
    if key not in row:
      raise DataFileError(f"{where}: missing field {key!r}")
    value = row[key]
    if not isinstance(value, str):
      raise DataFileError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
      raise DataFileError(f"{where}: field {key!r} is empty")
    out.append(value)
  if not gold_answer(out[1]):
    raise DataFileError(f"{where}: field 'answer' has nothing after its last '####'")
  return out[0], out[1]


def read_jsonl(path: str | os.PathLike) -> list[tuple[str, str]]:
  """Every row of a UTF-8 JSONL file; a bad line is a DataFileError (a ValueError) naming the
  file and line number.

  Blank lines are skipped (they hold no row); every other line must be a valid row, so nothing
  is dropped silently. Bytes that are not UTF-8 are named by line and column too (a UTF-8
  byte-order mark at the start is allowed).
  """
  name = os.fspath(path)
  with open(path, "rb") as f:
    data = f.read()
  data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    lineno, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
    raise DataFileError(f"{name} line {lineno}: not UTF-8 text (byte 0x{data[e.start]:02x} at "
                        f"column {column}); save the file as UTF-8") from None
  rows = []
  for lineno, line in enumerate(io.StringIO(text, newline=None), 1):
    if not line.strip():
      continue
    where = f"{name} line {lineno}"
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataFileError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    rows.append(check_row(row, where))
  if not rows:
    raise DataFileError(f"{name}: no rows (task 'math' needs one {{\"question\", \"answer\"}} "
                        "JSON object per line)")
  return rows


class MathSource(SplitSource):
  """Question/answer rows; `instruction` (if any) is appended to each question on a new line."""

  def __init__(self, train: Sequence[Mapping[str, str]], val: Sequence[Mapping[str, str]] = (),
               name: str = "math", instruction: str = ""):
    self.name = name
    self.instruction = instruction
    pairs = {"train": [check_row(r, f"train row {i}") for i, r in enumerate(train)],
             "val": [check_row(r, f"val row {i}") for i, r in enumerate(val)]}
    if not pairs["train"]:
      raise ValueError(f"math source {name!r}: no training rows")
    self._splits = {split: [self._task(split, i, q, a) for i, (q, a) in enumerate(rows)]
                    for split, rows in pairs.items()}
    texts = [t.prompt for rows in self._splits.values() for t in rows]
    texts += [t.data["solution"] for rows in self._splits.values() for t in rows]
    self.alphabet = alphabet_of(texts, base="0123456789 .,-+*/=$%()\\{}#\nThe answer is boxed")

  def _task(self, split: str, i: int, question: str, answer: str) -> Task:
    prompt = f"{question}\n{self.instruction}" if self.instruction else question
    return Task(env="math", prompt=prompt,
                data={"answer": gold_answer(answer), "solution": answer},
                uid=f"{self.name}/{split}/{i}")

  @classmethod
  def from_jsonl(cls, path: str | os.PathLike, val_path: str | os.PathLike | None = None,
                 val_fraction: float = VAL_FRACTION, seed: int = 0, name: str = "math",
                 instruction: str = "") -> MathSource:
    """Rows of `path`; val is `val_path`'s rows, or else a seeded `val_fraction` of `path`.

    With a val fraction, floor(n * val_fraction) rows (a seeded permutation) go to val and the
    rest, in file order, to train.
    """
    rows = [{"question": q, "answer": a} for q, a in read_jsonl(path)]
    if val_path is not None:
      val = [{"question": q, "answer": a} for q, a in read_jsonl(val_path)]
      return cls(rows, val, name=name, instruction=instruction)
    if not 0 <= val_fraction < 1:
      raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(rows) * val_fraction)
    perm = np.random.default_rng(seed).permutation(len(rows))
    is_val = np.zeros(len(rows), bool)
    is_val[perm[:n_val]] = True
    return cls([r for r, v in zip(rows, is_val) if not v], [r for r, v in zip(rows, is_val) if v],
               name=name, instruction=instruction)
