"""Soak test: a long RL run at lag 2 with validation on, watching memory and threads over time.

A resource that grows per step (host buffers, data-plane rows, published params, threads) is
invisible in a 20-step benchmark and fatal in a 10k-step run, so this runs the default recipe's
RL loop (`jaxrl.run.driver.rl`: rollout worker, lag gate, train step, asynchronous validation) for
`--steps` steps on a tiny model (d_model 32, head_dim 16, SwiGLU 64, 2 layers; no supervised
warm-up), `rollout.lag = 2`, `rollout.num_prompts = 8`, a validation pass of 64 prompts every 25
steps (on its own thread, alongside training), and watches the process two ways: a daemon
thread samples RSS (`VmRSS` of /proc/self/status, MiB) and the live Python threads every
`--interval-s` seconds, each sample tagged with the last RL step written; and the trainer's
thread takes the same readings plus `len(jax.live_arrays())` right after writing each step (tiny
steps are fast, so the timed sampler alone would see few of them).

Definitions (after warm-up = steps > `--warmup-steps`):

- RSS growth = (max RSS after warm-up - RSS at the end of warm-up) / RSS at the end of warm-up,
  where "end of warm-up" is the trainer thread's reading right after step `--warmup-steps` is
  written, and the max runs over every reading after it (both sources, through the final
  validation pass). Warm-up absorbs compilation, allocator pools and the first validation pass.
- Threads: the sampler's own thread is never counted. Two kinds of jaxrl thread are transient
  by design: one `jaxrl-validation-<step>` per validation pass, ending with the pass, and one
  `jaxrl-env-<task>` (plus `call_step` for coroutine environments) per environment call, ending
  with the call. The raw count therefore depends on when a reading lands. The steady count is
  the count without those transient threads; it is the one that must stay constant while the
  loop runs (readings tagged with the last step are excluded: the rollout worker is stopped
  then). A leak of transient threads would still show in the raw count and in the per-prefix
  maxima, which are reported next to it.
- target_met = RSS growth <= 0.10 and steady thread count max - min == 0 after warm-up.

Also reported: the data plane's rows/blocks/bytes per partition, and live arrays, at warm-up end
and after the last step (each snapshot first waits for a validation pass in flight, which holds
its own params and batch, then runs `gc.collect()`; their difference should be ~0 up to the
batches in the lag ring), and after the run; and the approximate RSS of the rows kept in memory
on purpose (the metrics writer's rows and this script's own readings), which grow with the step
count and so account for part of any RSS creep.

Prints ONE JSON object (progress on stderr). Series are downsampled to <= 60 points.

  PYTHONPATH=. python benchmarks/soak.py [--steps 500] [--warmup-steps 50]
  PYTHONPATH=. python benchmarks/soak.py --quick   # 60 steps, warm-up 20
"""

from __future__ import annotations

import argparse
import io
import gc
import json
import os
import pickle
import platform
import re
import sys
import tempfile
import threading
import time

import jax

from jaxrl import config as config_lib
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run import loop
from jaxrl.run.topology import Topology
from jaxrl.run.parts import build_parts
from jaxrl.recipes.default import get_config

GROWTH_TARGET = 0.10
SAMPLER_NAME = "soak-sampler"
TRANSIENT = ("jaxrl-validation", "jaxrl-env", "call_step")  # per pass / per call, by design
MAX_POINTS = 60


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def rss_mib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024  # kB
  raise RuntimeError("no VmRSS in /proc/self/status")


def prefix(name: str) -> str:
  """Groups thread names: 'jaxrl-validation-25' -> 'jaxrl-validation', 'jaxrl-env-add' ->
  'jaxrl-env', 'Thread-3 (run)' -> 'Thread'."""
  if name.startswith("jaxrl-env-"):
    return "jaxrl-env"
  return re.sub(r"(-\d+)?( \(.*\))?$", "", name)


def threads_now() -> tuple[int, int, dict[str, int]]:
  """(raw count, steady count, count per prefix of non-main threads), the sampler excluded."""
  groups: dict[str, int] = {}
  main = threading.main_thread()
  for t in threading.enumerate():
    if t.name == SAMPLER_NAME or t is main:
      continue
    p = prefix(t.name)
    groups[p] = groups.get(p, 0) + 1
  raw = 1 + sum(groups.values())  # + the main thread
  steady = raw - sum(n for p, n in groups.items() if p in TRANSIENT)
  return raw, steady, groups


def validation_alive() -> bool:
  return any(t.name.startswith("jaxrl-validation") for t in threading.enumerate())


def join_validation(timeout: float = 300.0) -> float:
  """Waits for a validation pass in flight; returns the seconds waited. A pass holds its own
  params and batch, so snapshots compared with each other are taken with none alive."""
  t0 = time.monotonic()
  for t in threading.enumerate():
    if t.name.startswith("jaxrl-validation"):
      t.join(max(0.0, timeout - (time.monotonic() - t0)))
  return time.monotonic() - t0


class Sampler:
  """Samples RSS and threads every `interval` seconds on a daemon thread, tagged with the last
  RL step the trainer wrote."""

  def __init__(self, interval: float):
    self.interval = interval
    self.step = 0  # last RL step written; set by the trainer's thread
    self.samples: list[dict] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=SAMPLER_NAME, daemon=True)

  def sample(self) -> None:
    raw, steady, groups = threads_now()
    self.samples.append({"t": time.monotonic(), "step": self.step, "rss_mib": rss_mib(),
                         "threads": raw, "threads_steady": steady, "groups": groups})

  def _run(self) -> None:
    while not self._stop.wait(self.interval):
      self.sample()

  def __enter__(self):
    self.sample()
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.sample()


class Writer(metrics_lib.MetricsWriter):
  """A metrics writer that tags the sampler with each RL step and, on the trainer's thread,
  reads RSS, threads and live arrays after every RL step (the sampler alone sees few steps when
  steps are fast) and takes the warm-up-end and last-step snapshots."""

  def __init__(self, run_dir: str, sampler: Sampler, parts, warmup: int, steps: int):
    super().__init__(run_dir)
    self.sampler, self.parts, self.warmup, self.steps = sampler, parts, warmup, steps
    self.snapshots: dict[str, dict] = {}
    self.per_step: list[dict] = []  # one reading per RL step, no gc

  def write(self, row: dict) -> None:
    super().write(row)
    if row.get("phase") != "rl":
      return
    step = row["step"]
    self.sampler.step = step
    raw, steady, groups = threads_now()
    self.per_step.append({"step": step, "rss_mib": rss_mib(), "threads": raw,
                          "threads_steady": steady, "groups": groups,
                          "live_arrays": len(jax.live_arrays())})
    if step == self.warmup:
      self.snapshots["warmup_end"] = self.snapshot(step)
      log(f"[soak] warm-up ends at step {step}: RSS {self.snapshots['warmup_end']['rss_mib']:.1f}"
          f" MiB, {self.snapshots['warmup_end']['live_arrays']} live arrays")
    if step == self.steps:
      self.snapshots["last_step"] = self.snapshot(step)
    if step % 25 == 0:
      s = self.sampler.samples[-1] if self.sampler.samples else {}
      log(f"[soak] step {step}: RSS {rss_mib():.1f} MiB, threads {s.get('threads')} "
          f"{s.get('groups')}, live arrays {len(jax.live_arrays())}")

  def snapshot(self, step: int) -> dict:
    rss = rss_mib()  # before waiting: the warm-up-end RSS is the one at this step
    waited = join_validation()
    gc.collect()
    raw, steady, groups = threads_now()
    return {"step": step, "rss_mib": round(rss, 1), "live_arrays": len(jax.live_arrays()),
            "waited_for_validation_s": round(waited, 2), "threads": raw,
            "threads_steady": steady, "thread_groups": groups,
            "data_plane": self.parts.data.stats()}


def tiny_config(steps: int):
  cfg = get_config()
  cfg.model.d_model = 32
  cfg.model.head_dim = 16
  cfg.model.mlp_dim = 64
  cfg.model.num_layers = 2
  cfg.sft.enabled = False
  cfg.train.steps = steps
  cfg.rollout.lag = 2
  cfg.rollout.num_prompts = 8
  cfg.val.every = 25
  cfg.val.batch_size = 64
  cfg.task.val_size = 64
  cfg.task.dev_size = 64
  return cfg


def downsample(samples: list[dict], n: int, keys=("step", "rss_mib", "threads")) -> list[list]:
  """At most `n` evenly spaced samples (first and last kept), as lists of `keys`."""
  if len(samples) > n:
    idx = sorted({round(i * (len(samples) - 1) / (n - 1)) for i in range(n)})
    samples = [samples[i] for i in idx]
  return [[round(s[k], 1) if isinstance(s[k], float) else s[k] for k in keys] for s in samples]


def slope_per_100_steps(points: list[tuple[float, float]]) -> float | None:
  """Least-squares slope of y over step, per 100 steps: a steady leak shows as a positive
  slope even when the max stays under the target."""
  if len(points) < 2 or len({x for x, _ in points}) < 2:
    return None
  n = len(points)
  mx = sum(x for x, _ in points) / n
  my = sum(y for _, y in points) / n
  sxy = sum((x - mx) * (y - my) for x, y in points)
  sxx = sum((x - mx) ** 2 for x, _ in points)
  return round(100 * sxy / sxx, 3)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=500)
  ap.add_argument("--warmup-steps", type=int, default=50)
  ap.add_argument("--interval-s", type=float, default=0.5, help="sampling period")
  ap.add_argument("--quick", action="store_true", help="60 steps, warm-up 20")
  args = ap.parse_args()
  if args.quick:
    args.steps, args.warmup_steps = 60, 20
  if not 0 < args.warmup_steps < args.steps:
    ap.error("need 0 < --warmup-steps < --steps")
  t_start = time.perf_counter()
  load_start = os.getloadavg()

  cfg = tiny_config(args.steps)
  mesh = config_lib.validate(cfg, jax.device_count())
  parts, params = build_parts(cfg, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  gc.collect()
  rss_built, live_built = rss_mib(), len(jax.live_arrays())
  log(f"[soak] {n_params:,} params, {args.steps} steps at lag {cfg.rollout.lag}, validation "
      f"every {cfg.val.every}; RSS after building {rss_built:.1f} MiB; load average "
      f"{load_start[0]:.2f}")
  sampler = Sampler(args.interval_s)
  with tempfile.TemporaryDirectory() as d:
    out = Writer(d, sampler, parts, args.warmup_steps, args.steps)
    try:
      with sampler:
        _, summary = loop.rl(parts, params, Topology.of(parts),
                             loop.RunIO(out, metrics_lib.Progress(stream=io.StringIO())))
    finally:
      out.close()
  gc.collect()
  end = {"rss_mib": round(rss_mib(), 1), "live_arrays": len(jax.live_arrays()),
         "threads": threads_now()[0], "data_plane": parts.data.stats()}
  load_end = os.getloadavg()
  # Part of any RSS creep is by design: the metrics writer keeps every row in memory, as does
  # this script's per-step log. A pickled round trip rebuilds them with the same sharing; its
  # RSS cost approximates theirs (it may undercount when freed memory is reused).
  rss0 = rss_mib()
  held = pickle.loads(pickle.dumps((out.rows, out.per_step, sampler.samples)))
  held_mib = rss_mib() - rss0
  del held

  warm, last = out.snapshots["warmup_end"], out.snapshots["last_step"]
  # RSS: every reading after warm-up, through the final validation pass and shutdown.
  sampled = [s for s in sampler.samples if s["step"] > args.warmup_steps]
  stepped = [s for s in out.per_step if s["step"] > args.warmup_steps]
  rss_after = [s["rss_mib"] for s in sampled + stepped]
  rss_max = max(rss_after)
  growth = (rss_max - warm["rss_mib"]) / warm["rss_mib"]
  # Threads: while the loop runs (sampler samples tagged with the last step come from the final
  # validation pass and the rollout worker's shutdown), plus the trainer's per-step readings.
  running = [s for s in sampled if s["step"] < args.steps] + stepped
  steady = [s["threads_steady"] for s in running]
  raw = [s["threads"] for s in running]
  group_max: dict[str, int] = {}
  for s in running:
    for p, n in s["groups"].items():
      group_max[p] = max(group_max.get(p, 0), n)
  steady_names = sorted({p for s in running for p in s["groups"] if p not in TRANSIENT})
  threads_constant = max(steady) - min(steady) == 0
  rss_ok = growth <= GROWTH_TARGET
  live = [s["live_arrays"] for s in stepped]
  log(f"[soak] RSS {warm['rss_mib']:.1f} MiB at warm-up end, max {rss_max:.1f} after "
      f"(growth {growth:+.2%}); steady threads {min(steady)}..{max(steady)}, raw "
      f"{min(raw)}..{max(raw)}; live arrays {warm['live_arrays']} -> {last['live_arrays']}")

  report = {
      "benchmark": "soak",
      "quick": args.quick,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(),
                  "load_avg_1_5_15m_at_start": [round(x, 2) for x in load_start],
                  "load_avg_1_5_15m_at_end": [round(x, 2) for x in load_end]},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "config": {"steps": args.steps, "warmup_steps": args.warmup_steps, "params": n_params,
                 "d_model": cfg.model.d_model, "head_dim": cfg.model.head_dim,
                 "mlp_dim": cfg.model.mlp_dim, "num_layers": cfg.model.num_layers,
                 "lag": cfg.rollout.lag, "num_prompts": cfg.rollout.num_prompts,
                 "group_size": cfg.rollout.group_size, "val_every": cfg.val.every,
                 "val_size": cfg.task.val_size, "val_batch_size": cfg.val.batch_size,
                 "val_asynchronous": cfg.val.asynchronous, "interval_s": args.interval_s},
      "samples": {"sampler": len(sampler.samples), "per_step": len(out.per_step)},
      "series_step_rss_mib_threads": downsample(sampler.samples, MAX_POINTS),
      "series_per_step_step_rss_mib_threads_steady_live_arrays": downsample(
          out.per_step, MAX_POINTS,
          ("step", "rss_mib", "threads", "threads_steady", "live_arrays")),
      "rss_mib": {"after_build": round(rss_built, 1), "warmup_end": warm["rss_mib"],
                  "max_after_warmup": round(rss_max, 1),
                  "final_sample": round(sampler.samples[-1]["rss_mib"], 1),
                  "last_step": last["rss_mib"], "after_rl": end["rss_mib"],
                  "growth_after_warmup": round(growth, 4),
                  "held_rows_approx": round(held_mib, 2),
                  "held_rows_count": {"metrics": len(out.rows), "per_step": len(out.per_step),
                                      "sampler": len(sampler.samples)},
                  "per_step_slope_mib_per_100_steps_after_warmup": slope_per_100_steps(
                      [(s["step"], s["rss_mib"]) for s in stepped])},
      "threads": {"raw_min_after_warmup": min(raw), "raw_max_after_warmup": max(raw),
                  "steady_min_after_warmup": min(steady), "steady_max_after_warmup": max(steady),
                  "steady_thread_prefixes": steady_names,
                  "transient_prefixes": list(TRANSIENT),
                  "max_per_prefix_after_warmup": group_max,
                  "after_rl": end["threads"]},
      "live_arrays": {"after_build": live_built, "warmup_end": warm["live_arrays"],
                      "last_step": last["live_arrays"],
                      "growth": last["live_arrays"] - warm["live_arrays"],
                      "min_per_step_after_warmup_no_gc": min(live),
                      "max_per_step_after_warmup_no_gc": max(live),
                      "after_rl": end["live_arrays"]},
      "snapshots_waited_for_validation_s": [warm["waited_for_validation_s"],
                                            last["waited_for_validation_s"]],
      "data_plane": {"warmup_end": warm["data_plane"], "last_step": last["data_plane"],
                     "after_rl": end["data_plane"]},
      "val_accuracy": {"before_rl": summary["val/accuracy_before_rl"],
                       "after_rl": summary["val/accuracy_after_rl"]},
      "rl_time_s": round(summary["rl/time_s"], 1),
      "target": {"rss_growth_max": GROWTH_TARGET, "steady_threads_constant": True},
      "rss_growth_ok": rss_ok,
      "threads_constant": threads_constant,
      "target_met": rss_ok and threads_constant,
  }
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
