"""`PeerWatch` against an in-memory key-value store: a silent process, a failed one, the store
itself gone, and processes that finish are told apart, each in bounded time. (The same watch in
real runs, SIGKILL and SIGTERM across two processes: `test_multiprocess_faults`.)"""

from __future__ import annotations

import threading
import time

from jaxrl.parallel.peers import PeerWatch


class Store:
  """The two calls PeerWatch makes, on a dict; `down` makes every call fail."""

  def __init__(self):
    self.data, self.down, self.lock = {}, False, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    with self.lock:
      assert allow_overwrite or key not in self.data
      self.data[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    with self.lock:
      return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


def _watch(store, me, n, timeout=0.6, ended=None):
  ended = ended if ended is not None else []

  def exit(code):
    ended.append(code)

  reports = []
  w = PeerWatch(store, me, n, timeout, interval_s=0.05, exit=exit, report=reports.append)
  return w, ended, reports


def _wait(cond, seconds=5.0):
  deadline = time.monotonic() + seconds
  while not cond():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


def test_a_silent_process_is_named_after_the_timeout():
  store = Store()
  a, a_ended, a_reports = _watch(store, 0, 3)
  b, b_ended, _ = _watch(store, 1, 3)
  c, _, _ = _watch(store, 2, 3)
  for w in (a, b, c):
    w.start()
  time.sleep(0.3)
  assert a_ended == [] and a_reports == []  # everyone beats: nobody is lost
  c.stop()  # process 2 goes silent (SIGKILL, SIGSTOP, a lost host)
  t0 = time.monotonic()
  _wait(lambda: a_ended and b_ended)
  took = time.monotonic() - t0
  assert 0.5 <= took < 3.0, took  # not before the timeout (0.6 s), soon after it
  assert a_ended == [1] and b_ended == [1]
  assert len(a_reports) == 1 and "lost process 2 of 3" in a_reports[0], a_reports
  assert a_reports[0].startswith("jaxrl: ") and "resume" in a_reports[0]
  for w in (a, b):
    w.stop()


def test_a_failed_process_ends_the_others_at_once_with_its_reason():
  store = Store()
  a, a_ended, a_reports = _watch(store, 0, 2, timeout=30)
  b, b_ended, b_reports = _watch(store, 1, 2, timeout=30)
  a.start()
  b.start()
  t0 = time.monotonic()
  b.fail("ValueError: bad row 7 in data/train.jsonl")  # returns once process 0 has ended
  assert time.monotonic() - t0 < 3.0  # far below the 30 s timeout
  assert a_ended == [1] and b_ended == []
  assert "process 1 of 2 failed (ValueError: bad row 7 in data/train.jsonl)" in a_reports[0]
  a.stop()
  b.stop()


def test_a_finished_process_is_not_lost():
  store = Store()
  a, a_ended, _ = _watch(store, 0, 2, timeout=0.4)
  b, _, _ = _watch(store, 1, 2, timeout=0.4)
  a.start()
  b.start()
  time.sleep(0.2)
  b.finish()  # done: its heartbeat stops, and that is fine
  time.sleep(1.2)
  assert a_ended == []
  a.stop()


def test_the_store_gone_means_process_0_is_lost():
  store = Store()
  b, b_ended, b_reports = _watch(store, 1, 2, timeout=0.5)
  store.key_value_set("jaxrl/peers/0", '{"beat": 0, "state": "running", "why": ""}')
  b.start()
  store.down = True  # process 0, which runs the coordination service, is gone
  _wait(lambda: b_ended)
  assert b_ended == [1] and "lost process 0 of 2" in b_reports[0], b_reports
  b.stop()


def test_a_process_that_never_beat_is_lost_too():
  # A process that died before its first heartbeat (e.g. while compiling its first step).
  store = Store()
  a, a_ended, a_reports = _watch(store, 0, 2, timeout=0.6)
  a.start()
  _wait(lambda: a_ended)
  assert "lost process 1 of 2" in a_reports[0]
  a.stop()
