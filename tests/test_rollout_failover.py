"""Rollout processes that come and go (docs/failures.md): `PeerWatch` drops a lost droppable
process instead of ending this one, and takes it back when a new start of it beats; the
`VersionServer` serves params versions over TCP and a lost client costs it nothing; and the
facts about JAX's runtime the design rests on (`benchmarks/lost_peer_probe.py`, slow)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model_config
from jaxrl.models.transformer import abstract_model
from jaxrl.parallel import make_mesh, param_shardings
from jaxrl.parallel.bridge import ParamsBridge, VersionGone, VersionServer, fetch_version
from jaxrl.parallel.peers import KEY, PeerWatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Store:
  """The two calls PeerWatch makes, on a dict."""

  def __init__(self):
    self.data, self.lock = {}, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      assert allow_overwrite or key not in self.data
      self.data[key] = value

  def key_value_dir_get(self, prefix):
    with self.lock:
      return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


class Watched:
  """One process's watch, with what it reported."""

  def __init__(self, store, me, n, droppable=(), timeout=0.5):
    self.ended, self.reports, self.lost, self.back = [], [], [], []
    self.watch = PeerWatch(store, me, n, timeout, interval_s=0.05, exit=self.ended.append,
                           report=self.reports.append, droppable=droppable,
                           on_lost=lambda q, why: self.lost.append((q, why)),
                           on_back=self.back.append)

  def start(self):
    self.watch.start()
    return self


def _wait(cond, seconds=5.0):
  deadline = time.monotonic() + seconds
  while not cond():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


def test_a_lost_rollout_process_is_dropped_and_the_others_go_on():
  store = Store()
  rollout = (1, 2)
  train = Watched(store, 0, 3, rollout).start()
  other = Watched(store, 1, 3, rollout).start()
  lost = Watched(store, 2, 3, rollout).start()
  time.sleep(0.3)
  assert train.lost == [] and other.lost == []  # everyone beats
  lost.watch.stop()  # SIGKILL or SIGSTOP: its heartbeat stops
  t0 = time.monotonic()
  _wait(lambda: train.lost and other.lost)
  took = time.monotonic() - t0
  assert 0.4 <= took < 3.0, took  # not before the timeout (0.5 s), soon after it
  assert [q for q, _ in train.lost] == [2] and "lost process 2 of 3" in train.lost[0][1]
  assert train.watch.dropped == {2} and other.watch.dropped == {2}
  time.sleep(0.8)  # past another timeout: dropped once, nothing ended
  assert len(train.lost) == 1 and train.ended == [] and other.ended == []
  assert train.reports == []
  for w in (train, other):
    w.watch.stop()


def test_a_lost_train_process_still_ends_the_others():
  store = Store()
  rollout = (1, 2)
  trainer = Watched(store, 0, 3, rollout).start()
  a = Watched(store, 1, 3, rollout).start()
  b = Watched(store, 2, 3, rollout).start()
  time.sleep(0.2)
  trainer.watch.stop()
  _wait(lambda: a.ended and b.ended)
  assert a.ended == [1] and b.ended == [1] and a.lost == [] and b.lost == []
  assert "lost process 0 of 3" in a.reports[0] and a.reports[0].startswith("jaxrl: ")
  for w in (a, b):
    w.watch.stop()


def test_the_same_process_started_again_is_taken_back():
  store = Store()
  train = Watched(store, 0, 2, (1,)).start()
  first = Watched(store, 1, 2, (1,)).start()
  time.sleep(0.2)
  first.watch.stop()
  _wait(lambda: train.lost)
  assert train.back == []
  again = Watched(store, 1, 2, (1,)).start()  # the same command, the same process id
  _wait(lambda: train.back)
  assert train.back == [1] and train.watch.dropped == set()
  time.sleep(0.8)  # it beats: not dropped again
  assert len(train.lost) == 1
  again.watch.stop()  # and lost again: dropped again
  _wait(lambda: len(train.lost) == 2)
  assert train.ended == []
  train.watch.stop()


def test_a_hung_process_that_wakes_up_is_not_taken_back():
  # A process stopped past the timeout and then resumed (SIGSTOP, SIGCONT) is ended by JAX's
  # runtime at once (docs/failures.md); the few beats it may write first are its old start's.
  store = Store()
  train = Watched(store, 0, 2, (1,)).start()
  hung = Watched(store, 1, 2, (1,)).start()
  time.sleep(0.2)
  hung.watch.stop()
  _wait(lambda: train.lost)
  old = json.loads(store.data[f"{KEY}1"])
  store.key_value_set(f"{KEY}1", json.dumps({**old, "beat": old["beat"] + 5}),
                      allow_overwrite=True)
  time.sleep(0.4)
  assert train.back == [] and train.watch.dropped == {1}
  train.watch.stop()


def test_process_0_holds_its_exit_until_the_others_are_done_or_dropped():
  """With recoverability on JAX's shutdown barrier holds nobody: process 0, which runs the
  coordination service, must not exit while another process still needs it."""
  store = Store()
  train = PeerWatch(store, 0, 3, 0.5, interval_s=0.05, exit=lambda code: None,
                    report=lambda line: None, droppable=(2,), hold_exit=True).start()
  rollout = Watched(store, 1, 3, (2,)).start()
  lost = Watched(store, 2, 3, (2,)).start()
  time.sleep(0.2)
  finished = threading.Event()
  threading.Thread(target=lambda: (train.finish(), finished.set()), daemon=True).start()
  lost.watch.stop()  # killed: dropped after the timeout
  time.sleep(1.2)
  assert not finished.is_set() and train.dropped == {2}  # process 1 still runs
  rollout.watch.finish()
  assert finished.wait(3)
  rollout.watch.stop()


def test_listening_late_hears_of_a_process_dropped_before():
  store = Store()
  train = PeerWatch(store, 0, 2, 0.5, interval_s=0.05, exit=lambda code: None,
                    report=lambda line: None, droppable=(1,)).start()
  rollout = Watched(store, 1, 2, (1,)).start()
  time.sleep(0.2)
  rollout.watch.stop()
  _wait(lambda: train.dropped)
  heard = []
  train.listen(lambda q, why: heard.append(q))
  assert heard == [1]
  train.stop()


def test_a_rollout_process_that_fails_is_dropped():
  store = Store()
  train = Watched(store, 0, 2, (1,), timeout=30).start()
  rollout = Watched(store, 1, 2, (1,), timeout=30).start()
  time.sleep(0.2)
  rollout.watch.fail("ValueError: out of memory while decoding", wait_s=0.3)
  _wait(lambda: train.lost)
  assert train.lost[0][0] == 1 and "out of memory while decoding" in train.lost[0][1]
  assert train.ended == []
  train.watch.stop()


def _bytes(n, seed):
  return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_versions_reach_several_clients_whole():
  server = VersionServer(timeout_s=5)
  v0, v1 = _bytes(3 << 20, 0), _bytes(1 << 20, 1)
  server.publish(0, v0)
  got = {}

  def fetch(k, v):
    got[k] = fetch_version(server.address, v, timeout_s=5)

  threads = [threading.Thread(target=fetch, args=(k, k % 2)) for k in range(4)]
  for t in threads:
    t.start()
  time.sleep(0.3)
  server.publish(1, v1)  # the clients asking for it wait until it is published
  for t in threads:
    t.join(timeout=10)
  assert got == {0: v0, 1: v1, 2: v0, 3: v1}
  # A client has its bytes a moment before the server's thread counts the version sent.
  deadline = time.monotonic() + 5
  while server.served < 4 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert server.served == 4 and server.failed == []
  server.close()


def test_retired_unpublished_and_gone_are_told_apart():
  server = VersionServer(timeout_s=0.3)
  server.publish(3, b"x")
  server.retire_below(3)
  assert fetch_version(server.address, 3, timeout_s=1) == b"x"
  with pytest.raises(VersionGone, match="version 2 is retired"):
    fetch_version(server.address, 2, timeout_s=1)
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match="version 4 not published"):
    fetch_version(server.address, 4, timeout_s=1)
  assert time.monotonic() - t0 < 2  # the server's own wait (0.3 s) answers
  address = server.address
  server.close()
  with pytest.raises(ConnectionError):
    fetch_version(address, 3, timeout_s=1)


def test_a_client_lost_mid_transfer_costs_the_server_nothing():
  server = VersionServer(timeout_s=5)
  data = _bytes(64 << 20, 2)
  server.publish(0, data)
  host, port = server.address.rsplit(":", 1)
  lost = socket.create_connection((host, int(port)))
  lost.sendall(b"0\n")
  assert len(lost.recv(1000)) > 0  # the transfer has started
  lost.close()  # SIGKILL of the rollout process, mid-version
  _wait(lambda: server.failed)
  assert fetch_version(server.address, 0, timeout_s=5) == data  # the others are served
  assert server.wait_idle(5.0)
  assert server.served == 1 and len(server.failed) == 1
  server.close()


# (train devices, rollout devices): R = T, R > T, R < T
@pytest.mark.parametrize("train, rollout", [(4, 4), (2, 6), (3, 1)])
@pytest.mark.parametrize("wire", [jnp.float32, jnp.bfloat16])
def test_params_cross_whole_over_the_version_server(devices, train, rollout, wire):
  """The train side's rows of a version (`host_rows`), served and fetched over TCP, unpack on
  the rollout devices (`from_rows`) into the params bit for bit in the wire dtype, laid out by
  the rollout mesh's own shardings."""
  _, abstract = abstract_model(tiny_model_config(vocab_size=64))
  rng = np.random.default_rng(0)
  values = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)
  params = jax.device_put(values, param_shardings(abstract, make_mesh(train, 1, 1,
                                                                       devices[:train])))
  group = devices[train:train + rollout]
  bridge = ParamsBridge(devices[:train], [group], abstract, wire)
  layout = param_shardings(abstract, make_mesh(1, 1, len(group), group))
  server = VersionServer(timeout_s=5)
  server.publish(7, bridge.host_rows(params))
  got = bridge.from_rows({0: fetch_version(server.address, 7, timeout_s=5)}, layout)
  server.close()
  for a, b, sh in zip(jax.tree.leaves(got), jax.tree.leaves(values), jax.tree.leaves(layout)):
    assert a.dtype == wire and a.sharding == sh
    np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(b).astype(wire)))
  with pytest.raises(ValueError, match="process 0 sent"):
    bridge.from_rows({0: b"\0" * 8}, layout)


def _probe(scenario: str, recoverable: int) -> dict:
  run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "lost_peer_probe.py"),
                        "--scenario", scenario, "--recoverable", str(recoverable)],
                       capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  got = {}
  for m in re.finditer(r"process (\w+): rc (-?\d+), last line '([^']*)'(, ended by the runtime)?",
                       run.stdout):
    got[m.group(1)] = (int(m.group(2)), m.group(3), bool(m.group(4)))
  assert set(got) >= {"0", "1", "2"}, run.stdout
  return got


@pytest.mark.slow
def test_without_recoverability_jax_ends_the_job_when_a_process_is_lost():
  got = _probe("kill", 0)
  for q in ("0", "1"):  # never in a program with process 2, yet ended by the runtime
    rc, last, fatal = got[q]
    assert fatal and rc != 0 and "done" not in last, got


@pytest.mark.slow
def test_with_recoverability_the_others_go_on_and_the_lost_one_rejoins():
  got = _probe("kill_restart", 1)
  for q in ("0", "1"):
    assert got[q][1].endswith("done"), got  # their collective and the store kept working
  last = got["2b"][1]
  assert re.search(r"store \d+ keys", last), got  # joined again with the same id
