"""The cost of checkpoint array digests: save and restore of a Qwen2.5-0.5B-shaped train state
(f32 params + Adam mu and nu) without digests (Orbax's two items, the calls `Checkpointer` made
before digests) and with them (`jaxrl.runtime.checkpoint.Checkpointer`: host copies hashed with
CRC-32 off the calling thread, checked on restore). Prints one JSON object.

  python benchmarks/checkpoint_digest.py --repeats 3   # the 0.5B shape (~6 GB of arrays), ~10 min
  python benchmarks/checkpoint_digest.py --quick        # 2 layers, vocab 8192

Each measurement (a save and its wait, plain or with digests, into a fresh directory; or a
restore) runs in a fresh child process that builds the same seeded state: a process that saved
and restored 5.5 GiB twice grew past 24 GB (freed host copies are not returned to the OS), so
repeats in one process were killed by the OOM killer. Every restore reads the same step (saved
once with digests; a plain restore reads its two Orbax items and leaves the digests), so both
sides read identical files. The sides alternate plain/digest, in the order ABBA over each pair
of repeats, so a drift of the machine falls on both alike; the medians are reported. One
discarded save and restore of each kind runs first (`--warmup 0`: none): the first child on a
fresh machine saved ~2.5x slower than the next ones, and it was always a plain one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.runtime import digest
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
  return dt, out.state


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
    return time.perf_counter() - t0, out


def measure(what: str, name: str, layers: int, vocab: int, directory: str | None) -> dict:
  """One measurement in this process: a save (and its wait) of the seeded state into a fresh
  directory, plain or with digests; or a restore of step 1 of `directory`."""
  state = state_of(params_of(layers, vocab))
  facts = {"state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state))),
           "arrays": len(jax.tree.leaves(state))}
  pool = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1))  # Checkpointer's
  if what == "restore":
    target = abstract_like(state)
    del state
    restore = {"plain": plain_restore, "digest": digest_restore}[name]
    seconds, restored = restore(directory, target)
    out = {"restore_s": seconds, **facts}
    if name == "digest":  # the hashing alone, again, on the restored arrays
      t0 = time.perf_counter()
      assert digest.mismatch(digest.read(os.path.join(directory, "1")), restored, pool) is None
      out["hash_s"] = time.perf_counter() - t0
    return out
  save = {"plain": plain_save, "digest": digest_save}[name]
  root = directory or tempfile.mkdtemp(prefix=f"ckbench_{name}_")
  try:
    blocking, durable = save(root, state)
  finally:
    if directory is None:
      shutil.rmtree(root, ignore_errors=True)
  out = {"save_blocking_s": blocking, "save_durable_s": durable, **facts}
  if name == "digest":  # the work digests add, alone: the host copy and the hashing
    t0 = time.perf_counter()
    digest.compute(jax.device_get(state), pool)
    out["hash_s"] = time.perf_counter() - t0
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                  help="1: one discarded save and restore of each kind first")
  ap.add_argument("--child", default=None,
                  help="save:plain|save:digest|restore:plain|restore:digest: one measurement in "
                       "this process, printed (used by the parent)")
  ap.add_argument("--dir", default=None, help="--child: the checkpoint directory")
  args = ap.parse_args()
  if args.repeats < 1:
    raise SystemExit(f"jaxrl: --repeats must be at least 1, got {args.repeats}")
  layers, vocab = (2, 8192) if args.quick else (24, 151936)
  if args.child:
    what, _, name = args.child.partition(":")
    if what not in ("save", "restore") or name not in ("plain", "digest"):
      raise SystemExit(f"jaxrl: --child takes save|restore:plain|digest, got {args.child!r}")
    print(json.dumps(measure(what, name, layers, vocab, args.dir)))
    return
  runs = {"plain": [], "digest": []}
  facts = {}

  def child(kind: str, directory: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind]
    cmd += ["--quick"] * args.quick + (["--dir", directory] if directory else [])
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
      raise SystemExit(f"jaxrl: the {kind} measurement exited with {done.returncode}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    facts.update(state_bytes=row.pop("state_bytes"), arrays=row.pop("arrays"))
    return row

  shared = tempfile.mkdtemp(prefix="ckbench_restore_")
  try:
    child("save:digest", shared)  # the step every restore reads (plain ones skip its digests)
    # The first child of each kind is discarded: on a fresh machine the first save ran ~2.5x
    # slower than the next ones, and it was always a plain one.
    warm = [(-1, name) for name in ("plain", "digest")] if args.warmup else []
    abba = [(r, name) for r in range(args.repeats)
            for name in (("plain", "digest") if r % 2 == 0 else ("digest", "plain"))]
    for r, name in warm + abba:
      saved, restored = child(f"save:{name}"), child(f"restore:{name}", shared)
      if name == "digest":
        saved["save_hash_s"], restored["restore_hash_s"] = saved.pop("hash_s"), \
            restored.pop("hash_s")
      row = {**saved, **restored}
      print(f"{name} {'warm-up' if r < 0 else r}: {row}", file=sys.stderr, flush=True)
      if r >= 0:
        runs[name].append(row)
  finally:
    shutil.rmtree(shared, ignore_errors=True)
  nbytes, arrays = facts["state_bytes"], facts["arrays"]

  def med(name, key):
    return float(np.median([x[key] for x in runs[name]]))

  keys = ("save_blocking_s", "save_durable_s", "restore_s")
  out = {"benchmark": "checkpoint_digest", "date": datetime.date.today().isoformat(),
         "shape": {"layers": layers, "vocab": vocab, "hidden": 896, "heads": 14, "kv_heads": 2,
                   "intermediate": 4864},
         "state_bytes": nbytes, "arrays": arrays, "repeats": args.repeats, "warmup": args.warmup,
         "device": str(jax.devices()[0]), "runs": runs,
         "median": {n: {k: med(n, k) for k in keys} for n in runs},
         "slowdown": {k: med("digest", k) / med("plain", k) - 1 for k in keys},
         # The digests' own work, timed alone in the same processes, over plain's medians: what
         # it would add if none of it overlapped Orbax's.
         "hashing": {"save_hash_s": med("digest", "save_hash_s"),
                     "restore_hash_s": med("digest", "restore_hash_s"),
                     "of_plain_save_durable": med("digest", "save_hash_s") /
                     med("plain", "save_durable_s"),
                     "of_plain_restore": med("digest", "restore_hash_s") /
                     med("plain", "restore_s")}}
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  main()
