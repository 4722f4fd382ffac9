"""Time to the first RL step of README command 1, cold and then warm (issue 22, item 4).

Each pair runs `python -m jaxrl.train` twice with `XDG_CACHE_HOME` a new empty directory, so the
compilation cache (`compile_cache="auto"`) and the warm-up cache (`sft.cache="auto"`) both start
empty: the first run fills them, the second is the same command again. Each run is stopped with
SIGINT right after it prints `first RL step done <s> s after start` (it checkpoints and exits),
and that number is the measurement. Extra arguments go to both runs, e.g. `--config.sft.cache=`
to measure the compilation cache alone.

  python benchmarks/first_rl_step.py [--pairs 2] [--config.key=value ...]

Prints one JSON object: per pair the cold and warm times and their ratio, and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

FIRST = re.compile(r"first RL step done ([\d.]+) s after start")
CLEARED = ("JAX_COMPILATION_CACHE_DIR", "JAXRL_WARMUP_CACHE_DIR")


def run_once(xdg: str, run_dir: str, extra: list[str], timeout: float) -> dict:
  """One `python -m jaxrl.train` stopped after its first RL step: its time to it (its own
  printed number) and the warm-up line it printed."""
  env = {k: v for k, v in os.environ.items() if k not in CLEARED}
  env["XDG_CACHE_HOME"] = xdg
  env["PYTHONUNBUFFERED"] = "1"  # its lines as they are printed, so the stop comes right after
  started = time.monotonic()
  proc = subprocess.Popen([sys.executable, "-m", "jaxrl.train", f"--config.run_dir={run_dir}",
                           *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env)
  first, warmup, tail = None, "", []
  try:
    for line in proc.stdout:
      tail = (tail + [line])[-20:]
      if line.startswith("warm-up: ") and ("steps," in line or "loaded" in line):
        warmup = line.strip()
      m = FIRST.search(line)
      if m and first is None:
        first = float(m.group(1))
        proc.send_signal(signal.SIGINT)
      if time.monotonic() - started > timeout:
        proc.kill()
        break
  finally:
    proc.wait()
  if first is None:
    raise RuntimeError("no `first RL step done` line; last output:\n" + "".join(tail))
  return {"first_rl_step_s": first, "warmup": warmup}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--pairs", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
  args, extra = parser.parse_known_args(argv)
  pairs = []
  for i in range(args.pairs):
    with tempfile.TemporaryDirectory(prefix="jaxrl-first-step-") as xdg:
      cold = run_once(xdg, os.path.join(xdg, "cold"), extra, args.timeout)
      warm = run_once(xdg, os.path.join(xdg, "warm"), extra, args.timeout)
    pair = {"cold": cold, "warm": warm,
            "ratio": cold["first_rl_step_s"] / warm["first_rl_step_s"]}
    print(f"first_rl_step: pair {i + 1}: cold {cold['first_rl_step_s']:.1f} s, warm "
          f"{warm['first_rl_step_s']:.1f} s ({pair['ratio']:.2f}x)", file=sys.stderr, flush=True)
    pairs.append(pair)
  result = {
      "command": "python -m jaxrl.train " + " ".join(extra),
      "pairs": pairs,
      "cold_median_s": statistics.median(p["cold"]["first_rl_step_s"] for p in pairs),
      "warm_median_s": statistics.median(p["warm"]["first_rl_step_s"] for p in pairs),
      "ratio_median": statistics.median(p["ratio"] for p in pairs),
      "target": 3.0,
  }
  result["target_met"] = result["ratio_median"] >= result["target"]
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
