"""A recipe's RL train step under several `train.*` settings, timed side by side on one batch.

Builds the recipe's parts once (its real model when `model.hf_path` points at one: a Hugging Face
directory or a GGUF file, converted as a run converts it), then one train step per variant
(`build_rl_step`, as the trainer builds it), and times them round robin on the same synthetic
batch: `--repeats` rounds after each variant's first (compiling) call. Prints ONE JSON object on
stdout: per variant the median and every step time, the first call's time, the first step's loss
(the variants train the same function of the batch, so their losses agree to float rounding) and,
with `train.length_buckets`, the widths the step ran at.

The batch (an assumption stated here, not drawn from a model): `num_prompts` groups of
`group_size` rows; each group's prompt has 62..69 tokens (uniform; the SmolLM2 recipe's chat
prompts measured 61-72 of their 96 columns), left padded to `rollout.max_prompt_len`; each
reply LogNormal(median 30, sigma 0.35) tokens, rounded, clipped to [4, --max-reply], and one row
of min(60, --max-reply) tokens (every batch of the SmolLM2 recipe measured had a reply of 57-64
tokens); tokens uniform, rewards 0/1 at random.

  python benchmarks/step_variants.py --recipe configs/smollm2_135m_word_math.py \\
      --variant full: --variant buckets8:train.length_buckets=8 --max-reply 40
  python benchmarks/step_variants.py --quick     # the default recipe's tiny model, 2 variants
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RECIPE = os.path.join(ROOT, "configs", "default.py")


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def parse_variant(text: str) -> tuple[str, dict]:
  """`name:key=value,key=value` -> (name, {key: value}) with values read as JSON when they
  parse (numbers, true/false), else as strings."""
  name, _, rest = text.partition(":")
  settings = {}
  for item in filter(None, rest.split(",")):
    key, eq, value = item.partition("=")
    if not eq:
      raise SystemExit(f"step_variants: --variant {text!r}: {item!r} is not key=value")
    try:
      settings[key] = json.loads(value)
    except json.JSONDecodeError:
      settings[key] = value
  return name, settings


def make_batch(cfg, max_reply: int, seed: int):
  from jaxrl.core.types import TrainBatch
  r = cfg.rollout
  rng = np.random.default_rng(seed)
  p, g, lp, n = r.num_prompts, r.group_size, r.max_prompt_len, r.max_new_tokens
  b, vocab = p * g, 30000
  plen = np.minimum(rng.integers(62, 70, p), lp)
  prompts, valid = np.zeros((b, lp), np.int32), np.zeros((b, lp), bool)
  for i in range(p):
    prompts[i * g:(i + 1) * g, lp - plen[i]:] = rng.integers(10, vocab, plen[i])
    valid[i * g:(i + 1) * g, lp - plen[i]:] = True
  cap = min(max_reply, n)
  reply = np.clip(np.round(rng.lognormal(np.log(30), 0.35, b)), 4, cap).astype(int)
  reply[min(5, b - 1)] = min(60, cap)
  mask = np.arange(n)[None] < reply[:, None]
  tokens = np.where(mask, rng.integers(10, vocab, (b, n)), 0).astype(np.int32)
  batch = TrainBatch(prompts, valid, tokens, mask,
                     np.where(mask, -rng.random((b, n)), 0).astype(np.float32),
                     rng.integers(0, 2, b).astype(np.float32),
                     np.arange(b, dtype=np.int32) // g, np.full(b, r.temperature, np.float32))
  return batch, {"prompt_tokens": int(plen.sum()), "reply_tokens": int(reply.sum()),
                 "longest_reply": int(reply.max())}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--recipe", default=DEFAULT_RECIPE)
  ap.add_argument("--variant", action="append", default=[],
                  help="name:key=value,...  (train.* or any config key; repeatable)")
  ap.add_argument("--max-reply", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args(argv)
  if args.quick:
    args.recipe = DEFAULT_RECIPE
    args.variant = args.variant or ["full:", "buckets4:train.length_buckets=4"]
  variants = [parse_variant(v) for v in (args.variant or ["full:"])]

  import jax

  from jaxrl import config as config_lib
  from jaxrl.config.loader import load_recipe
  from jaxrl.config.preflight import resolve_model_file
  from jaxrl.learner.rl import build_rl_step
  from jaxrl.learner.step import to_rows
  from jaxrl.run.parts import build_parts
  from jaxrl.runtime import compile_cache

  base = load_recipe(args.recipe)
  problems: list[str] = []
  resolve_model_file(base, problems, say=lambda m, **_: log(m))  # a GGUF file: its converted dir
  if problems:
    raise SystemExit("\n".join(problems))
  compile_cache.enable("auto")
  batch, lengths = make_batch(base, args.max_reply, args.seed)
  log(f"batch: {lengths}")
  parts = params = None
  runs = {}
  for name, settings in variants:
    cfg = copy.deepcopy(base)
    for key, value in settings.items():
      node = cfg
      *path, leaf = key.split(".")
      for part in path:
        node = node[part]
      node[leaf] = value
    mesh_shape = config_lib.validate(cfg, jax.device_count())
    if parts is None:
      parts, params = build_parts(cfg, mesh_shape)
    fn, init = build_rl_step(dataclasses.replace(parts, cfg=cfg), params)
    state, dev = init(params), to_rows(batch, parts.mesh)
    t0 = time.perf_counter()
    state, m = fn(state, dev)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    widths = [int(m[k]) for k in ("train/prompt_width", "train/completion_width") if k in m]
    log(f"{name}: first call {first:.1f} s, loss {float(m['loss']):.7f}, widths {widths}")
    runs[name] = {"fn": fn, "state": state, "batch": dev, "times": [], "first_s": first,
                  "loss": float(m["loss"]), "widths": widths or None}
  for _ in range(args.repeats):
    for name, run in runs.items():
      t0 = time.perf_counter()
      run["state"], m = run["fn"](run["state"], run["batch"])
      jax.block_until_ready(m)
      run["times"].append(time.perf_counter() - t0)
      log(f"{name}: {run['times'][-1]:.2f} s")
  out = {"recipe": args.recipe, "max_reply": args.max_reply, "batch": lengths,
         "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
         "variants": {name: {"settings": dict(settings),
                             "median_s": statistics.median(runs[name]["times"]),
                             "times_s": [round(t, 3) for t in runs[name]["times"]],
                             "first_call_s": round(runs[name]["first_s"], 2),
                             "loss": runs[name]["loss"], "widths": runs[name]["widths"]}
                      for name, settings in variants}}
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
