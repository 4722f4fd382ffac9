"""The cost of checkpoint array digests: save and restore of a Qwen2.5-0.5B-shaped train state
(f32 params + Adam mu and nu) without digests (Orbax's two items, the calls `Checkpointer` made
before digests) and with them (`jaxrl.runtime.checkpoint.Checkpointer`: host copies hashed with
CRC-32 off the calling thread, checked on restore). Prints one JSON object.

  python benchmarks/checkpoint_digest.py            # the 0.5B shape (~6 GB of arrays)
  python benchmarks/checkpoint_digest.py --quick    # 2 layers, vocab 8192
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.runtime.checkpoint import Checkpointer, abstract_like


def params_of(layers: int, vocab: int, hidden=896, heads=14, kv=2, inter=4864, seed=0) -> dict:
  head = hidden // heads
  rng = np.random.default_rng(seed)

  def w(*shape):
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02)

  tree = {"embed": w(vocab, hidden), "norm": np.ones(hidden, np.float32)}
  for i in range(layers):
    tree[f"layers_{i}"] = {
        "attn": {"q_proj": {"kernel": w(hidden, heads * head), "bias": w(heads * head)},
                 "k_proj": {"kernel": w(hidden, kv * head), "bias": w(kv * head)},
                 "v_proj": {"kernel": w(hidden, kv * head), "bias": w(kv * head)},
                 "o_proj": {"kernel": w(heads * head, hidden)}},
        "mlp": {"gate": {"kernel": w(hidden, inter)}, "up": {"kernel": w(hidden, inter)},
                "down": {"kernel": w(inter, hidden)}},
        "input_norm": np.ones(hidden, np.float32), "post_norm": np.ones(hidden, np.float32)}
  return tree


def state_of(params) -> dict:
  mu = jax.tree.map(lambda p: p * np.float32(0.1), params)
  nu = jax.tree.map(lambda p: p * p, params)
  return jax.device_put({"train": {"params": params, "mu": mu, "nu": nu,
                                   "step": np.int32(1000)}})


def plain_save(directory, state):
  mngr = ocp.CheckpointManager(directory, item_names=("state", "host"))
  t0 = time.perf_counter()
  mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                       host=ocp.args.JsonSave({"step": 1})))
  t1 = time.perf_counter()
  mngr.wait_until_finished()
  t2 = time.perf_counter()
  mngr.close()
  return t1 - t0, t2 - t0


def plain_restore(directory, target):
  mngr = ocp.CheckpointManager(directory, item_names=("state", "host"))
  t0 = time.perf_counter()
  out = mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                host=ocp.args.JsonRestore()))
  jax.block_until_ready(out.state)
  dt = time.perf_counter() - t0
  mngr.close()
  return dt


def digest_save(directory, state):
  with Checkpointer(directory) as ck:
    t0 = time.perf_counter()
    ck.save(1, state, {"step": 1})
    t1 = time.perf_counter()
    ck.wait()
    t2 = time.perf_counter()
  return t1 - t0, t2 - t0


def digest_restore(directory, target):
  with Checkpointer(directory, read_only=True, say=lambda s: None) as ck:
    t0 = time.perf_counter()
    out, _ = ck.restore(1, target)
    jax.block_until_ready(out)
    return time.perf_counter() - t0


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--repeats", type=int, default=1)
  args = ap.parse_args()
  layers, vocab = (2, 8192) if args.quick else (24, 151936)
  state = state_of(params_of(layers, vocab))
  target = abstract_like(state)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  print(f"state: {nbytes / 2**30:.2f} GiB, {len(jax.tree.leaves(state))} arrays", file=sys.stderr)
  runs = {"plain": [], "digest": []}
  for r in range(args.repeats):
    for name, save, restore in (("plain", plain_save, plain_restore),
                                ("digest", digest_save, digest_restore)):
      root = tempfile.mkdtemp(prefix=f"ckbench_{name}_")
      try:
        blocking, durable = save(root, state)
        restored = restore(root, target)
      finally:
        shutil.rmtree(root, ignore_errors=True)
      runs[name].append({"save_blocking_s": blocking, "save_durable_s": durable,
                         "restore_s": restored})
      print(f"{name} {r}: {runs[name][-1]}", file=sys.stderr)

  def med(name, key):
    return float(np.median([x[key] for x in runs[name]]))

  keys = ("save_blocking_s", "save_durable_s", "restore_s")
  out = {"benchmark": "checkpoint_digest", "date": datetime.date.today().isoformat(),
         "shape": {"layers": layers, "vocab": vocab, "hidden": 896, "heads": 14, "kv_heads": 2,
                   "intermediate": 4864},
         "state_bytes": int(nbytes), "repeats": args.repeats, "device": str(jax.devices()[0]),
         "runs": runs,
         "median": {n: {k: med(n, k) for k in keys} for n in runs},
         "slowdown": {k: med("digest", k) / med("plain", k) - 1 for k in keys}}
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  main()
