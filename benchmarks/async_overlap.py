"""Forced lag overlaps generation with training: RL steps/s at lag 0 and lag 1.

The default recipe's RL loop (`jaxrl.run.driver.rl`: worker thread, lag gate, train step) on the
default model, without the supervised warm-up, with a reward function that takes a fixed time per
batch (as an LLM judge or a code sandbox would). By default that time is the trainer's share of
a lag-0 step measured first without a delay (step time minus sampling time: the train step and
its bookkeeping), so scoring and training take about as long. At lag 0 the trainer waits for
every batch; at lag 1 the worker generates and scores batch t+1 while step t trains.

`--processes N` runs the same on N processes joined on 127.0.0.1 (gloo; `--devices` simulated CPU
devices each, the mesh's 'data' axis over all of them): each process's rollout worker makes its
share of every batch on its own devices while the trainer threads train, publish and assemble
batches in lockstep; each process's reward sleeps the delay for its share (the default delay is
measured as on one process, `perf/sample_time_s` being the slowest process's). Process 0
reports.

`--processes N --rollout-processes 0` runs it disaggregated across processes
(`mesh.rollout_processes`, through `jaxrl.run.driver.run` in a temporary run directory): process 0
generates and scores (sleeping the whole delay per batch), the others train; at lag 1 process 0
makes batch t+1 while step t trains. The first train process reports.

Prints ONE JSON object (progress on stderr). Runs alternate lag 0 and lag 1; steps/s per run
is wall-clock steps per second from the end of step `skip + 1` to the end of the last step
(the first steps compile; evaluation runs only before and after); `speedup` is the median over
pairs of the lag-1 / lag-0 ratio.

  PYTHONPATH=. python benchmarks/async_overlap.py [--steps 40] [--repeats 3] [--reward-delay-s X]
  PYTHONPATH=. python benchmarks/async_overlap.py --quick
  PYTHONPATH=. python benchmarks/async_overlap.py --sampler-first off   # the two split the cores
  PYTHONPATH=. python benchmarks/async_overlap.py --processes 2 [--devices 1]
  PYTHONPATH=. python benchmarks/async_overlap.py --processes 2 --rollout-processes 0
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import driver
from jaxrl.run import loop
from jaxrl.run.topology import Topology
from jaxrl.run.parts import build_parts
from jaxrl.recipes.default import get_config


REPORTER = [0]  # the process that logs and reports
RUNS = [0]  # disaggregated runs so far


def log(*a):
  if jax.process_index() == REPORTER[0]:
    print(*a, file=sys.stderr, flush=True)


def run(lag: int, steps: int, delay: float, skip: int, rollout: str = "",
        run_root: str = "", sampler_first: str = "auto") -> dict:
  cfg = get_config()
  cfg.sft.enabled = False
  cfg.train.steps = steps
  cfg.rollout.lag = lag
  cfg.rollout.sampler_first = sampler_first
  # No validation: an asynchronous pass would share the CPU with the timed steps.
  cfg.val.every = 10**6
  cfg.val.at_start = cfg.val.at_end = False
  if jax.process_count() > 1:
    cfg.mesh.data = -1  # rows over every process's devices
  if rollout:
    return run_disaggregated(cfg, rollout, delay, skip, run_root)
  rows, _ = rl_with_slow_reward(cfg, delay)
  return summarize(lag, [r for r in rows if r["step"] > skip])


def rl_with_slow_reward(cfg, delay: float) -> tuple[list[dict], str]:
  """`loop.rl` on `cfg` (validated here) with the `add` task's reward call made `delay` seconds
  slower per batch (the benchmarks' only seam: an LLM judge or a code sandbox is this slow): its
  RL metrics rows and its console text."""
  mesh = config_lib.validate(cfg, jax.device_count(), num_processes=jax.process_count())
  parts, params = build_parts(cfg, mesh)
  env = parts.envs["add"]
  score = env.step

  def slow_step(turns):  # one environment call per batch (one task, one turn)
    time.sleep(delay)
    return score(turns)

  env.step = slow_step
  console = io.StringIO()
  with tempfile.TemporaryDirectory() as d:
    out = metrics_lib.MetricsWriter(d)
    try:
      loop.rl(parts, params, Topology.of(parts),
              loop.RunIO(out, metrics_lib.Progress(stream=console)))
    finally:
      out.close()
    rows = [r for r in out.rows if r.get("phase") == "rl"]
  return rows, console.getvalue()


def run_disaggregated(cfg, rollout: str, delay: float, skip: int, run_root: str) -> dict | None:
  """`run` disaggregated across processes: the rows of the train side (None on a rollout
  process)."""
  from jaxrl.envs.arithmetic import AddEnvironment

  cfg.mesh.rollout_processes = rollout
  cfg.checkpoint.every = 10**6
  RUNS[0] += 1  # the same count on every process: one run directory for all of them
  cfg.run_dir = os.path.join(run_root, f"run{RUNS[0]}-lag{cfg.rollout.lag}")
  mesh = config_lib.validate(cfg, jax.device_count(), num_processes=jax.process_count())
  score = AddEnvironment.step

  def slow_step(self, turns):  # one environment call per batch (one task, one turn)
    time.sleep(delay)
    return score(self, turns)

  AddEnvironment.step = slow_step
  try:
    driver.run(cfg, cfg.run_dir, mesh)
  finally:
    AddEnvironment.step = score
  if jax.process_index() != REPORTER[0]:
    return None
  with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if r.get("phase") == "rl" and r["step"] > skip]
  return summarize(cfg.rollout.lag, rows)


def summarize(lag: int, rows: list[dict]) -> dict:
  times = [r["perf/step_time_s"] for r in rows]
  train = [r["perf/step_time_s"] - r["perf/sample_time_s"] for r in rows]
  # Wall clock between step completions: includes the trainer's per-step bookkeeping (metrics,
  # logging), during which a lagged worker keeps generating.
  wall = rows[-1]["perf/elapsed_s"] - rows[0]["perf/elapsed_s"]
  return {"lag": lag, "steps_per_s": (len(rows) - 1) / wall,
          "median_step_s": statistics.median(times),
          "median_sample_s": statistics.median(r["perf/sample_time_s"] for r in rows),
          "median_train_s_at_lag0": statistics.median(train) if lag == 0 else None,
          "trainer_wait_s": rows[-1]["pipeline/trainer_wait_s"],
          "staleness_first_token_max": max(r["staleness/first_token/max"] for r in rows)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--skip", type=int, default=5, help="first steps excluded (compilation)")
  ap.add_argument("--reward-delay-s", type=float, default=0.0,
                  help="seconds per batch in the reward function; 0 = the measured train step")
  ap.add_argument("--sampler-first", default="auto", choices=("auto", "on", "off"),
                  help="rollout.sampler_first (auto: the train step lets the worker's sampler "
                       "call go first, colocated on a CPU)")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--processes", type=int, default=1,
                  help="processes joined on 127.0.0.1 (gloo), each with --devices CPU devices")
  ap.add_argument("--devices", type=int, default=1, help="simulated CPU devices per process")
  ap.add_argument("--rollout-processes", default="",
                  help="e.g. '0': those processes only generate (mesh.rollout_processes)")
  ap.add_argument("--run-root", default="", help=argparse.SUPPRESS)
  ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.rollout_processes and args.processes < 2:
    ap.error("--rollout-processes needs --processes >= 2")
  if args.processes > 1 and args.process_id is None:
    return launch(args)
  if args.process_id is not None:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.processes, process_id=args.process_id,
                               initialization_timeout=120)
  if args.quick:
    args.steps, args.repeats, args.skip = 12, 1, 4
  rollout = args.rollout_processes
  if rollout:  # the first train process reports
    procs = {int(q) for q in rollout.split(",")}
    REPORTER[0] = min(q for q in range(jax.process_count()) if q not in procs)
  go = lambda lag, steps, delay: run(lag, steps, delay, args.skip, rollout, args.run_root,
                                    args.sampler_first)
  t0 = time.perf_counter()
  delay = args.reward_delay_s
  if delay <= 0:
    probe = go(0, args.skip + 10, 0.0)
    delay = round(probe["median_train_s_at_lag0"], 3) if probe else 0.0
    if jax.process_count() > 1:  # the reporter's measurement, on every process
      from jax.experimental import multihost_utils
      delay = float(multihost_utils.broadcast_one_to_all(
          np.float64(delay), is_source=jax.process_index() == REPORTER[0]))
    if probe is not None:
      log(f"no reward delay: median step {probe['median_step_s'] * 1e3:.1f} ms, of which "
          f"sampling {probe['median_sample_s'] * 1e3:.1f} ms; reward delay set to the rest "
          f"(train step + bookkeeping) = {delay * 1e3:.0f} ms")
  runs = {0: [], 1: []}
  for i in range(args.repeats):
    for lag in (0, 1):
      res = go(lag, args.steps, delay)
      if res is None:  # a rollout process
        continue
      runs[lag].append(res)
      log(f"repeat {i} lag {lag}: {res['steps_per_s']:.2f} steps/s, "
          f"median step {res['median_step_s'] * 1e3:.1f} ms, "
          f"first-token staleness max {res['staleness_first_token_max']}")
  if jax.process_index() != REPORTER[0]:
    return
  ratios = [b["steps_per_s"] / a["steps_per_s"] for a, b in zip(runs[0], runs[1])]
  report = {
      "benchmark": "async_overlap",
      "quick": args.quick,
      "processes": jax.process_count(), "devices_per_process": jax.local_device_count(),
      "rollout_processes": rollout or None,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "steps": args.steps, "skip": args.skip, "repeats": args.repeats,
      "reward_delay_s": delay, "sampler_first": args.sampler_first,
      "lag0_steps_per_s": statistics.median(r["steps_per_s"] for r in runs[0]),
      "lag1_steps_per_s": statistics.median(r["steps_per_s"] for r in runs[1]),
      "speedup_lag1_over_lag0": statistics.median(ratios),
      "speedup_per_pair": ratios,
      "target": 1.6,
      "runs": runs,
      "total_wall_s": round(time.perf_counter() - t0, 1),
  }
  print(json.dumps(report, indent=2))


def launch(args) -> None:
  """Starts this script on `args.processes` local processes; relays process 0's report."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices}"])
  argv = [a for a in sys.argv[1:]]
  reporter = 0
  if args.rollout_processes:
    procs = {int(q) for q in args.rollout_processes.split(",")}
    reporter = min(q for q in range(args.processes) if q not in procs)
  root = tempfile.mkdtemp(prefix="jaxrl-async-overlap-")
  procs = [subprocess.Popen([sys.executable, __file__, *argv, f"--process-id={i}",
                             f"--coordinator=127.0.0.1:{port}", f"--run-root={root}"], env=env,
                            stdout=subprocess.PIPE if i == reporter else subprocess.DEVNULL)
           for i in range(args.processes)]
  out = procs[reporter].communicate()[0].decode()
  codes = [p.wait() for p in procs]
  # The report is the JSON object at the end; gloo writes its connection lines to stdout first.
  lines = out.splitlines(keepends=True)
  first = next((i for i, line in enumerate(lines) if line.startswith("{")), len(lines))
  sys.stdout.write("".join(lines[first:]))
  if any(codes):
    raise SystemExit(f"processes exited with {codes}")


if __name__ == "__main__":
  main()
