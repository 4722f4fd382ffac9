"""Params handoff from the trainer to the rollout worker, addressed by version.

The trainer publishes params version v (= number of optimizer updates applied) before it pulls
batch v; the worker asks for the exact version its batch must use (`max(0, b - L)` under forced
lag), not "the newest", and waits until it is published. Published params are treated as
immutable: the trainer must not donate a buffer it published (publish a copy or a reshard).
"""

from __future__ import annotations

import threading
import time

from jaxrl.pipeline.gate import PipelineClosed

_POLL_S = 0.05  # how often a waiting get() re-checks should_stop and its timeout


class VersionUnavailable(LookupError):
  """The requested params version was pruned, or skipped and so will never be published."""


class ParamsHandoff:
  """Versioned params store: `publish(v, params)` by the trainer, `get(v)` by the worker.

  Memory: every published version is kept until `prune_below` drops it. Under forced lag the
  trainer may call `prune_below(max(0, t + 1 - L))` once `pull()` of batch t has returned: every
  batch the worker can still start has id >= t+1 and needs version >= t+1-L.
  """

  def __init__(self):
    self._cond = threading.Condition()
    self._params: dict[int, object] = {}
    self._latest = -1
    self._floor = 0  # versions below this were pruned

  def publish(self, version: int, params) -> None:
    """Publishes `params` as `version`; versions must be strictly increasing."""
    with self._cond:
      if version <= self._latest:
        raise ValueError(f"params versions must be strictly increasing: publish({version}) after "
                         f"{self._latest}")
      if version < self._floor:
        raise ValueError(f"publish({version}) below the pruned floor {self._floor}")
      self._params[version] = params
      self._latest = version
      self._cond.notify_all()

  def get(self, version: int, timeout: float | None = None, should_stop=None):
    """Returns the params published as `version`, blocking until they are published.

    Raises VersionUnavailable if `version` was pruned or can never arrive (a later version is
    already published), TimeoutError after `timeout` seconds, and PipelineClosed when the callable
    `should_stop()` returns True (checked at least every ~50 ms while waiting, and before).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      # should_stop is user code (it usually takes the gate's lock): call it without holding ours,
      # so no lock-order cycle can form.
      if should_stop is not None and should_stop():
        raise PipelineClosed(f"stopped while waiting for params version {version}")
      with self._cond:
        if version in self._params:
          return self._params[version]
        if version < self._floor:
          raise VersionUnavailable(f"params version {version} was pruned (kept >= {self._floor})")
        if version < self._latest:
          raise VersionUnavailable(f"params version {version} was never published and cannot be "
                                   f"(latest is {self._latest})")
        wait = _POLL_S if should_stop is not None else None
        if deadline is not None:
          remaining = deadline - time.monotonic()
          if remaining <= 0:
            raise TimeoutError(f"params version {version} not published within {timeout:g} s "
                               f"(latest is {self._latest})")
          wait = remaining if wait is None else min(wait, remaining)
        self._cond.wait(wait)

  def latest(self) -> tuple[int, object] | None:
    """`(version, params)` of the newest published version, or None before the first; does not
    wait. Partial rollouts switch to it between decode dispatches."""
    with self._cond:
      if self._latest < 0 or self._latest not in self._params:
        return None
      return self._latest, self._params[self._latest]

  def prune_below(self, version: int) -> None:
    """Drops every version < `version` (waiters for them raise VersionUnavailable)."""
    with self._cond:
      self._floor = max(self._floor, version)
      for v in [v for v in self._params if v < self._floor]:
        del self._params[v]
      self._cond.notify_all()

  @property
  def latest_version(self) -> int:
    """The newest published version, -1 before any publish."""
    with self._cond:
      return self._latest

  @property
  def versions(self) -> list[int]:
    """The versions currently held (for tests and memory metrics)."""
    with self._cond:
      return sorted(self._params)
