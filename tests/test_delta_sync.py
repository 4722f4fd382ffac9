"""Delta weight sync (`rollout.sync = "delta"`) and the checksum of every transported version.

Fast: `jaxrl.parallel.delta` rebuilds a version bit for bit from its base (bf16 weights after an
Adam-like step, f32, unchanged chunks, dense chunks, a tail shorter than a value) and rejects a
damaged payload; over a `VersionServer` on 127.0.0.1 a `VersionClient` gets a full copy first,
then deltas, a full copy after a missed version or when it asks for an older one, and a damaged
transfer (full or delta) is said in one line and fetched again in full; damaged every time, the
client stops with `TransferDamaged` (never returns the bytes).
Slow: a run disaggregated over 2 processes with `rollout.sync=delta`, a dropped version and a
damaged transfer injected, gives the rollout process the params of a `rollout.sync=full` run at
every version (the same crc32 per version) and the same per-step metrics.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from jaxrl.core.errors import UserError
from jaxrl.parallel import delta
from jaxrl.parallel.transport import (SyncFaults, TransferDamaged, VersionClient, VersionServer,
                                      fetch_version, request)
from processes import communicate, free_port
from test_distributed import _env
from test_multiprocess_disaggregated import ARGS, _rows
from test_multiprocess_rollouts import same_metrics


def _bf16_versions(n: int, steps: int, seed: int = 0) -> list[bytes]:
  """bf16 bytes of f32 weights ~ N(0, 0.02) after `steps` sign-Adam-like steps at lr 1e-6."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(n, dtype=np.float32) * 0.02
  out = [w.astype(ml_dtypes.bfloat16).tobytes()]
  for _ in range(steps):
    w = w - np.float32(1e-6) * np.sign(rng.standard_normal(n, dtype=np.float32))
    out.append(w.astype(ml_dtypes.bfloat16).tobytes())
  return out


def test_delta_rebuilds_bf16_updates_bit_for_bit_and_is_small():
  v0, v1 = _bf16_versions(1 << 20, 1)
  changed = np.count_nonzero(np.frombuffer(v0, np.uint16) != np.frombuffer(v1, np.uint16))
  # A step of 1e-6 against bf16's spacing near 0.02 (2^-6 x 2^-7 = 1.2e-4 at 0.016-0.031):
  # a few percent of the values change, not all and not none.
  assert 0.005 < changed / (1 << 20) < 0.2, changed
  d = delta.encode(v0, v1, 2)
  assert bytes(delta.decode(v0, d)) == v1
  # Each changed value costs about 3 bytes before zlib (a 1-byte gap, a 2-byte XOR) against 2
  # for every value of a full copy: under 1/4 of the full size here.
  assert len(d) < len(v1) / 4, (len(d), len(v1))
  assert len(delta.encode(v0, v0, 2)) < 100  # unchanged: a header and one entry per chunk


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_delta_rebuilds_any_bytes(itemsize):
  rng = np.random.default_rng(itemsize)
  n = delta.CHUNK * itemsize + 3 * itemsize + 1  # two chunks and a 1-byte tail
  base = rng.integers(0, 256, n, dtype=np.uint8)
  new = base.copy()
  new[rng.integers(0, n, 1000)] ^= rng.integers(1, 256, 1000, dtype=np.uint8)
  new[:4096] = rng.integers(0, 256, 4096, dtype=np.uint8)  # a dense run
  new[-1] ^= 0xFF  # the tail
  assert bytes(delta.decode(base.tobytes(), delta.encode(base.tobytes(), new.tobytes(),
                                                         itemsize))) == new.tobytes()
  dense = rng.integers(0, 256, n, dtype=np.uint8).tobytes()  # every value changes
  d = delta.encode(base.tobytes(), dense, itemsize)
  assert bytes(delta.decode(base.tobytes(), d)) == dense
  assert len(d) < n + 100  # sent whole chunk by chunk, not larger than the version


def test_a_damaged_delta_is_rejected_or_fails_its_checksum():
  v0, v1 = _bf16_versions(1 << 18, 1, seed=3)
  d = bytearray(delta.encode(v0, v1, 2))
  for at in (5, len(d) // 2, len(d) - 1):  # the header, a compressed stream, the last byte
    bad = bytearray(d)
    bad[at] ^= 0x40
    try:
      got = delta.decode(v0, bad)
    except ValueError:
      continue
    assert delta.checksum(got) != delta.checksum(v1)
  with pytest.raises(ValueError, match="not a delta of this base"):
    delta.decode(v0[:-2], bytes(d))
  with pytest.raises(ValueError, match="differ in length"):
    delta.encode(v0, v1[:-2], 2)


@pytest.fixture
def server():
  s = VersionServer(timeout_s=5, delta=2)
  yield s
  s.close()


def _client(server, **kw):
  said = []
  return VersionClient(server.address, delta=True, say=said.append, **kw), said


def test_a_client_gets_a_full_copy_then_deltas_then_full_after_a_missed_version(server):
  versions = _bf16_versions(1 << 18, 4, seed=1)
  for v in range(3):
    server.publish(v, versions[v])
  client, said = _client(server)
  full = VersionClient(server.address, delta=False)
  for v in range(3):
    assert bytes(client.fetch(v, 5)) == versions[v] == bytes(full.fetch(v, 5))
  assert client.stats["full"] == 1 and client.stats["delta"] == 2, client.stats
  assert full.stats["full"] == 3 and full.stats["delta"] == 0
  assert client.stats["bytes"] < full.stats["bytes"] / 2
  server.publish(3, versions[3])
  server.publish(4, versions[4])
  assert bytes(client.fetch(4, 5)) == versions[4]  # missed 3: its base (2) is not 4's (3)
  assert client.stats["full"] == 2 and client.stats["delta"] == 2
  assert bytes(client.fetch(3, 5)) == versions[3]  # older than held: full, base stays 4
  assert client.stats["full"] == 3 and said == []
  assert client.crcs == {v: delta.checksum(versions[v]) for v in range(5)}
  assert server.wait_idle(5.0)  # the last reply may be counted just after the client has it
  assert server.sent == {"full": 6, "delta": 2}
  assert "6 full" in server.summary() and "2 as deltas" in server.summary()


def test_a_dropped_version_makes_the_next_one_cross_in_full(server):
  versions = _bf16_versions(1 << 16, 3, seed=2)
  for v, data in enumerate(versions):
    server.publish(v, data)
  client, _ = _client(server, faults=SyncFaults.parse("drop=1"))
  assert [bytes(client.fetch(v, 5)) for v in range(4)] == versions
  # 0 full, 1 delta (not kept), 2 full (held 0, 2's delta is against 1), 3 delta
  assert (client.stats["full"], client.stats["delta"]) == (2, 2)


@pytest.mark.parametrize("fault, kind", [("damage=0", "full copy"), ("damage=1", "delta")])
def test_a_flipped_byte_falls_back_to_a_full_copy_with_one_line(server, fault, kind):
  versions = _bf16_versions(1 << 16, 2, seed=4)
  for v, data in enumerate(versions):
    server.publish(v, data)
  client, said = _client(server, faults=SyncFaults.parse(fault))
  assert [bytes(client.fetch(v, 5)) for v in range(3)] == versions
  assert len(said) == 1 and client.stats["damaged"] == 1, said
  v = int(fault.split("=")[1])
  assert said[0].startswith(f"jaxrl | params version {v} from ") and "asking for a full copy" \
      in said[0], said
  assert kind in said[0] or "does not decode" in said[0], said


def test_damaged_every_time_stops_the_receiver():
  server = VersionServer(timeout_s=5)  # full sync: the checksum is checked all the same
  server.publish(0, b"\1" * 1000)
  said = []
  client = VersionClient(server.address, say=said.append, faults=SyncFaults.parse("damage=0x9"))
  with pytest.raises(TransferDamaged, match=r"params version 0 .* failed its checksum 3 times"):
    client.fetch(0, 5)
  assert len(said) == 2 and client.stats["damaged"] == 3
  assert isinstance(TransferDamaged("x"), UserError)  # printed as one `jaxrl:` line
  reply = request(server.address, 0, 5)
  assert reply.kind == "full" and reply.crc == delta.checksum(b"\1" * 1000)
  assert fetch_version(server.address, 0, 5) == b"\1" * 1000
  server.close()


def test_clients_on_several_threads_each_get_their_own_deltas(server):
  versions = _bf16_versions(1 << 16, 3, seed=5)
  clients = [_client(server)[0] for _ in range(3)]
  got = {k: [] for k in range(3)}

  def fetch(k):
    for v in range(4):
      got[k].append(bytes(clients[k].fetch(v, 5)))

  threads = [threading.Thread(target=fetch, args=(k,)) for k in range(3)]
  for t in threads:
    t.start()
  for v, data in enumerate(versions):  # published while the clients wait
    server.publish(v, data)
  for t in threads:
    t.join(timeout=20)
  assert all(got[k] == versions for k in range(3))
  assert all(c.stats["delta"] == 3 for c in clients)


def test_bad_fault_spec_is_one_line():
  with pytest.raises(UserError, match=r"JAXRL_SYNC_FAULTS: 'flip=2' is not"):
    SyncFaults.parse("flip=2")
  faults = SyncFaults.from_env({"JAXRL_SYNC_FAULTS": "damage=3x2, drop=5"})
  assert faults.damage == {3: 2} and faults.drop == {5}
  assert faults.arrive(3, b"abcd") != b"abcd" and faults.arrive(4, b"abcd") == b"abcd"


def test_delta_sync_needs_rollout_processes():
  from jaxrl import config as config_lib
  from jaxrl.config import ConfigError
  from jaxrl.recipes.default import get_config

  cfg = get_config()
  cfg.rollout.sync = "delta"
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 1)
  assert any(p.startswith("config.rollout.sync: 'delta' needs config.mesh.rollout_processes")
             for p in e.value.problems), e.value.problems
  cfg.rollout.sync = "xor"
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 1)
  assert any(p.startswith("config.rollout.sync") for p in e.value.problems), e.value.problems


# -- across 2 processes (slow) -------------------------------------------------------------------

RECEIVED = re.compile(r"params versions received \((\w+) sync\): (\d+) full, (\d+) as deltas, "
                      r"([\d,]+) bytes, (\d+) damaged; digest ([0-9a-f]{8})")
SENT = re.compile(r"params versions sent: (\d+) full \(([\d,]+) bytes\), (\d+) as deltas "
                  r"\(([\d,]+) bytes\)")


# Every step changes the params (no lr warm-up; the entropy bonus has a gradient whatever the
# rewards, which this tiny untrained model rarely earns), and they cross in bf16, as a real
# run's samplers take them: some values change per step, others not.
UPDATES = ["--config.loss.entropy_coef=0.01", "--config.train.warmup_steps=0",
           "--config.rollout.dtype=bfloat16"]


def _start(run_dir, sync: str, faults: str = "", extra=()) -> list[subprocess.Popen]:
  port = free_port()
  return [subprocess.Popen(
      [sys.executable, "-m", "jaxrl.train", *ARGS, *UPDATES, *extra,
       "--config.mesh.rollout_processes=0",
       f"--config.rollout.sync={sync}", f"--config.run_dir={run_dir}"],
      env=_env(4, WORLD_SIZE="2", RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               JAXRL_SYNC_FAULTS=faults),
      cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]


@pytest.mark.slow
def test_delta_sync_across_two_processes_gives_the_full_sync_params(tmp_path):
  """Process 0 generates, process 1 trains (lag 1, 4 steps: versions 0..3 cross). Delta sync with
  version 1's first transfer damaged (a flipped byte) and version 2 dropped by the receiver: 0
  full, 1 a delta that fails its checksum (one line) then a full copy, 2 a delta not kept, 3 full
  (the receiver holds 1, 3's delta is against 2). Every version's crc32 on the rollout process
  equals the full-sync run's (the digest over them), and so do the per-step metrics."""
  full = communicate(_start(tmp_path / "full", "full"), 600)
  delta_outs = communicate(_start(tmp_path / "delta", "delta", "damage=1,drop=2"), 600)
  got_full, got_delta = RECEIVED.search(full[0]), RECEIVED.search(delta_outs[0])
  assert got_full and got_delta, (full[0][-2000:], delta_outs[0][-2000:])
  # full sync: 4 full copies, none damaged
  assert got_full.group(1, 2, 3, 5) == ("full", "4", "0", "0"), got_full.group(0)
  assert got_delta.group(1, 2, 3, 5) == ("delta", "3", "2", "1"), got_delta.group(0)
  assert got_delta.group(6) == got_full.group(6)  # the same bytes at every version
  damaged = [line for line in delta_outs[0].splitlines() if "asking for a full copy" in line]
  assert len(damaged) == 1 and "params version 1 from train process 1" in damaged[0], damaged
  sent_full, sent_delta = SENT.search(full[1]), SENT.search(delta_outs[1])
  assert sent_full and sent_delta, (full[1][-2000:], delta_outs[1][-2000:])
  assert (sent_full.group(1), sent_full.group(3)) == ("4", "0")
  assert (sent_delta.group(1), sent_delta.group(3)) == ("3", "2")
  # Each delta is smaller than a full copy (at this model's lr of 6e-4 about half the bf16
  # values change per step; at the 0.5B recipe's 1e-6 a few percent: benchmarks/delta_sync.py).
  one_full = int(sent_full.group(2).replace(",", "")) / 4
  assert int(sent_delta.group(4).replace(",", "")) < 2 * one_full, (sent_delta.group(0),
                                                                    one_full)
  base, rows = _rows(tmp_path / "full"), _rows(tmp_path / "delta")
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert same_metrics(base, rows) > 150


@pytest.mark.slow
def test_lora_delta_sync_across_two_processes_gives_the_full_sync_params(tmp_path):
  """LoRA keeps sending the base once, then adapters: 0 the base (full), 1 the first adapters
  (full: another length than the base's version), 2 a delta of adapters damaged (one line),
  then a full copy, 3 a delta. The same crc32 at every version as a full-sync LoRA run, and the
  same per-step metrics."""
  lora = ["--config.model.lora.rank=4"]
  full = communicate(_start(tmp_path / "full", "full", extra=lora), 600)
  outs = communicate(_start(tmp_path / "delta", "delta", "damage=2", extra=lora), 600)
  got_full, got = RECEIVED.search(full[0]), RECEIVED.search(outs[0])
  assert got_full and got, (full[0][-2000:], outs[0][-2000:])
  assert got_full.group(1, 2, 3, 5) == ("full", "4", "0", "0"), got_full.group(0)
  assert got.group(1, 2, 3, 5) == ("delta", "3", "2", "1"), got.group(0)
  assert got.group(6) == got_full.group(6)
  assert "the base once" in outs[1], outs[1][-2000:]
  damaged = [line for line in outs[0].splitlines() if "asking for a full copy" in line]
  assert len(damaged) == 1 and "params version 2 from train process 1" in damaged[0], damaged
  assert same_metrics(_rows(tmp_path / "full"), _rows(tmp_path / "delta")) > 150
