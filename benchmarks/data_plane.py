"""Data-plane overhead per RL step, next to the default model's train step in the same run.

Prints ONE JSON object on stdout (progress goes to stderr). One data-plane step is what the
trainer does with a rollout batch of P=64 prompts x G=16 samples (1024 rows) of 1024 completion
tokens: put the rollout fields from host numpy arrays (tokens int32, mask bool, rollout_logprobs
float32, policy_version int32, all [rows, tokens], as the trainer stores them), get them back in
placement order (the fast path: the stored arrays themselves) and discard the rows. Times are
host-side (the calling thread's wall time; transfers may still be in flight) and, separately,
synced (blocked until the placed arrays are ready). The gather path gets 1024 rows drawn half
from each of two blocks, in a shuffled order (one jitted gather).

The default model's train step (default config: P=32, G=8, 6 prompt + 4 completion tokens,
mesh 1x1x1, built as benchmarks/train_step.py builds it) is timed in the same loop, one step per
repeat, interleaved with the data-plane work so both see the same machine load. The target is
data-plane overhead / train step < 0.05.

  PYTHONPATH=. python benchmarks/data_plane.py [--repeats 20]
  PYTHONPATH=. python benchmarks/data_plane.py --quick   # smoke test, tiny sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

import train_step as step_bench  # benchmarks/train_step.py: the default train-step case and data
from jaxrl.recipes.default import get_config
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import init_model
from jaxrl.parallel.sharding import make_mesh
from jaxrl.pipeline.batch_meta import BatchMeta, balance_rows
from jaxrl.pipeline.row_store import DataPlane
from jaxrl.learner.step import build_train_step, make_optimizer, to_rows
from jaxrl.learner.rl import rl_step_config

TRAIN_FIELDS = ("tokens", "mask", "rollout_logprobs", "policy_version")
TARGET = 0.05


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def rollout_fields(rows: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(2, 32000, (rows, tokens)).astype(np.int32),
          "mask": np.ones((rows, tokens), bool),
          "rollout_logprobs": (-rng.uniform(0.5, 4.0, (rows, tokens))).astype(np.float32),
          "policy_version": np.full((rows, tokens), seed, np.int32)}


def mint(prefix: str, prompts: int, group: int, tokens: int, version: int) -> BatchMeta:
  rows = prompts * group
  return BatchMeta.mint("train", prefix, np.arange(rows) // group, np.full(rows, tokens),
                        np.full(rows, version), {"reward": np.zeros(rows, np.float32)})


def build_default_step(cfg):
  """The default model's jitted RL train step and a device batch, as benchmarks/train_step.py
  builds its "default" case."""
  model_cfg = ModelConfig.from_config(cfg.model, step_bench.DEFAULT_VOCAB)
  case = step_bench.make_cases(False, cfg)["default"]
  mesh = make_mesh(1, 1, 1)
  graphdef, params = init_model(model_cfg, seed=0)
  t = cfg.train
  extra = {"warmup_steps": t.warmup_steps} if "warmup_steps" in t else {}
  optimizer = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                             grad_clip=t.grad_clip, **extra)
  step_cfg = dataclasses.replace(rl_step_config(cfg), num_microbatches=1)
  step, init_state = build_train_step(graphdef, optimizer, step_cfg, mesh, params)
  state = init_state(params)
  batch = to_rows(step_bench.random_batch(case, model_cfg.vocab_size), mesh)
  jax.block_until_ready((state, batch))
  return step, state, batch, case


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--repeats", type=int, default=20, help="timed repeats (>= 10 for the report)")
  ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
  args = ap.parse_args()
  if args.repeats < 1:
    ap.error("--repeats must be >= 1")
  t_start = time.perf_counter()
  prompts, group, tokens = (8, 4, 64) if args.quick else (64, 16, 1024)
  rows = prompts * group

  cfg = get_config()
  log("[train step] building and compiling the default model's step")
  step, state, batch, case = build_default_step(cfg)
  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  log(f"[train step] first step (compile + run) {time.perf_counter() - t0:.2f}s")

  mesh = make_mesh(1, 1, 1)
  dp = DataPlane(mesh)
  host = [rollout_fields(rows, tokens, seed) for seed in range(2)]
  bytes_per_put = sum(a.nbytes for a in host[0].values())
  rng = np.random.default_rng(0)
  t_put, t_get, t_discard, t_host, t_synced = [], [], [], [], []
  t_gather, t_gather_synced, t_balance, t_train = [], [], [], []
  warmup = 2
  log(f"[data plane] {rows} rows x {tokens} tokens, {bytes_per_put / 2**20:.1f} MiB per put; "
      f"{warmup} warm-up + {args.repeats} repeats")
  for i in range(warmup + args.repeats):
    # Fast path: put, get in placement order, discard (host-side time).
    meta = mint(f"s{i}", prompts, group, tokens, i)
    data = host[i % 2]
    t0 = time.perf_counter()
    dp.put(meta, data)
    t1 = time.perf_counter()
    out = dp.get(meta, TRAIN_FIELDS)
    t2 = time.perf_counter()
    dp.discard(meta)
    t3 = time.perf_counter()
    jax.block_until_ready(out)
    del out
    # The same, synced: blocked until the placed arrays are on device.
    meta = mint(f"y{i}", prompts, group, tokens, i)
    t4 = time.perf_counter()
    dp.put(meta, data)
    out = dp.get(meta, TRAIN_FIELDS)
    jax.block_until_ready(out)
    dp.discard(meta)
    t5 = time.perf_counter()
    del out
    # Gather path: half the rows of each of two blocks, shuffled.
    a = dp.put(mint(f"a{i}", prompts, group, tokens, i), host[0])
    b = dp.put(mint(f"b{i}", prompts, group, tokens, i), host[1])
    jax.block_until_ready(dp.get(a, TRAIN_FIELDS))
    jax.block_until_ready(dp.get(b, TRAIN_FIELDS))
    pick = a.subset(np.arange(0, rows, 2)).concat(b.subset(np.arange(1, rows, 2)))
    pick = pick.subset(rng.permutation(rows))
    t6 = time.perf_counter()
    out = dp.get(pick, TRAIN_FIELDS)
    t7 = time.perf_counter()
    jax.block_until_ready(out)
    t8 = time.perf_counter()
    del out
    dp.discard(a)
    dp.discard(b)
    # Metadata-only sharding of the batch over 8 data shards.
    t9 = time.perf_counter()
    balance_rows(pick.lengths + rng.integers(0, 64, rows).astype(np.int32), 8)
    t10 = time.perf_counter()
    # One train step of the default model.
    t11 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    t12 = time.perf_counter()
    if i >= warmup:
      t_put.append(t1 - t0)
      t_get.append(t2 - t1)
      t_discard.append(t3 - t2)
      t_host.append(t3 - t0)
      t_synced.append(t5 - t4)
      t_gather.append(t7 - t6)
      t_gather_synced.append(t8 - t6)
      t_balance.append(t10 - t9)
      t_train.append(t12 - t11)
  if dp.stats()["train/rows"]:
    raise RuntimeError(f"rows left in the data plane: {dp.stats()}")
  med = lambda xs: round(statistics.median(xs), 6)
  log("[data plane] put+get+discard host ms: " + " ".join(f"{x * 1e3:.2f}" for x in t_host))
  log("[train step] ms: " + " ".join(f"{x * 1e3:.1f}" for x in t_train))

  overhead, train = statistics.median(t_host), statistics.median(t_train)
  report = {
      "benchmark": "data_plane",
      "quick": args.quick,
      "repeats": args.repeats,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "data_plane": {
          "prompts": prompts, "group_size": group, "rows": rows, "completion_tokens": tokens,
          "mesh": [1, 1, 1],
          "fields": {f: f"{a.dtype}{list(a.shape)}" for f, a in host[0].items()},
          "bytes_per_put": bytes_per_put,
          "put_s": med(t_put),
          "get_fast_path_s": med(t_get),
          "discard_s": med(t_discard),
          "put_get_discard_host_s": med(t_host),
          "put_get_discard_synced_s": med(t_synced),
          "gather": {"rows": rows, "blocks": 2, "get_host_s": med(t_gather),
                     "get_synced_s": med(t_gather_synced)},
          "balance_rows_8_shards_s": med(t_balance),
      },
      "train_step": {"case": "default", "rows": case.rows, "prompt_len": case.prompt_len,
                     "new_tokens": case.new_tokens, "median_step_s": med(t_train)},
      "ratio_overhead_over_train_step": round(overhead / train, 4),
      "ratio_synced_over_train_step": round(statistics.median(t_synced) / train, 4),
      "ratio_gather_synced_over_train_step": round(statistics.median(t_gather_synced) / train,
                                                   4),
      "target_ratio": TARGET,
      "target_met": overhead / train < TARGET,
  }
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
