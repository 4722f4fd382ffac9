"""The environment protocol: what a task row is, what an environment sees, what it returns.

An environment is called ONCE per turn with ALL its active rows (`step(turns)`), never once per
row: a reward that is cheap per batch (a judge model, a sandbox, a verifier with a warm cache)
stays cheap, and the number of calls per turn is the number of distinct environments among the
active rows. Environments are stateless between calls: everything a turn needs travels in the
`Turn` (the task row, the turn index, this turn's text and the history), so the same rows give
the same result in any order, batch split or process, and retries are safe.

`call_step` is the one entry point the rollout loop uses: it runs a sync `step` or an async
`astep` and validates what came back, so a buggy environment fails with its name and the bad
field instead of corrupting rewards downstream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Task:
  """One dataset row: a prompt for one environment.

  `env` names the environment (registry key) that grades it, so a batch mixing several sources
  routes each row to its own environment. `uid` is stable across runs ("countdown/train/17") so
  metrics, dedup and resume can refer to a row without its text.
  """
  env: str
  prompt: str
  data: Mapping[str, Any]
  uid: str


@dataclasses.dataclass(frozen=True)
class Turn:
  """One active row as an environment sees it after the model's turn.

  `turn` is the 0-based index of the model turn just generated; `response` is its decoded text
  without EOS; `truncated` says the turn hit its token budget without EOS (its text is cut, so
  built-in environments never reward it). `history` holds the earlier messages as (role, text):
  ("user", prompt), ("assistant", r0), ("user", obs0), ... - everything before `response`.
  """
  task: Task
  turn: int
  response: str
  truncated: bool
  history: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass
class StepResult:
  """What an environment returns for n rows, in the order of the turns it was given.

  rewards[i] is the reward earned by THIS turn (the episode return is the sum over turns);
  done[i] ends the row's episode, and observations[i] is the next user message (ignored, and by
  convention "", for a done row). `components` are optional named reward parts, not summed
  into the reward: each training step logs `reward/<name>`, the mean over its rows of each row's
  sum over turns. `metadata` is optional per-row information: its numeric values are logged per
  step as `env/metadata/<key>` (the mean over the rows that reported the key, the last value a
  row reported); other values are ignored.
  """
  observations: list[str]
  rewards: np.ndarray
  done: np.ndarray
  components: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  metadata: list[dict] | None = None

  def checked(self, n: int, env_name: str) -> StepResult:
    """Checks every field has n rows and a usable type; returns self with float32/bool arrays.

    Raises ValueError naming the environment and the field: a wrong length would silently pair
    rewards with the wrong rows, and a NaN reward would poison the advantage of a whole group.
    """
    where = f"environment {env_name!r}"
    if not isinstance(self.observations, (list, tuple)):
      raise ValueError(f"{where}: observations must be a list of str, got "
                       f"{type(self.observations).__name__}")
    if len(self.observations) != n:
      raise ValueError(f"{where}: observations has {len(self.observations)} entries for {n} rows")
    for i, obs in enumerate(self.observations):
      if not isinstance(obs, str):
        raise ValueError(f"{where}: observations[{i}] is {type(obs).__name__}, not str")
    self.observations = list(self.observations)
    self.rewards = _float_column(self.rewards, n, f"{where}: rewards")
    self.done = _bool_column(self.done, n, f"{where}: done")
    if not isinstance(self.components, Mapping):
      raise ValueError(f"{where}: components must be a dict of name -> [n] array, got "
                       f"{type(self.components).__name__}")
    self.components = {str(k): _float_column(v, n, f"{where}: components[{k!r}]")
                       for k, v in self.components.items()}
    if self.metadata is not None:
      if not isinstance(self.metadata, (list, tuple)) or len(self.metadata) != n:
        got = len(self.metadata) if isinstance(self.metadata, (list, tuple)) else \
            type(self.metadata).__name__
        raise ValueError(f"{where}: metadata must be None or a list of {n} dicts, got {got}")
      for i, m in enumerate(self.metadata):
        if not isinstance(m, dict):
          raise ValueError(f"{where}: metadata[{i}] is {type(m).__name__}, not dict")
      self.metadata = list(self.metadata)
    return self


def _column(x: Any, n: int, what: str) -> np.ndarray:
  try:
    a = np.asarray(x)
  except Exception as e:  # a ragged list, an object that refuses conversion
    raise ValueError(f"{what}: not convertible to an array ({e})") from e
  if a.shape != (n,):
    raise ValueError(f"{what}: shape {a.shape}, expected ({n},)")
  return a


def _float_column(x: Any, n: int, what: str) -> np.ndarray:
  a = _column(x, n, what)
  if a.dtype.kind not in "biuf":
    raise ValueError(f"{what}: dtype {a.dtype} is not a real number type")
  a = a.astype(np.float32)
  bad = np.flatnonzero(~np.isfinite(a))
  if bad.size:
    raise ValueError(f"{what}: non-finite value {a[bad[0]]} at row {bad[0]} "
                     f"({bad.size} non-finite in all)")
  return a


def _bool_column(x: Any, n: int, what: str) -> np.ndarray:
  a = _column(x, n, what)
  if a.dtype.kind == "b":
    return a.astype(bool)
  if a.dtype.kind in "iu" and np.isin(a, (0, 1)).all():
    return a.astype(bool)
  raise ValueError(f"{what}: dtype {a.dtype} is not bool (or integers 0/1)")


@runtime_checkable
class Environment(Protocol):
  """A synchronous environment. `max_turns`: the loop ends an episode after that many turns."""
  name: str
  max_turns: int

  def step(self, turns: Sequence[Turn]) -> StepResult: ...


@runtime_checkable
class AsyncEnvironment(Protocol):
  """An environment whose grading awaits something (a server, a judge); still one call per turn."""
  name: str
  max_turns: int

  async def astep(self, turns: Sequence[Turn]) -> StepResult: ...


def call_step(env: Environment | AsyncEnvironment, turns: Sequence[Turn]) -> StepResult:
  """Runs one batched step (`astep` if the environment has one, else `step`) and validates it.

  An async step runs in a fresh event loop; when the caller is itself inside a running loop
  (where `asyncio.run` is refused) it runs on a helper thread instead, so `call_step` works the
  same from plain code, a worker thread or a coroutine. No rows: nothing is called.
  """
  turns = list(turns)
  name = getattr(env, "name", type(env).__name__)
  if not turns:
    return StepResult([], np.zeros(0, np.float32), np.zeros(0, bool))
  astep = getattr(env, "astep", None)
  if astep is not None:
    result = _run_coroutine(lambda: astep(turns))
  else:
    result = env.step(turns)
  if not isinstance(result, StepResult):
    raise ValueError(f"environment {name!r}: step returned {type(result).__name__}, "
                     f"not StepResult")
  return result.checked(len(turns), name)


def _run_coroutine(make):
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(make())
  box: dict[str, Any] = {}

  def run():
    try:
      box["value"] = asyncio.run(make())
    except BaseException as e:  # re-raised in the caller's thread
      box["error"] = e

  t = threading.Thread(target=run, name="call_step", daemon=True)
  t.start()
  t.join()
  if "error" in box:
    raise box["error"]
  return box["value"]


def single_turn_result(rewards: Sequence[float], components: dict[str, Sequence[float]] | None
                       = None, metadata: list[dict] | None = None) -> StepResult:
  """The result of a one-turn environment: every row done, no further observation."""
  n = len(rewards)
  return StepResult([""] * n, np.asarray(rewards, np.float32), np.ones(n, bool),
                    {k: np.asarray(v, np.float32) for k, v in (components or {}).items()},
                    metadata)
