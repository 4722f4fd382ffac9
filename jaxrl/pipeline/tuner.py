"""The lag that tunes itself (`rollout.lag = "auto"`): measured times in, a lag out.

The rollout worker makes batches one after another; the trainer trains on them in order. With
lag L the worker may start batch b once the trainer has begun to pull batch b - L (`LagGate`).
Given the measured generation time of each batch (`g`, the producer's time for it) and the
trainer's time between pulls (`t`, the train step and its bookkeeping: everything generation can
hide behind), `pipeline_time` replays that rule exactly and returns when the last step would end.
Lag 0 takes `sum(g + t)`; a lag overlaps them, and a larger lag also absorbs slow batches.
`choose_lag` picks the smallest lag whose time is within a tolerance of the best allowed lag's
(`rollout.max_lag`): the smallest lag at which generation hides behind training as far as any
allowed lag can. The tolerance is the larger of `1 - hide` of the best saving over lag 0 and
`EPS` of the lag-0 time: a lag more must save a few percent of the run to be worth its extra
staleness (so lag 0 stays when generation is cheap, and jitter alone does not flip 1 and 2).

`LagTuner` keeps the measurements (the worker's thread adds generation times, the trainer's
thread train times), decides every `rollout.lag_every` steps from those of the steps since its
last decision, and is saved in checkpoints (`state_dict`). Deciding at the pull of batch s sets
the lag of batch s + max_lag + 1 on, the first batch no lag could have started yet, so every
batch keeps the version its lag gave it (`LagPipeline` applies it to the gate).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading

HIDE = 0.9  # the share of the best saving a lag must reach to be chosen
# A saving under this share of the lag-0 time is not worth training off-policy: lag 0.
EPS = 0.05


def pipeline_time(gen: list[float], train: list[float], lag: int) -> float:
  """When the last of `len(gen)` steps ends, from an empty ring, with generation times `gen`
  and train times `train` (per batch, in order) under lag `lag`. Pure.

  Batch b starts when the worker is free and the trainer has begun pulling batch b - lag; the
  trainer pulls batch b when it ends step b - 1 and trains once the batch is made."""
  pull: list[float] = []  # when the trainer begins to pull batch b
  worker_free = trainer_free = 0.0
  for b, (g, t) in enumerate(zip(gen, train)):
    pull.append(trainer_free)
    start = max(worker_free, pull[b - lag] if b >= lag else 0.0)
    worker_free = start + g
    trainer_free = max(pull[b], worker_free) + t
  return trainer_free


@dataclasses.dataclass(frozen=True)
class Choice:
  lag: int
  reason: str


def choose_lag(gen: list[float], train: list[float], max_lag: int, hide: float = HIDE) -> Choice:
  """The smallest lag in 0..max_lag within the tolerance of the best (module docstring), with
  the reason in words."""
  n = min(len(gen), len(train))
  gen, train = list(gen[-n:]), list(train[-n:])
  times = [pipeline_time(gen, train, lag) for lag in range(max_lag + 1)]
  best = times[0] - min(times)
  tolerance = max((1 - hide) * best, EPS * times[0])
  lag = next(lag for lag in range(max_lag + 1) if times[lag] - min(times) <= tolerance)
  share = (times[0] - times[lag]) / best if best > 0 else 1.0
  reason = (f"generation {statistics.median(gen):.3g} s/batch, train {statistics.median(train):.3g}"
            f" s/step (medians of {n} steps): lag {lag} saves {share:.0%} of what lag {max_lag} "
            f"would ({times[0]:.3g} s at lag 0, {times[lag]:.3g} s at lag {lag} for these steps)")
  return Choice(lag, reason)


class LagTuner:
  """Measurements in, a lag out, every `every` steps, within `max_lag` (module docstring).

  Thread-safety: `observe_generation` from the worker's thread, the rest from the trainer's."""

  def __init__(self, max_lag: int, every: int, start: int | None = None, hide: float = HIDE):
    if max_lag < 1 or every < 1:
      raise ValueError(f"LagTuner needs max_lag >= 1 and every >= 1, got {max_lag}, {every}")
    self.max_lag, self.every, self.hide = max_lag, every, hide
    self.start = min(1, max_lag) if start is None else start  # the lag before any measurement
    self._lock = threading.Lock()
    self._gen: dict[int, float] = {}  # batch id -> seconds the producer took
    self._train: dict[int, float] = {}  # batch id -> the trainer's seconds on it (pull to pull)

  def observe_generation(self, batch_id: int, seconds: float) -> None:
    with self._lock:
      self._gen[batch_id] = seconds

  def observe_train(self, batch_id: int, seconds: float) -> None:
    with self._lock:
      self._train[batch_id] = seconds

  def due(self, batch_id: int) -> bool:
    """Whether the pull of `batch_id` is a decision point: every `every` batches, after the
    first `every` (batch 0 compiles, so its times are left out; `LagPipeline` also leaves out
    the first batch and step it times after a resume)."""
    return batch_id > 0 and batch_id % self.every == 0

  def decide(self, batch_id: int) -> Choice | None:
    """At a decision point: the lag from the batches since the last one, both of whose times are
    known (batch 0 left out); None when none are, or not at a decision point."""
    if not self.due(batch_id):
      return None
    with self._lock:
      ids = [b for b in range(max(1, batch_id - self.every), batch_id)
             if b in self._gen and b in self._train]
      gen, train = [self._gen[b] for b in ids], [self._train[b] for b in ids]
      # Measurements no later decision reads.
      for d in (self._gen, self._train):
        for b in [b for b in d if b < batch_id]:
          del d[b]
    if not ids:
      return None
    return choose_lag(gen, train, self.max_lag, self.hide)

  def state_dict(self) -> dict:
    """The measurements a later decision reads (JSON), for a checkpoint."""
    with self._lock:
      return {"gen": {str(b): s for b, s in self._gen.items()},
              "train": {str(b): s for b, s in self._train.items()}}

  def load_state_dict(self, state: dict) -> None:
    with self._lock:
      self._gen = {int(b): float(s) for b, s in state.get("gen", {}).items()}
      self._train = {int(b): float(s) for b, s in state.get("train", {}).items()}
