"""What JAX's distributed runtime does when one of three processes is lost: the facts the design
of rollout processes that come and go rests on (docs/failures.md, "Rollout processes that come
and go"). CPU only, three processes on 127.0.0.1.

Processes 0 and 1 (the "train side") run a small collective among themselves and write to the
coordination service's key-value store every 0.5 s for `--seconds`; process 2 (a "rollout
process") only joins and reads the store. The probe then kills (SIGKILL), restarts or hangs
(SIGSTOP, later SIGCONT) process 2 and reports, per process, how far it got and how it ended.

  python benchmarks/lost_peer_probe.py --scenario kill --recoverable 0
  python benchmarks/lost_peer_probe.py --scenario kill_restart --recoverable 0
  python benchmarks/lost_peer_probe.py --scenario kill_restart --recoverable 1
  python benchmarks/lost_peer_probe.py --scenario stop --recoverable 1
  python benchmarks/lost_peer_probe.py --scenario checkpoint --recoverable 1
  python benchmarks/lost_peer_probe.py --scenario bandwidth

`--recoverable 1` sets `jax_enable_recoverability` on every process before
`jax.distributed.initialize`. `checkpoint`: SIGKILL of process 2, then processes 0 and 1 save
and restore an array of theirs with Orbax on those two processes only
(`MultiprocessingOptions(active_processes={0, 1})`). `bandwidth` times 64 MiB through the key-value store (the
`jaxrl.parallel.bridge.Channel` chunks) between two processes, and 256 MiB over a plain TCP
socket on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HEARTBEAT_S = 5


def child(pid: int, port: int, recoverable: bool, seconds: float, ckpt: str = "") -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_recoverability", recoverable)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  t0 = time.time()

  def say(*a):
    print(f"probe {pid} t={time.time() - t0:.1f}", *a, flush=True)

  jax.distributed.initialize(f"127.0.0.1:{port}", 3, pid, heartbeat_timeout_seconds=HEARTBEAT_S,
                             initialization_timeout=60)
  from jaxrl.parallel.peers import coordination_client

  client = coordination_client()
  say("joined", jax.process_count(), "processes")
  if pid == 2:
    while time.time() - t0 < seconds:
      say("store", len(client.key_value_dir_get("k/")), "keys")
      time.sleep(1)
    return
  devs = [d for d in jax.devices() if d.process_index in (0, 1)]
  mesh = Mesh(np.asarray(devs), ("x",))
  total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
  mine = [d for d in devs if d.process_index == pid]
  # A fixed number of rounds (the collective keeps the two in step), so both end together.
  for i in range(int(seconds * 2)):
    x = jax.make_array_from_single_device_arrays(
        (len(devs),), NamedSharding(mesh, P("x")),
        [jax.device_put(np.ones(1, np.float32), d) for d in mine])
    s = float(total(x).addressable_shards[0].data)
    client.key_value_set(f"k/{pid}/{i}", "v")
    say("collective", s, "store ok")
    time.sleep(0.5)
    if ckpt and i == 28:  # (the same step on both) process 2 killed, its heartbeat missed
      _save_and_restore(ckpt, mesh, pid, say)
      ckpt = ""
  say("done")


def _save_and_restore(directory: str, mesh, pid: int, say) -> None:
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  sharding = NamedSharding(mesh, P("x"))
  mine = [d for d in mesh.devices.flat if d.process_index == pid]
  x = jax.make_array_from_single_device_arrays(
      (mesh.devices.size, 4), sharding,
      [jax.device_put(np.full((1, 4), d.id, np.float32), d) for d in mine])
  os.makedirs(directory, exist_ok=True)  # Orbax does not create it with active_processes
  options = ocp.CheckpointManagerOptions(
      create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
          primary_host=0, active_processes={0, 1}))
  with ocp.CheckpointManager(directory, options=options) as mgr:
    mgr.save(1, args=ocp.args.StandardSave({"x": x}))
    mgr.wait_until_finished()
    abstract = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
    back = mgr.restore(1, args=ocp.args.StandardRestore(abstract))["x"]
  same = all(np.array_equal(np.asarray(a.data), np.asarray(b.data))
             for a, b in zip(x.addressable_shards, back.addressable_shards))
  say("checkpoint saved and restored", "equal" if same else "DIFFERENT")


def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()


def _last(path: str, word: str) -> str:
  with open(path, errors="replace") as f:
    lines = [ln for ln in f.read().splitlines() if word in ln]
  return lines[-1] if lines else "-"


def scenario(name: str, recoverable: bool, seconds: float = 30.0) -> None:
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  out = tempfile.mkdtemp(prefix="lost_peer_probe_")

  def start(pid, tag=""):
    with open(f"{out}/{pid}{tag}.log", "w") as log:
      return subprocess.Popen([sys.executable, __file__, "--child", str(pid), "--port", str(port),
                               "--recoverable", str(int(recoverable)), "--seconds",
                               str(seconds), "--ckpt", ckpt], stdout=log, stderr=subprocess.STDOUT, env=env)

  ckpt = os.path.join(out, "ckpt") if name == "checkpoint" else ""
  procs = {p: start(p) for p in range(3)}
  deadline = time.time() + 120
  while not all("joined" in _read(f"{out}/{p}.log") for p in range(3)):
    if time.time() > deadline:
      raise SystemExit(f"the three processes did not join in 120 s; logs in {out}")
    time.sleep(0.2)
  time.sleep(3)  # a few rounds of the collective
  events = []
  if name in ("kill", "kill_restart", "checkpoint"):
    procs[2].send_signal(signal.SIGKILL)
    events.append(f"3 s after all joined: SIGKILL to process 2 (heartbeat timeout {HEARTBEAT_S} s)")
  if name == "kill_restart":
    time.sleep(10)
    procs["2b"] = start(2, "b")
    events.append("10 s later: process 2 started again with the same id")
  if name == "stop":
    procs[2].send_signal(signal.SIGSTOP)
    events.append(f"3 s after all joined: SIGSTOP to process 2 (heartbeat timeout {HEARTBEAT_S} s)")
    time.sleep(15)
    procs[2].send_signal(signal.SIGCONT)
    events.append("15 s later: SIGCONT to process 2")
  for p in procs.values():
    try:
      p.wait(timeout=seconds + 40)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  print(f"scenario {name}, jax_enable_recoverability={recoverable}:")
  for e in events:
    print("  " + e)
  for key, p in procs.items():
    log = f"{out}/{key}.log"
    with open(log, errors="replace") as f:
      text = f.read()
    fatal = "Terminating process because the JAX distributed service" in text
    last = _last(log, "probe ")
    if name == "checkpoint" and key != 2:
      print(f"  process {key}: {_last(log, 'checkpoint')!r}")
    print(f"  process {key}: rc {p.returncode}, last line {last!r}"
          f"{', ended by the runtime (fatal errors)' if fatal else ''}")
  shutil.rmtree(out, ignore_errors=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def bandwidth_child(pid: int, port: int, mib: int) -> None:
  import jax

  jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=60)
  import numpy as np

  from jaxrl.parallel.bridge import Channel

  ch = Channel(prefix="bw/")
  data = np.random.default_rng(0).bytes(mib << 20)
  for rep in range(3):
    if pid == 1:
      t = time.time()
      ch.put_bytes(f"x{rep}", data)
      ch.set(f"put{rep}", str(time.time() - t))
    else:
      t = time.time()
      got = ch.take_bytes(f"x{rep}")
      took = time.time() - t
      assert got == data
      print(f"  key-value store, {mib} MiB from process 1 to process 0: put "
            f"{float(ch.wait(f'put{rep}')):.2f} s, take {took:.2f} s "
            f"({mib / took:.0f} MiB/s)", flush=True)
  ch.set(f"end{pid}", "1")
  ch.wait(f"end{1 - pid}")


def bandwidth() -> None:
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, __file__, "--bandwidth_child", str(p), "--port",
                             str(port)], env=env, stderr=subprocess.DEVNULL) for p in (0, 1)]
  for p in procs:
    p.wait(timeout=300)
  n = 256 << 20
  data = bytes(n)
  srv = socket.create_server(("127.0.0.1", 0))

  def serve():
    for _ in range(3):
      c, _ = srv.accept()
      c.sendall(data)
      c.close()

  threading.Thread(target=serve, name="probe-sender", daemon=True).start()
  for _ in range(3):
    s = socket.create_connection(srv.getsockname())
    buf = memoryview(bytearray(n))
    got, t = 0, time.time()
    while got < n:
      got += s.recv_into(buf[got:], min(1 << 22, n - got))
    dt = time.time() - t
    s.close()
    print(f"  TCP socket, 256 MiB on 127.0.0.1: {dt:.2f} s ({256 / dt:.0f} MiB/s)")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--scenario", choices=["kill", "kill_restart", "stop", "checkpoint",
                                         "bandwidth"])
  ap.add_argument("--ckpt", default="")
  ap.add_argument("--recoverable", type=int, default=0)
  ap.add_argument("--seconds", type=float, default=30.0)
  ap.add_argument("--child", type=int, default=None)
  ap.add_argument("--bandwidth_child", type=int, default=None)
  ap.add_argument("--port", type=int, default=0)
  a = ap.parse_args()
  if a.child is not None:
    child(a.child, a.port, bool(a.recoverable), a.seconds, a.ckpt)
  elif a.bandwidth_child is not None:
    bandwidth_child(a.bandwidth_child, a.port, 64)
  elif a.scenario == "bandwidth":
    bandwidth()
  elif a.scenario:
    scenario(a.scenario, bool(a.recoverable), a.seconds)
  else:
    ap.error("--scenario is required")


if __name__ == "__main__":
  main()
