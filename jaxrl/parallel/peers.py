"""Liveness of a run's processes: a lost process ends every process, named, in bounded time.

Several processes wait for each other in every collective. A process that dies (SIGKILL, a lost
host) or hangs would otherwise leave the others waiting. Each process runs a `PeerWatch`: a
thread that writes this process's heartbeat and state to the coordination service's key-value
store (the one `jax.distributed.initialize` connects; only small host strings, no device work)
every `interval_s`, and reads every other process's. It ends this process with exit status 1
and one line on stderr naming the process when another process

  * has not advanced its heartbeat for `timeout_s` (`distributed.peer_timeout_s`): killed,
    crashed, hung or cut off;
  * reports that it failed (`fail`): its own error is in its own output;

and when the coordination service itself stops answering for `timeout_s` (it lives in process
0). A process that finishes says so (`finish`), so a peer that ends later does not count it as
lost. The rerun of the same command on every process resumes from the last checkpoint.

Processes named `droppable` (rollout processes that may come and go, docs/failures.md) are
dropped instead: silent for `timeout_s`, or failed, such a process is reported once to
`on_lost` (and listed in `dropped`) while this process goes on; when a new start of it beats
(the same command started again joins with the same id; each start writes a token of its own,
so a hung process that wakes up is not taken for one that came back) it is reported to
`on_back` and watched as before. Whether a lost process can leave the others running at all is
JAX's decision as much as this module's: only with `jax_enable_recoverability` on
(docs/failures.md has what the runtime does either way).

JAX's runtime has the last word: it ends a process at once when process 0 (the coordination
service) is gone ("the JAX distributed service detected fatal errors"), and any process whose
heartbeat it has missed for its own timeout, which `jaxrl.parallel.distributed.join` sets to
`timeout_s + JAX_MARGIN_S` so that this module's message comes first.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable

# JAX's heartbeat timeout is this much longer than the watch's, so the watch names the process.
JAX_MARGIN_S = 30
KEY = "jaxrl/peers/"


def coordination_client():
  """The coordination service client of this process (None when no processes were joined).

  JAX keeps it in its private distributed state; there is no public accessor in JAX 0.10."""
  from jax._src import distributed as jax_distributed  # the only handle on the service

  return getattr(jax_distributed.global_state, "client", None)


class PeerWatch:
  """Watches the other processes of a run (see the module docstring).

  `client`: the key-value store (`key_value_set(key, value, allow_overwrite)`,
  `key_value_dir_get(prefix)`); `exit`: what ends the process (`os._exit` by default; a test
  passes its own). `report` receives the one-line message before `exit(1)`. `droppable`: the
  processes dropped rather than fatal when lost; `on_lost(q, why)` and `on_back(q)` are called
  on the watch's threads when one is dropped or beats again (they must return promptly; `listen`
  sets them later). `hold_exit` (process 0 of a run with recoverability on, where JAX's own
  shutdown barrier holds nobody): `finish` returns only once every other process has finished,
  ended or been dropped, so the coordination service this process runs outlives them.
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
               interval_s: float | None = None, exit: Callable[[int], None] = os._exit,
               report: Callable[[str], None] | None = None, droppable=(),
               on_lost: Callable[[int, str], None] | None = None,
               on_back: Callable[[int], None] | None = None, hold_exit: bool = False):
    self.hold_exit = hold_exit
    self.client, self.me, self.n = client, process_id, num_processes
    self.timeout_s = float(timeout_s)
    self.interval_s = interval_s if interval_s is not None else min(2.0, self.timeout_s / 10)
    self._exit, self._report = exit, report or _stderr
    self.state, self.why = "running", ""
    self.beat = 0
    self.verdict: str | None = None  # the message this process ended with
    self._seen: dict[int, tuple[int, float]] = {}  # process -> (its beat, when it last changed)
    self._peer_states: dict[int, str] = {}  # process -> its last reported state
    self._last_round = time.monotonic()  # when the store last answered
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self.droppable = frozenset(droppable) - {process_id}
    self.dropped: set[int] = set()  # droppable processes lost and not back
    self.token = f"{os.getpid()}-{time.time_ns()}"  # this start of this process
    self._tokens: dict[int, str | None] = {}  # process -> the token of its start last seen
    self._dropped_token: dict[int, str | None] = {}  # process -> its token when dropped
    self._on_lost, self._on_back = on_lost, on_back
    self.rejoined = False  # this start joined a run an earlier start of this process was in

  # --- this process's side -----------------------------------------------------------------------

  def start(self) -> "PeerWatch":
    now = time.monotonic()
    self._seen = {q: (-1, now) for q in range(self.n) if q != self.me}
    self._last_round = now
    self._write()
    # Two threads: one talks to the store (a call there may block when process 0 hangs), one
    # judges from what the first has seen, so a blocked call cannot stop the judgement.
    for name, target in (("peer-heartbeat", self._heartbeat), ("peer-judge", self._judge)):
      t = threading.Thread(target=target, name=name, daemon=True)
      t.start()
      self._threads.append(t)
    return self

  def listen(self, on_lost: Callable[[int, str], None] | None,
             on_back: Callable[[int], None] | None = None) -> None:
    """Who is told when a droppable process is dropped or back (see the class docstring)."""
    with self._lock:
      self._on_lost, self._on_back = on_lost, on_back
      lost = sorted(self.dropped)
    for q in lost:  # dropped before anyone listened
      if on_lost is not None:
        on_lost(q, f"lost process {q} of {self.n}")

  def token_of(self, q: int) -> str | None:
    """The token of process q's start last seen (each start of a process writes its own)."""
    return self._tokens.get(q)

  def finish(self) -> None:
    """This process is done (success, or an error it has reported itself): others stop
    watching it. The threads stop (with `hold_exit`, once the others are done: see the class
    docstring; a process that goes silent meanwhile is judged as ever)."""
    self._set("done", "")
    while self.hold_exit and not self._stop.is_set() and not self._others_over():
      time.sleep(min(0.2, self.interval_s))
    self._stop.set()

  def _others_over(self) -> bool:
    """Every other process has finished, ended, failed or been dropped."""
    return all(self._peer_states.get(q, "running") != "running" or q in self.dropped
               for q in self._seen)

  def fail(self, why: str, wait_s: float | None = None) -> None:
    """This process failed with `why` (one line): tells the others, who end with a message naming
    this process; returns after every other process has ended, finished or been judged lost, or
    after `wait_s` (default: past the moment a silent process would be judged lost), so a peer
    gets the news before this process's exit takes the coordination service down (process 0),
    and a peer that is gone is named here (the judge ends this process then)."""
    self._set("failed", why)
    horizon = self.timeout_s + 3 * self.interval_s + 2  # a beat is seen up to an interval late
    deadline = time.monotonic() + (horizon if wait_s is None else wait_s)
    while time.monotonic() < deadline and not self._stop.is_set():
      if self._others_over():
        break
      time.sleep(min(0.2, self.interval_s))
    self._stop.set()

  def stop(self) -> None:
    """Stops the threads without telling the others anything (tests)."""
    self._stop.set()
    for t in self._threads:
      t.join(timeout=5)

  # --- the threads -------------------------------------------------------------------------------

  def _set(self, state: str, why: str) -> None:
    with self._lock:
      self.state, self.why = state, why
    try:
      self._write()
    except Exception:  # the store is gone: nobody is left to tell
      pass

  def _write(self) -> None:
    with self._lock:
      value = json.dumps({"beat": self.beat, "state": self.state, "why": self.why,
                          "token": self.token})
    self.client.key_value_set(f"{KEY}{self.me}", value, allow_overwrite=True)

  def _heartbeat(self) -> None:
    while not self._stop.wait(self.interval_s):
      try:
        self.beat += 1
        self._write()
        got = self.client.key_value_dir_get(KEY)
      except Exception as e:  # the coordination service (process 0) is gone or failing
        if time.monotonic() - self._last_round > self.timeout_s:
          self._end(f"lost process 0 of {self.n} (the coordination service does not answer: "
                    f"{_first_line(e)})")
        continue
      now = time.monotonic()
      self._last_round = now
      states = {}
      for key, value in got:
        try:
          q, info = int(key.rsplit("/", 1)[-1]), json.loads(value)
        except (ValueError, TypeError):
          continue
        if q == self.me or q not in self._seen:
          continue
        states[q] = info.get("state", "running")
        if info.get("beat") != self._seen[q][0]:
          self._seen[q] = (info.get("beat"), now)
        self._tokens[q] = info.get("token")
        if q in self.dropped and states[q] == "running" and \
            self._tokens[q] != self._dropped_token.get(q):
          self._back(q)
        if states[q] == "failed":
          why = f"process {q} of {self.n} failed ({info.get('why') or 'see its output'})"
          if q in self.droppable:
            self._drop(q, why)
          else:
            self._end(why)
      self._peer_states = states

  def _judge(self) -> None:
    while not self._stop.wait(min(1.0, self.interval_s)):
      now = time.monotonic()
      if now - self._last_round > self.timeout_s:
        self._end(f"lost process 0 of {self.n}: the coordination service it runs has not "
                  f"answered for {self.timeout_s:.0f} s (killed, crashed, hung or cut off)")
      for q, (_, changed) in sorted(self._seen.items()):
        if self._peer_states.get(q, "running") in ("done", "exiting") or q in self.dropped:
          continue
        if now - changed > self.timeout_s:
          why = (f"lost process {q} of {self.n}: no heartbeat for {self.timeout_s:.0f} s "
                 "(killed, crashed, hung or cut off)")
          if q in self.droppable:
            self._drop(q, why)
          else:
            self._end(why)

  def _drop(self, q: int, why: str) -> None:
    with self._lock:
      if q in self.dropped or self.verdict is not None:
        return
      self.dropped.add(q)
      self._dropped_token[q] = self._tokens.get(q)
    if self._on_lost is not None:
      self._on_lost(q, why)

  def _back(self, q: int) -> None:
    with self._lock:
      if q not in self.dropped:
        return
      self.dropped.discard(q)
    if self._on_back is not None:
      self._on_back(q)

  def _end(self, what: str) -> None:
    with self._lock:
      if self.verdict is not None or self._stop.is_set():
        return
      self.verdict = what
    self._set("exiting", what)  # the others do not count this process as lost
    self._stop.set()
    self._report(f"jaxrl: {what}; stopping process {self.me} too. Rerun the same command on "
                 "every process to resume from the last checkpoint "
                 "(distributed.peer_timeout_s sets how long a silent process is waited for)")
    self._exit(1)


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0][:200] if text else type(e).__name__


def _stderr(message: str) -> None:
  sys.stdout.flush()
  sys.stderr.write(message + "\n")
  sys.stderr.flush()


WATCH: PeerWatch | None = None  # this process's, once `watch` started it


def watch(timeout_s: float, interval_s: float | None = None, *, droppable=(),
          hold_exit: bool = False) -> PeerWatch | None:
  """Starts this process's `PeerWatch` (none for a single process or without a coordination
  service); returns it (also kept as `WATCH`). `droppable`, `hold_exit`: `PeerWatch`'s (the
  latter on process 0 only)."""
  global WATCH
  import jax

  client = coordination_client() if jax.process_count() > 1 else None
  if client is None:
    return None
  me = jax.process_index()
  try:  # an earlier start of this process beat in this run: this one joins it again
    client.key_value_try_get(f"{KEY}{me}")
    rejoined = True
  except Exception:  # noqa: BLE001  (NOT_FOUND)
    rejoined = False
  WATCH = PeerWatch(client, me, jax.process_count(), timeout_s, interval_s,
                    droppable=droppable, hold_exit=hold_exit and me == 0)
  WATCH.rejoined = rejoined
  WATCH.start()
  # Registered after JAX's own exit handler, so it runs first: a process that exits normally
  # (also on an error every process meets, e.g. a bad config) is done, not lost.
  atexit.register(WATCH.finish)
  return WATCH
