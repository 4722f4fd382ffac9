"""`rollout.lag=auto` on a run whose generation is 3x slower than its train step: the lag it
chooses and how much of the possible overlap that lag gets.

The default recipe's RL loop (`jaxrl.run.loop.rl`, no supervised warm-up, no evaluation), on the
default model, with the reward function made slow (a sleep per batch, the benchmark's only seam,
as `async_overlap.py` does: an LLM judge or a code sandbox would be this slow). Three runs:

1. probe, lag 0, no delay: T = the trainer's share of a step (step time minus sampling time) and
   the sampling time g; the reward delay is then set to 3 T - g, so a batch takes G = 3 T;
2. lag 0 with that delay: the serial wall-clock time per step, D0 (= G + T);
3. `rollout.lag=auto` with that delay (`rollout.lag_every`, `rollout.max_lag` below): the lag in
   force at each step (`pipeline/lag`), each change's console line, and the wall-clock time per
   step D once the last change is in force.

Overlap = (D0 - D) / min(G, D0 - G): the share of the time a perfect overlap would save (the
shorter of generation and training hides behind the longer) that the chosen lag saved. Worker
busy = the median generation time of a batch at auto over D: 1.0 when generation never waits
for the gate, so everything the trainer does hides behind it. Wall time
per step is measured from step completions (`perf/elapsed_s`), the first `--skip` steps (compile)
and those before the last lag change left out.

Colocated on a CPU, the sampler's own work and the train step share the cores (only the reward's
sleep overlaps freely). With `rollout.sampler_first` (default "auto": on, here) the train step
waits for the worker's sampler call of the next batch, then runs during its reward's wait;
`--sampler-first auto,off --repeats 2` runs the lag=auto run both ways side by side (ABBA), the
two sharing the probe and the lag-0 run. Without it ("off"), the two programs split the cores
and every batch, the critical path, is later by the train step's share. `--pipeline` measures
the lag alone: `LagPipeline` with a tuner, a producer that sleeps G per batch (uniform +-20%
jitter) and a trainer that sleeps T per step (G = 3 T), lag 0 then `auto`, the same overlap
figure.

Prints ONE JSON object (progress on stderr).

  PYTHONPATH=. python benchmarks/lag_auto.py [--steps 40] [--lag-every 5] [--max-lag 3]
  PYTHONPATH=. python benchmarks/lag_auto.py --sampler-first auto,off --repeats 2
  PYTHONPATH=. python benchmarks/lag_auto.py --quick
  PYTHONPATH=. python benchmarks/lag_auto.py --pipeline [--train-s 0.05] [--steps 60] [--start 0]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl.pipeline import LagPipeline
from jaxrl.pipeline.tuner import LagTuner
from jaxrl.recipes.default import get_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_overlap import rl_with_slow_reward  # noqa: E402  (the same slow-reward run)


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def run(lag, steps: int, delay: float, lag_every: int = 10, max_lag: int = 2,
        sampler_first: str = "auto"):
  """The RL rows of one run and its console lines."""
  cfg = config_lib.parse_overrides(get_config(), [
      f"--config.rollout.lag={lag}", f"--config.rollout.lag_every={lag_every}",
      f"--config.rollout.sampler_first={sampler_first}",
      f"--config.rollout.max_lag={max_lag}", f"--config.train.steps={steps}",
      "--config.sft.enabled=false", "--config.val.every=1000000", "--config.val.at_start=false",
      "--config.val.at_end=false"])  # no evaluation: a pass would share the CPU with the steps
  rows, console = rl_with_slow_reward(cfg, delay)
  return rows, [line.strip() for line in console.splitlines()
                if line.strip().startswith("lag ") and " from step " in line]


def run_pipeline(lag, steps: int, gen_s: float, train_s: float, lag_every: int, max_lag: int,
                 start: int | None = None):
  """Sleeps only: per step (lag in force, pull-to-pull wall time) and the lines said."""
  jitter = np.random.default_rng(0).uniform(0.8, 1.2, steps + max_lag + 2)
  made: list[float] = []  # each batch's measured generation time

  def produce(batch_id, params, version):
    began = time.monotonic()
    time.sleep(gen_s * jitter[batch_id])
    made.append(time.monotonic() - began)
    return version

  said: list[str] = []
  tuner = LagTuner(max_lag, lag_every, start=start) if lag == "auto" else lag
  with LagPipeline(produce, tuner, stall_timeout_s=60.0, say=said.append) as pipe:
    pipe.publish(0, None)
    out, last = [], time.monotonic()
    for t in range(steps):
      b, version = pipe.pull()
      assert version == max(0, b - pipe.stats()["lag"])  # the staleness contract
      time.sleep(train_s)
      pipe.publish(t + 1, None)
      now = time.monotonic()
      out.append((pipe.stats()["lag"], now - last))
      last = now
  return out, said, statistics.mean(made)


def pipeline_main(args) -> dict:
  train_s, gen_s = args.train_s, args.ratio * args.train_s
  serial, _, gen = run_pipeline(0, args.steps, gen_s, train_s, args.lag_every, args.max_lag)
  d0 = statistics.mean(d for _, d in serial[args.skip:])
  steps, said, _ = run_pipeline("auto", args.steps, gen_s, train_s, args.lag_every, args.max_lag,
                                args.start)
  lags = [lag for lag, _ in steps]
  last_change = max([i for i in range(1, len(lags)) if lags[i] != lags[i - 1]], default=0)
  settled = [d for _, d in steps[max(last_change, args.skip):]]
  d = statistics.mean(settled)
  possible = min(gen, d0 - gen)  # measured at lag 0: the trainer's share is d0 - gen
  return {"mode": "pipeline", "start": args.start, "train_s": train_s, "generation_s": gen_s,
          "lag0_step_s": round(d0, 4), "lag0_generation_s": round(gen, 4), "lag_per_step": lags, "lag_decisions_said": said,
          "chosen_lag": lags[-1], "auto_step_s": round(d, 4), "settled_steps": len(settled),
          "overlap_of_possible": round((d0 - d) / possible, 3)}


def auto_result(rows: list[dict], said: list[str], skip: int, d0: float, possible: float) -> dict:
  """One lag=auto run: the lag per step and, over the steps after its last change, the time a
  step, the overlap reached and the worker's busy share."""
  lags = [r["pipeline/lag"] for r in rows]
  last_change = max([i for i in range(1, len(lags)) if lags[i] != lags[i - 1]], default=0)
  settled = [r for r in rows[last_change:] if r["step"] > skip]
  d = per_step(settled)
  gen_auto = statistics.median(r["perf/sample_time_s"] for r in settled)
  return {
      "lag_per_step": lags, "lag_decisions_said": said, "chosen_lag": lags[-1],
      "auto_step_s": round(d, 4), "settled_steps": len(settled),
      "overlap_of_possible": round((d0 - d) / possible, 3) if possible > 0 else None,
      # The worker's busy share at auto: its generation time a batch over the step's wall time
      # (1.0: generation never waits, the trainer's work all hides behind it).
      "auto_generation_s": round(gen_auto, 4), "worker_busy": round(gen_auto / d, 3),
      # The trainer's wait for the worker's sampler calls (rollout.sampler_first), a step.
      "turn_wait_s": round(rows[-1].get("pipeline/turn_wait_s", 0.0) / len(rows), 4),
      "staleness_exact_every_step": all(
          r["staleness/first_token/max"] == r["staleness/first_token/min"]
          == min(r["step"] - 1, r["pipeline/lag"]) for r in rows)}


def summarise_mode(runs: list[dict]) -> dict:
  """The runs of one `--sampler-first` value: the median step time and overlap, every run's
  overlap, and the last run's per-step lags and lines."""
  return {**runs[-1],
          "auto_step_s": round(statistics.median(r["auto_step_s"] for r in runs), 4),
          "overlap_of_possible": round(statistics.median(r["overlap_of_possible"] or 0.0
                                                         for r in runs), 3),
          "overlap_each_run": [r["overlap_of_possible"] for r in runs],
          "staleness_exact_every_step": all(r["staleness_exact_every_step"] for r in runs)}


def per_step(rows: list[dict]) -> float:
  return (rows[-1]["perf/elapsed_s"] - rows[0]["perf/elapsed_s"]) / (len(rows) - 1)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=40, help="steps of the lag=auto run")
  ap.add_argument("--lag-every", type=int, default=5)
  ap.add_argument("--max-lag", type=int, default=3)
  ap.add_argument("--skip", type=int, default=5, help="first steps excluded (compilation)")
  ap.add_argument("--ratio", type=float, default=3.0, help="generation time / train step time")
  ap.add_argument("--sampler-first", default="auto",
                  help="rollout.sampler_first of the lag=auto run; a comma list (auto,off) "
                       "runs each, side by side; the first is the one reported at the top")
  ap.add_argument("--repeats", type=int, default=1,
                  help="lag=auto runs per --sampler-first value (ABBA order)")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--pipeline", action="store_true", help="the lag pipeline alone, sleeps only")
  ap.add_argument("--train-s", type=float, default=0.05, help="--pipeline: train step seconds")
  ap.add_argument("--start", type=int, default=None,
                  help="--pipeline: the lag before the first decision (default 1, as a run's)")
  args = ap.parse_args()
  bad = [m for m in args.sampler_first.split(",") if m not in ("auto", "on", "off")]
  if bad:  # before the probe runs, not after it
    ap.error(f"--sampler-first: {bad} not in auto, on, off")
  if args.quick:
    args.steps, args.lag_every, args.skip = 20, 4, 3
  t0 = time.perf_counter()
  if args.pipeline:
    report = {"benchmark": "lag_auto", "quick": args.quick,
              "date": datetime.date.today().isoformat(), "steps": args.steps,
              "skip": args.skip, "lag_every": args.lag_every, "max_lag": args.max_lag,
              "load_avg_1m_at_start": round(os.getloadavg()[0], 2), **pipeline_main(args),
              "target_overlap": 0.85, "total_wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report, indent=2))
    return
  short = 6 if args.quick else 10  # timed steps of the probe and of the lag-0 run
  probe, _ = run(0, args.skip + short, 0.0)
  probe = [r for r in probe if r["step"] > args.skip]
  train = statistics.median(r["perf/step_time_s"] - r["perf/sample_time_s"] for r in probe)
  sample = statistics.median(r["perf/sample_time_s"] for r in probe)
  delay = round(max(0.0, args.ratio * train - sample), 3)
  log(f"probe: train {train * 1e3:.0f} ms, sampling {sample * 1e3:.0f} ms a step; reward delay "
      f"{delay * 1e3:.0f} ms so generation takes ~{args.ratio:g}x the train step")
  serial, _ = run(0, args.skip + short + 2, delay)
  serial = [r for r in serial if r["step"] > args.skip]
  d0 = per_step(serial)
  gen = statistics.median(r["perf/sample_time_s"] for r in serial)
  log(f"lag 0: {d0 * 1e3:.0f} ms a step, generation {gen * 1e3:.0f} ms a batch")
  possible = min(gen, d0 - gen)
  # The lag=auto run once per `--sampler-first` value and repeat, the order reversed every
  # other repeat (ABBA): the values are compared on the same machine state.
  modes = args.sampler_first.split(",")
  by_mode: dict[str, list[dict]] = {m: [] for m in modes}
  for rep in range(args.repeats):
    for mode in (modes if rep % 2 == 0 else modes[::-1]):
      rows, said = run("auto", args.steps, delay, args.lag_every, args.max_lag, mode)
      one = auto_result(rows, said, args.skip, d0, possible)
      log(f"lag auto, rollout.sampler_first={mode}: lag {one['chosen_lag']}, "
          f"{one['auto_step_s'] * 1e3:.0f} ms a step, overlap {one['overlap_of_possible']}")
      by_mode[mode].append(one)
  results = {m: summarise_mode(runs) for m, runs in by_mode.items()}
  main_mode = results[modes[0]]
  report = {
      "benchmark": "lag_auto", "quick": args.quick,
      "date": datetime.date.today().isoformat(),
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "steps": args.steps, "skip": args.skip, "lag_every": args.lag_every,
      "max_lag": args.max_lag, "reward_delay_s": delay,
      "probe_train_s": round(train, 4), "probe_sample_s": round(sample, 4),
      "lag0_step_s": round(d0, 4), "generation_s": round(gen, 4),
      "generation_over_train": round(gen / max(d0 - gen, 1e-9), 2),
      "sampler_first": modes[0], **main_mode,
      "by_sampler_first": results if len(modes) > 1 or args.repeats > 1 else None,
      "target_overlap": 0.85,
      "total_wall_s": round(time.perf_counter() - t0, 1),
  }
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
