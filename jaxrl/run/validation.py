"""Evaluation: held-out accuracy of a policy, as a pass over a split, synchronously or alongside
training.

`Evaluator.evaluate(params, split)` runs one pass through the run's multi-turn loop (the same
environments, one batched call per environment per turn): `val.samples_per_prompt = k` samples per
prompt at `val.temperature` (0 = greedy). A row is solved when its episode reward is >= 1 (every
built-in environment gives 1 for a solved task). Metrics: `val/accuracy` (solved rows),
`val/pass@k` (prompts with a solved sample), `val/reward`, `val/avg_length` (generated tokens per
row), turn and outcome statistics, `val/env_calls` and, with mixed tasks, `val/<task>/accuracy`,
`val/<task>/pass@k` and `val/<task>/avg_length`.
Rows go through partition `val` of the data plane and are freed after the pass. The last chunk of
prompts is padded by repetition to keep one shape; padding rows count for nothing.

Evaluation measures the policy the samplers run: with `rollout.dtype` set, params in another
dtype (the warm-up's, the train state's on several processes) are cast as a publish would cast
them (`Parts.rollout_copy`); a published copy is already cast.

Alongside training: `submit(step, params)` starts a pass over `val` of the params of `step` (an
immutable published copy, so training may go on donating its own buffers) on one supervised thread
and returns at once; the trainer collects finished passes with `poll()`, logging each under the
step it describes. Evaluation never touches the lag ring or the params handoff, so the forced-lag
contract is unchanged.

Bounded blocking: if the previous pass is still running when the next is due, `submit` waits for
it at most `max_wait_s` and then raises `EvaluationStalled` (a stuck environment or engine fails
the run loudly instead of hanging it). Any exception of a pass re-raises, with its traceback, from
the trainer's next `poll`/`submit`/`wait`. `asynchronous=False` runs each pass inline in `submit`
(the multi-process mode, where every process must launch computations in the same order).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.core.errors import UserError
from jaxrl.pipeline import BatchMeta
from jaxrl.pipeline.dynamic_sampling import finite_mean
from jaxrl.rollout.precision import needs_cast, rollout_dtype


class EvaluationStalled(UserError, RuntimeError):
  """An evaluation pass did not finish within `val.max_wait_s` (one line naming the key)."""


class EvaluationFailed(RuntimeError):
  """An evaluation pass raised; `__cause__` is its exception, the message has its traceback."""


def evaluate(parts, params, split: str, pass_id: str) -> dict:
  """One pass of `parts.val_loop` over `split` of `parts.source` (see the module docstring);
  `pass_id` keys the pass's rows in the data plane."""
  v = parts.cfg.val
  # Params not in the samplers' dtype (`rollout.dtype`: the warm-up's, or the train state's on
  # several processes) are cast as a publish would, so every pass evaluates the policy the
  # samplers run, with one compiled sampler.
  params = parts.rollout_copy(params) if needs_cast(params, rollout_dtype(parts.cfg)) \
      else parts.for_rollout(params)
  tasks = parts.source.split(split)
  bs, k = v.batch_size, v.samples_per_prompt
  # An agent task's `dev` split (read only by the warm-up's stopping rule) is scored by its rows'
  # own task unless agent.warmup_through_agent (`AgentLoop.dev_loop`).
  loop = (getattr(parts.val_loop, "dev_loop", None) if split == "dev" else None) or parts.val_loop
  metas, eps = [], []
  try:
    for start in range(0, len(tasks), bs):
      chunk = tasks[start:start + bs]
      padded = chunk + [chunk[-1]] * (bs - len(chunk))
      ep = loop.run(params, padded, jax.random.key(parts.cfg.seed), request_base=0, version=0,
                    temperature=v.temperature)
      real = np.arange(bs * k) < len(chunk) * k
      meta = BatchMeta.mint("val", f"{pass_id}/{start}",
                            group_ids=start + np.arange(bs * k) // k, lengths=ep.mask.sum(1),
                            versions=np.zeros(bs * k),
                            tags={"reward": ep.rewards, "real": real.astype(np.float32)})
      metas.append(parts.data.put(meta, {"tokens": ep.tokens, "mask": ep.mask,
                                         "completion_valid": ep.valid}))
      eps.append((ep, real))
    rewards = np.concatenate([m.tags["reward"] for m in metas])
    real = np.concatenate([m.tags["real"] for m in metas]) > 0
    lengths = np.concatenate([m.lengths for m in metas])
    solved = (np.nan_to_num(rewards, nan=0.0) >= 1.0 - 1e-6)[real].reshape(-1, k)
    out = {"val/accuracy": float(solved.mean()), f"val/pass@{k}": float(solved.any(1).mean()),
           "val/reward": finite_mean(rewards[real]),
           "val/avg_length": float(lengths[real].mean())}
    turns = np.concatenate([e.turns[m] for e, m in eps])
    out["val/turns/mean"] = float(turns.mean())
    for key in ("terminated", "truncated", "failed"):
      out[f"val/{key}_frac"] = float(np.concatenate([getattr(e, key)[m] for e, m in eps]).mean())
    out["val/env_calls"] = float(sum(e.env_calls for e, _ in eps))
    if len(parts.envs) > 1:  # mixed tasks: accuracy, pass@k and length per task too
      env_of = np.array([t.env for e, m in eps for t, keep in zip(e.tasks, m) if keep])
      flat = solved.reshape(-1)
      for name in parts.envs:
        rows = env_of == name
        if rows.any():
          out[f"val/{name}/accuracy"] = float(flat[rows].mean())
          # The k samples of a prompt are consecutive rows of one task.
          out[f"val/{name}/pass@{k}"] = float(solved[rows.reshape(-1, k)[:, 0]].any(1).mean())
          out[f"val/{name}/avg_length"] = float(lengths[real][rows].mean())
    return out
  finally:
    for m in metas:
      parts.data.discard(m)


class Evaluator:
  """Evaluation passes of a run, inline (`evaluate`) or alongside training (`submit`/`poll`/
  `wait`; see the module docstring).

  `parts` is the run's `Parts`; `run(step, params) -> metrics` replaces the pass itself (a seam
  for tests of the threading alone; default: `evaluate` over `val`).
  """

  def __init__(self, parts=None, *, asynchronous: bool = True, max_wait_s: float = 600.0,
               run: Callable[[int, object], dict] | None = None,
               name: str = "jaxrl-evaluation"):
    if parts is None and run is None:
      raise ValueError("Evaluator needs the run's parts or a run function")
    self.parts = parts
    self._run = run or (lambda step, params: self.evaluate(params))
    self.asynchronous, self.max_wait_s, self.name = asynchronous, max_wait_s, name
    self._passes = 0
    self._cond = threading.Condition()
    self._busy: int | None = None  # step of the pass in flight
    self._done: list[tuple[int, dict]] = []
    self._error: BaseException | None = None
    self._error_text = ""
    self._thread: threading.Thread | None = None
    self.wait_s = 0.0  # total time the trainer spent waiting for evaluation

  def evaluate(self, params, split: str = "val") -> dict:
    """One pass over `split`, now, in this thread."""
    with self._cond:
      self._passes += 1
      pass_id = f"{split}{self._passes}"
    return evaluate(self.parts, params, split, pass_id)

  def _pass(self, step: int, params) -> None:
    t0 = time.monotonic()
    try:
      metrics = dict(self._run(step, params))
      metrics.setdefault("val/time_s", time.monotonic() - t0)
    except BaseException as e:  # noqa: BLE001 - handed to the trainer
      with self._cond:
        self._error, self._error_text = e, traceback.format_exc()
        self._busy = None
        self._cond.notify_all()
      return
    with self._cond:
      self._done.append((step, metrics))
      self._busy = None
      self._cond.notify_all()

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      err, self._error = self._error, None
      raise EvaluationFailed(f"evaluation pass failed:\n{self._error_text}") from err

  def _wait_idle(self, timeout: float) -> None:
    t0 = time.monotonic()
    deadline = t0 + timeout
    with self._cond:
      while self._busy is not None and self._error is None:
        left = deadline - time.monotonic()
        if left <= 0:
          self.wait_s += time.monotonic() - t0
          raise EvaluationStalled(
              f"the evaluation pass of step {self._busy} did not finish within "
              f"val.max_wait_s={self.max_wait_s:g} s; raise val.max_wait_s (or lower "
              "val.batch_size / task.val_size) if evaluation is this slow")
        self._cond.wait(min(left, 0.05))
      self.wait_s += time.monotonic() - t0
      self._raise_if_failed()

  def submit(self, step: int, params) -> None:
    """Starts evaluating `params` (the policy after `step` updates)."""
    self._wait_idle(self.max_wait_s)
    if not self.asynchronous:
      with self._cond:
        self._busy = step
      self._pass(step, params)
      with self._cond:
        self._raise_if_failed()
      return
    with self._cond:
      self._busy = step
    self._thread = threading.Thread(target=self._pass, args=(step, params), daemon=True,
                                    name=f"{self.name}-{step}")
    self._thread.start()

  def poll(self) -> list[tuple[int, dict]]:
    """Finished passes since the last poll, as `(step, metrics)`, oldest first."""
    with self._cond:
      self._raise_if_failed()
      done, self._done = self._done, []
    return done

  def wait(self) -> list[tuple[int, dict]]:
    """Waits (at most `max_wait_s`) for the pass in flight; returns every unpolled result."""
    self._wait_idle(self.max_wait_s)
    return self.poll()

  def close(self, timeout: float = 5.0) -> None:
    """Gives a running pass `timeout` seconds to end; a daemon thread never blocks exit."""
    t = self._thread
    if t is not None and t.is_alive():
      t.join(timeout)
