"""A rollout process lost mid-run (docs/failures.md, "Rollout processes that come and go"):
3 CPU processes of 4 devices (process 0 trains, 1 and 2 generate), 16 steps at lag 1,
`distributed.peer_timeout_s=5`; with `--kill 1`, SIGKILL of process 2 once two steps are logged.
Prints the exit codes, when the train process named the drop (seconds after the kill), the
wall-clock gaps between logged steps, each step's first-token staleness and the summary line.

  python benchmarks/rollout_failover.py RUN_DIR --kill 1    (then --kill 0 for the baseline)
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("run")
parser.add_argument("--kill", type=int, default=1)
opts = parser.parse_args()
run, kill = opts.run, opts.kill == 1
with socket.socket() as s:
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
ARGS = ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
        "--config.sft.enabled=false", "--config.train.steps=16", "--config.task.dev_size=16",
        "--config.task.val_size=16", "--config.val.batch_size=16", "--config.val.at_start=false",
        "--config.val.every=8", "--config.rollout.num_prompts=8", "--config.rollout.lag=1",
        "--config.mesh.data=-1", "--config.mesh.rollout_processes=1,2",
        "--config.distributed.peer_timeout_s=5", f"--config.run_dir={run}"]
env = dict(os.environ, JAX_PLATFORMS="cpu", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
           MASTER_PORT=str(port), XLA_FLAGS="--xla_force_host_platform_device_count=4")
procs = [subprocess.Popen([sys.executable, "-m", "jaxrl.train", *ARGS],
                          env={**env, "RANK": str(i)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) for i in range(3)]
lines = []  # (when, line) of the train process's output


def read() -> None:
  for line in procs[0].stdout:
    lines.append((time.time(), line.rstrip()))


def rows() -> list[dict]:
  try:
    with open(os.path.join(run, "metrics.jsonl")) as f:
      return [r for r in map(json.loads, f) if r.get("phase") == "rl"]
  except (OSError, ValueError):
    return []


threading.Thread(target=read, daemon=True).start()
for p in procs[1:]:
  threading.Thread(target=p.communicate, daemon=True).start()
while len(rows()) < 2:
  time.sleep(0.05)
t_kill = time.time()
if kill:
  procs[2].send_signal(signal.SIGKILL)
procs[0].wait()
procs[1].wait()
time.sleep(0.5)
got = rows()
elapsed = [r["perf/elapsed_s"] for r in got]
print("rc", procs[0].returncode, procs[1].returncode, "steps", len(got))
print("drop named after", [round(t - t_kill, 1) for t, line in lines if "dropped" in line], "s")
print("step gaps (s)", [round(b - a, 2) for a, b in zip(elapsed, elapsed[1:])])
print("staleness", [r["staleness/first_token/max"] for r in got])
print([line for _, line in lines if "groups made" in line])
procs[2].kill()
