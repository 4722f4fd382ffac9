"""Delta weight sync (`rollout.sync`): bytes and time per params version, full vs delta, over the
TCP version transport on 127.0.0.1, at the Qwen2.5-0.5B shape with real RL updates.

The updates. The Qwen2.5-0.5B recipe's model (`configs/qwen2_5_0_5b_gsm8k.py`: 24 layers, d 896,
14/2 heads, SwiGLU 4864, vocab 151936, tied, 494M params, f32 master weights) with the model's own
random init (no checkpoint is read), trained by the recipe's RL train step (its loss, token TIS,
AdamW at lr 1e-6, b2 0.999, weight decay 0.01, grad clip) for `--steps` steps, each on a fresh
random batch (2 prompts x 4 samples of 32 + 32 tokens, rewards 1, 0, 0, 1 per group so every
group has an advantage), with the recipe's 10-step warm-up off: every step moves the weights by
the full lr, as after warm-up. Version v is the params after v steps cast to bfloat16 (the
recipe's samplers' dtype; `rollout.dtype = "auto"` with `model.dtype = "bfloat16"`) and packed
as one train process serves them to one rollout process (every leaf flattened and concatenated:
`ParamsBridge.host_rows` with one train device).

The transport. Two `VersionServer`s on 127.0.0.1 (one full-only, one with `delta=2`) are given
each version, and a `VersionClient` of each kind fetches it in the same process (the two sides
share this machine's 2 cores): `sync_s` is the wall time of `fetch` (request, the server's crc32
and, for delta, its encoding, the transfer over loopback, the client's decoding and its crc32
check). Bytes are what crossed the socket. Version 0 crosses in full either way (no base).
Also per version: the fraction of bf16 values that changed, and the alternative encoding of a
zlib (level 1) of the whole XOR against the base: its size, encode and decode times.

  PYTHONPATH=. python benchmarks/delta_sync.py --steps 3   # ~8 min on 2 shared cores, ~15 GB
  PYTHONPATH=. python benchmarks/delta_sync.py --quick     # 2 layers, vocab 4096: ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import recipe_scale as rs  # noqa: E402  (benchmarks/recipe_scale.py: the recipe's model and batch)
from jaxrl.config.loader import load_recipe
from jaxrl.learner.rl import rl_step_config
from jaxrl.learner.step import build_train_step, make_optimizer, to_rows
from jaxrl.models.transformer import init_model
from jaxrl.parallel import delta as delta_lib
from jaxrl.parallel.transport import VersionClient, VersionServer

RECIPE = "configs/qwen2_5_0_5b_gsm8k.py"


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def setup(args):
  cfg = load_recipe(RECIPE)
  r, t = cfg.rollout, cfg.train
  r.num_prompts, r.group_size, r.max_prompt_len, r.max_new_tokens = 2, 4, 32, 32
  r.max_total_tokens = 0
  t.packing, t.num_microbatches, t.warmup_steps = False, 1, 0
  model_cfg, source = rs.recipe_model(cfg, types.SimpleNamespace(
      hf_config=None, layers=2 if args.quick else None, quick=args.quick))
  return cfg, model_cfg, source


def batches(cfg, vocab: int, n: int, seed: int):
  r = cfg.rollout
  rng = np.random.default_rng(seed)
  for _ in range(n):
    p, c = rs.sample_lengths(rng, r.num_prompts, r.group_size, r.max_prompt_len,
                             r.max_new_tokens, 32 / 256, 32 / 512)
    b = rs.make_batch(rng, p, c, r.group_size, r.max_prompt_len, r.max_new_tokens, vocab)
    yield b._replace(rewards=np.tile(np.float32([1, 0, 0, 1]), r.num_prompts))


def wire_bytes(params) -> bytes:
  """The version as one train process serves it to one rollout process: bf16, flattened."""
  pack = jax.jit(lambda leaves: jnp.concatenate([x.astype(jnp.bfloat16).reshape(-1)
                                                 for x in leaves]))
  return np.asarray(pack(jax.tree.leaves(params))).tobytes()


def timed(fn, *a):
  t0 = time.perf_counter()
  out = fn(*a)
  return out, time.perf_counter() - t0


def xor_zlib(base: bytes, new: bytes) -> dict:
  """The alternative: zlib (level 1) of the whole XOR against the base."""
  a, b = np.frombuffer(base, np.uint16), np.frombuffer(new, np.uint16)
  z, enc = timed(lambda: zlib.compress((a ^ b).tobytes(), 1))
  back, dec = timed(lambda: (np.frombuffer(zlib.decompress(z), np.uint16) ^ a).tobytes())
  assert back == new
  return {"bytes": len(z), "encode_s": round(enc, 3), "decode_s": round(dec, 3)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=3, help="RL steps: versions 1..steps are deltas")
  ap.add_argument("--quick", action="store_true", help="2 layers, vocab 4096 (smoke test)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  load = round(os.getloadavg()[0], 2)
  cfg, model_cfg, source = setup(args)
  t = cfg.train
  mesh = rs.train_mesh(cfg)
  step_cfg = rl_step_config(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
  opt = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, eps=t.adam_eps,
                       weight_decay=t.weight_decay, grad_clip=t.grad_clip, warmup_steps=0,
                       schedule=t.lr_schedule, total_steps=t.steps, final_frac=t.final_lr_frac)
  graphdef, params = init_model(model_cfg, cfg.seed)
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  step, init_state = build_train_step(graphdef, opt, step_cfg, mesh, params)
  state = init_state(params)
  del params
  log(f"{model_cfg.num_layers} layers, vocab {model_cfg.vocab_size}: {n_params:,} params")

  full_server, delta_server = VersionServer(timeout_s=120), VersionServer(timeout_s=120, delta=2)
  full_client = VersionClient(full_server.address, delta=False, name="full")
  delta_client = VersionClient(delta_server.address, delta=True, name="delta")
  rows, prev = [], None
  data = batches(cfg, model_cfg.vocab_size, args.steps, args.seed)
  for v in range(args.steps + 1):
    if v:
      state, metrics = step(state, to_rows(next(data), mesh))
      jax.block_until_ready(state)
      if int(metrics["skipped_nonfinite"]):
        raise RuntimeError(f"step {v} skipped its update")
    new = wire_bytes(state.params)
    row = {"version": v, "wire_bytes": len(new)}
    for name, server, client in (("full", full_server, full_client),
                                 ("delta", delta_server, delta_client)):
      server.publish(v, new)
      before = dict(client.stats)
      got, dt = timed(client.fetch, v, 120.0)
      assert bytes(got) == new, f"{name}: version {v} not rebuilt bit for bit"
      kind = "delta" if client.stats["delta"] > before["delta"] else "full"
      row[name] = {"sync_s": round(dt, 3), "bytes": client.stats["bytes"] - before["bytes"],
                   "as": kind}
      server.retire_below(v)
      del got
    if prev is not None:
      a, b = np.frombuffer(prev, np.uint16), np.frombuffer(new, np.uint16)
      row["changed_fraction"] = round(float(np.count_nonzero(a != b)) / a.size, 5)
      _, row["delta_encode_s"] = timed(delta_lib.encode, prev, new, 2)
      row["delta_encode_s"] = round(row["delta_encode_s"], 3)
      row["xor_zlib"] = xor_zlib(prev, new)
      row["delta_over_full"] = round(row["delta"]["bytes"] / row["full"]["bytes"], 5)
    log(json.dumps(row))
    rows.append(row)
    prev = new
  full_server.close()
  delta_server.close()
  later = rows[1:]
  med = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
  print(json.dumps({
      "benchmark": "delta_sync",
      "command": shlex.join(["python", *sys.argv]),
      "date": time.strftime("%Y-%m-%d"),
      "quick": args.quick,
      "model": {"source": source, "params": n_params, "layers": model_cfg.num_layers,
                "vocab": model_cfg.vocab_size, "param_dtype": model_cfg.param_dtype,
                "wire_dtype": "bfloat16"},
      "update": {"recipe": RECIPE, "lr": t.learning_rate, "warmup_steps": 0,
                 "weight_decay": t.weight_decay, "rows": cfg.rollout.num_prompts *
                 cfg.rollout.group_size, "positions_per_row": 64},
      "versions": rows,
      "median_after_first": {
          "full_bytes": med([r["full"]["bytes"] for r in later]),
          "delta_bytes": med([r["delta"]["bytes"] for r in later]),
          "xor_zlib_bytes": med([r["xor_zlib"]["bytes"] for r in later]),
          "full_sync_s": med([r["full"]["sync_s"] for r in later]),
          "delta_sync_s": med([r["delta"]["sync_s"] for r in later]),
          "delta_encode_s": med([r["delta_encode_s"] for r in later]),
          "xor_zlib_encode_s": med([r["xor_zlib"]["encode_s"] for r in later]),
          "changed_fraction": med([r["changed_fraction"] for r in later])},
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "load_avg_1m_at_start": load, "jax": jax.__version__},
      "total_wall_s": round(time.perf_counter() - t_start, 1),
  }, indent=2))


if __name__ == "__main__":
  main()
