"""One engine thread that batches the requests of many HTTP clients into the continuous engine.

Requests (`Job`: one prompt, its sampling settings, a future) wait in a bounded queue. The
engine thread takes every job waiting (up to `max_batch`), runs them as one `Engine.run` (the
engine keeps its slots full and refills them as rows end) and resolves each job's future as its
row finishes (`on_finish`), so a short reply returns before the longest of its batch. Jobs that
arrive during a run wait for the next one. A streaming job also gets its tokens after every
decode dispatch (`Job.on_tokens`), and a cancelled job's row ends at the next dispatch, freeing
its slot for the next row.

Supervision: an exception on the engine thread fails every queued and running job with it, is
kept in `error`, and makes every later `submit` raise it; nothing waits on a dead thread.

Params come from `params_source() -> (version, params)`, asked by the engine at the start of
every run and, through the engine's partial rollouts, between dispatches: a weight update published mid-run moves the
rows in flight to the new params, and each token's version says which params produced it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import queue
import threading
from typing import Callable

import jax
import numpy as np

from jaxrl.rollout.engine import Engine


class ServerBusy(RuntimeError):
  """The request queue is full (`max_queue` jobs waiting)."""


@dataclasses.dataclass(frozen=True)
class Completion:
  """One generated row: tokens up to and including EOS (if any), their log-probs under the
  sampling temperature, and the params version that produced each token."""

  tokens: list[int]
  logprobs: list[float]
  versions: list[int]
  hit_eos: bool


@dataclasses.dataclass
class Job:
  """One request. `on_tokens(tokens, logprobs, versions)`, if set, is called on the engine thread
  after every dispatch that decoded the row, with all its tokens so far (a streaming reply);
  `cancel()` ends the row at the next dispatch and frees its slot (a client that went away)."""

  prompt: list[int]
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  future: concurrent.futures.Future = dataclasses.field(
      default_factory=concurrent.futures.Future)
  on_tokens: Callable[[list[int], list[float], list[int]], None] | None = None
  cancelled: bool = False

  def cancel(self) -> None:
    self.cancelled = True
    self.future.cancel()  # a job not started yet is dropped


class Dispatcher:
  """The engine thread (module docstring). `start()` it, `submit` jobs, `close()` it."""

  def __init__(self, engine: Engine, params_source: Callable[[], tuple[int, object]], *,
               seed: int = 0, max_queue: int = 1024, max_batch: int | None = None):
    self.engine, self.params_source = engine, params_source
    self.key = jax.random.key(seed)
    self.max_batch = max_batch or 4 * engine.num_slots
    self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
    self._ids = itertools.count()
    self._thread = threading.Thread(target=self._main, name="jaxrl-openai-engine", daemon=True)
    self._running: list[Job] = []
    self.error: BaseException | None = None
    self.batches = 0  # engine runs so far
    self.rows = 0  # rows generated so far

  def start(self) -> Dispatcher:
    self._thread.start()
    return self

  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  def submit(self, job: Job) -> concurrent.futures.Future:
    """Queues a job; raises the engine thread's error if it died, ServerBusy if the queue is
    full."""
    if self.error is not None:
      raise RuntimeError(f"the engine thread failed: {self.error!r}") from self.error
    if len(job.prompt) > self.engine.max_prompt_len or not job.prompt:
      raise ValueError(f"prompt of {len(job.prompt)} tokens: the engine takes 1 to "
                       f"{self.engine.max_prompt_len}")
    try:
      self._queue.put_nowait(job)
    except queue.Full:
      raise ServerBusy(f"{self._queue.maxsize} requests are already waiting") from None
    return job.future

  def close(self, timeout: float = 30.0) -> None:
    """Stops the thread after the current run; queued jobs fail."""
    try:
      self._queue.put(None, timeout=timeout)
    except queue.Full:
      pass
    self._thread.join(timeout)

  def _take(self) -> list[Job] | None:
    first = self._queue.get()
    if first is None:
      return None
    jobs = [first]
    while len(jobs) < self.max_batch:
      try:
        job = self._queue.get_nowait()
      except queue.Empty:
        break
      if job is None:
        self._queue.put(None)  # seen again after this batch
        break
      jobs.append(job)
    return [j for j in jobs if j.future.set_running_or_notify_cancel()]

  def _main(self) -> None:
    try:
      while True:
        jobs = self._take()
        if jobs is None:
          break
        if jobs:
          self._running = jobs
          self._run(jobs)
          self._running = []
    except BaseException as e:  # noqa: BLE001  (kept and handed to every waiter)
      self.error = e
      for job in self._running:
        if not job.future.done():
          job.future.set_exception(e)
    finally:
      self._fail_queued(self.error or RuntimeError("the server is shutting down"))

  def _fail_queued(self, error: BaseException) -> None:
    while True:
      try:
        job = self._queue.get_nowait()
      except queue.Empty:
        return
      if job is not None and job.future.set_running_or_notify_cancel():
        job.future.set_exception(error)

  def _run(self, jobs: list[Job]) -> None:
    self.batches += 1
    ids = [next(self._ids) % (2**31 - 1) for _ in jobs]

    def on_finish(p: int, out) -> None:
      n = int(out.lengths[0])
      tokens = [int(t) for t in out.tokens[0, :n]]
      done = Completion(tokens, [float(x) for x in out.logprobs[0, :n]],
                        [int(v) for v in out.versions[0, :n]],
                        bool(n and tokens[-1] in self.engine.eos_ids))
      self.rows += 1  # counted before the client can see its reply
      if not jobs[p].future.done():
        jobs[p].future.set_result(done)

    def on_tokens(row: int, tokens, logprobs, versions) -> None:
      job = jobs[row]
      if job.on_tokens is None or job.cancelled:
        return
      try:
        job.on_tokens([int(t) for t in tokens], [float(x) for x in logprobs],
                      [int(v) for v in versions])
      except Exception:  # noqa: BLE001  (its client is gone: that row ends, the others go on)
        job.cancelled = True

    live = any(j.on_tokens is not None for j in jobs)
    # The engine asks `params_source` itself before its first admission (and between dispatches):
    # one call per run start, so a per-batch source sees the run's first admission first.
    self.engine.run(None, [j.prompt for j in jobs], ids, self.key,
                    temperature=np.array([j.temperature for j in jobs], np.float32),
                    top_k=np.array([j.top_k for j in jobs], np.int32),
                    top_p=np.array([j.top_p for j in jobs], np.float32),
                    on_finish=on_finish, params_source=self._source,
                    on_tokens=on_tokens if live else None,
                    cancelled=lambda row: jobs[row].cancelled)

  def _source(self) -> tuple[int, object]:
    got = self.params_source()
    if got is None:
      raise RuntimeError("the server's params source returned no params")
    return got
