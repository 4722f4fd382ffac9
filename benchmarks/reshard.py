"""Publishing params from a train mesh to a disjoint rollout mesh: peak per-device memory and time.

Workload: a Qwen2.5-0.5B-shaped param tree (`ModelConfig.qwen2_5_0_5b(scan_layers=True)`, f32,
494M params, 1.98 GB), random normal values created directly sharded on the train mesh (devices
0-3, ('data', 'fsdp', 'tensor') = (1, 4, 1), `param_shardings`; one jitted program with those
`out_shardings`, so no leaf is ever built on one device), published to the rollout mesh (devices
4-7, (1, 1, 4) or `--rollout-mesh`). `--quick`: a tiny model, drawn by numpy and put from the host.

Methods:
  reshard  `jaxrl.parallel.reshard` (per leaf: an all-to-all on the train devices, then a
           device-to-device copy per shard; leaves the rollout mesh replicates go piece by piece)
  gather   every leaf put whole onto device 0 (`jax.device_put(x, device_0)`), then put from there
           onto the rollout shardings, then the gathered copies deleted

Memory is jaxrl's live-array accounting (`jaxrl.parallel.reshard.device_bytes`: the bytes of every
live array's shards, per device), because the CPU backend's `memory_stats()` is None. It is
sampled between steps: after each leaf's intermediate and final step (reshard's `observe`), after
each leaf is gathered, after the whole tree is gathered and after each leaf is put on the rollout
mesh (gather). Temporaries inside an XLA program are not live arrays; the compiled collectives'
`memory_analysis().temp_size_in_bytes` per leaf is reported next to it (its max over leaves is an
upper bound on what the samples miss, since leaves run one at a time), and both ratios must meet
the target. `net` figures subtract each device's baseline (the train params already resident).
Also counted: calls of JAX's host-copy fallback (`shard_sharded_device_array_slow_path`, which
takes the whole array to the host unless a source shard already matches).

Prints ONE JSON object on stdout (progress on stderr). Times are medians of `--repeats` runs,
blocked until ready, after one untimed run (compiles; its time is reported as `first_*_s`).

  PYTHONPATH=. python benchmarks/reshard.py [--repeats 3]
  PYTHONPATH=. python benchmarks/reshard.py --rollout-mesh 2,1,2   # 2 row shards x tensor 2
  PYTHONPATH=. python benchmarks/reshard.py --quick   # smoke test: tiny model
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(_flags + ["--xla_force_host_platform_device_count=8"])

import argparse  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax._src.array as jax_array  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import abstract_model  # noqa: E402
from jaxrl.parallel import make_mesh, param_shardings  # noqa: E402
from jaxrl.parallel.reshard import device_bytes, leaf_path, reshard  # noqa: E402

TARGET = 0.5  # peak per-device bytes, reshard / gather


def log(*a):
  print(*a, file=sys.stderr, flush=True)


class HostCopies:
  """Counts calls of JAX's resharding fallback that may copy a whole array to the host."""

  def __init__(self):
    self.calls = 0
    self._orig = jax_array.shard_sharded_device_array_slow_path

  def __enter__(self):
    def counted(*args, **kwargs):
      self.calls += 1
      return self._orig(*args, **kwargs)

    jax_array.shard_sharded_device_array_slow_path = counted
    return self

  def __exit__(self, *exc):
    jax_array.shard_sharded_device_array_slow_path = self._orig


class Sampler:
  """Max of `device_bytes()` per device over the points it is called at."""

  def __init__(self):
    self.peak = collections.Counter()
    self.samples = 0

  def __call__(self, stage: str = "") -> None:
    self.samples += 1
    for d, b in device_bytes().items():
      self.peak[d] = max(self.peak[d], b)


def random_params(abstract, shardings, seed: int, on_host: bool = False):
  """Random normal leaves (x 0.02), made by one jitted program straight into their shardings;
  `on_host`: drawn by numpy and put from the host instead (no compile: the smoke test's tree)."""
  if on_host:
    rng = np.random.default_rng(seed)
    values = jax.tree.map(lambda a: (rng.standard_normal(a.shape) * 0.02).astype(a.dtype),
                          abstract)
    return jax.block_until_ready(jax.device_put(values, shardings))

  def make(key):
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([(jax.random.normal(k, a.shape, np.float32) * 0.02).astype(a.dtype)
                              for k, a in zip(keys, leaves)])

  return jax.block_until_ready(jax.jit(make, out_shardings=shardings)(jax.random.key(seed)))


def gather_publish(leaves, treedef, dst_shardings, device, observe=None):
  """Every leaf whole onto `device`, then onto the rollout shardings; the gathered copies are
  dropped leaf by leaf as they are put."""
  note = observe or (lambda stage: None)
  whole = []
  for x in leaves:
    whole.append(jax.device_put(x, device).block_until_ready())
    note("gathered leaf")
  note("gathered tree")
  out = []
  for i, s in enumerate(treedef.flatten_up_to(dst_shardings)):
    out.append(jax.device_put(whole[i], s).block_until_ready())
    note("published leaf")
    whole[i] = None
  return treedef.unflatten(out)


def refresh(leaves: list) -> None:
  """Replaces each leaf by a device-side copy of itself, one leaf at a time. JAX keeps the host
  copy its fallback made on the source array (`_npy_value`, not resettable): fresh arrays make
  every gather run pay for its host copy, and free the previous run's 2 GB of them."""
  for i, x in enumerate(leaves):
    leaves[i] = jax.device_put(x, x.sharding, may_alias=False).block_until_ready()


def host_shards(x: jax.Array) -> dict:
  """Host copies of `x`'s shards. Copies: on CPU `np.asarray` of a jax.Array can be a view of
  the device buffer, which would keep it alive (and counted) while the other method runs."""
  return {s.device: np.array(s.data, copy=True) for s in x.addressable_shards}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--repeats", type=int, default=3, help="timed runs of each method (median)")
  ap.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
  ap.add_argument("--rollout-mesh", default="1,1,4",
                  help="data,fsdp,tensor of the rollout mesh on devices 4-7 (product 4)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  t_start = time.perf_counter()
  devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit(f"needs 8 devices, got {len(devices)}")

  if args.quick:
    cfg = ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=128, qkv_bias=True, tie_embeddings=True)
    model = "tiny"
  else:
    cfg = ModelConfig.qwen2_5_0_5b(scan_layers=True)
    model = "Qwen2.5-0.5B shape"
  train_mesh = make_mesh(1, 4, 1, devices[:4])
  shape = tuple(int(n) for n in args.rollout_mesh.split(","))
  if len(shape) != 3 or int(np.prod(shape)) != 4:
    raise SystemExit(f"--rollout-mesh must be 3 sizes with product 4, got {args.rollout_mesh}")
  rollout_mesh = make_mesh(*shape, devices[4:8])
  _, abstract = abstract_model(cfg)
  src_sh = param_shardings(abstract, train_mesh)
  dst_sh = param_shardings(abstract, rollout_mesh)

  # Per-leaf path and compiled temporaries (compiles each collective once; reshard reuses it).
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)]
  leaves = []
  for name, a, s, t in zip(names, jax.tree.leaves(abstract), jax.tree.leaves(src_sh),
                           jax.tree.leaves(dst_sh)):
    path, temp = leaf_path(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), t)
    leaves.append({"leaf": name, "shape": list(a.shape), "bytes": a.size * a.dtype.itemsize,
                   "train_spec": str(s.spec), "rollout_spec": str(t.spec), "path": path,
                   "xla_temp_bytes": temp})
  temps = [lf["xla_temp_bytes"] or 0 for lf in leaves]
  max_temp = max(temps)

  log(f"[reshard] creating {model} params on the train mesh")
  t0 = time.perf_counter()
  params = random_params(abstract, src_sh, args.seed, on_host=args.quick)
  params, treedef = jax.tree_util.tree_flatten(params)
  init_s = time.perf_counter() - t0
  n_params = sum(x.size for x in params)
  tree_bytes = sum(x.size * x.dtype.itemsize for x in params)
  gc.collect()
  base = device_bytes()
  log(f"[reshard] {n_params:,} params, {tree_bytes / 1e9:.3f} GB, made in {init_s:.1f} s")

  # Outputs are compared across methods, shard by shard, on the largest leaf, the largest leaf
  # of each path and the smallest (reshard's copied to the host, so that neither method's output
  # is alive while the other is measured).
  sizes = {i: lf["bytes"] for i, lf in enumerate(leaves)}
  check = {max(sizes, key=sizes.get), min(sizes, key=sizes.get)}
  for path in ("collective", "pieces", "copy"):
    of_path = [i for i in sizes if leaves[i]["path"] == path]
    if of_path:
      check.add(max(of_path, key=sizes.get))
  check = sorted(check)
  d_leaves = jax.tree.leaves(dst_sh)
  expected = {}
  equal = True

  def run(method, observe=None):
    if method == "reshard":
      return reshard(treedef.unflatten(params), dst_sh, observe=observe)
    refresh(params)  # before the clock starts and before the first sample
    gc.collect()
    if observe is not None:
      observe("start")
    t0 = time.perf_counter()
    out = gather_publish(params, treedef, dst_sh, devices[0], observe=observe)
    return out, t0

  result = {}
  for method in ("reshard", "gather"):
    times, first = [], None
    sampler = Sampler()
    with HostCopies() as hc:
      for rep in range(args.repeats + 1):  # run 0: untimed (compiles), sampled
        t0 = time.perf_counter()
        out = run(method, sampler if rep == 0 else None)
        if method == "gather":
          out, t0 = out
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t0
        if rep == 0:
          sampler()
          first = elapsed
          published = jax.tree.leaves(out)
          for i in check:
            if method == "reshard":
              expected[i] = host_shards(published[i])
            else:
              got = host_shards(published[i])
              equal &= (published[i].sharding == d_leaves[i] and got.keys() == expected[i].keys()
                        and all(np.array_equal(got[d], expected[i][d]) for d in got))
          del published
        else:
          times.append(elapsed)
        del out
        gc.collect()
    peak = max(sampler.peak.values())
    net = max(sampler.peak[d] - base.get(d, 0) for d in sampler.peak)
    log(f"[{method}] peak {peak / 1e9:.3f} GB (net {net / 1e9:.3f}), first {first:.2f} s, "
        f"runs " + " ".join(f"{t:.2f}" for t in times))
    result[method] = {"peak": peak, "net": net, "first": first, "times": times,
                      "samples": sampler.samples, "host_copy_calls": hc.calls,
                      "peak_by_device": {d.id: sampler.peak[d] for d in sorted(
                          sampler.peak, key=lambda d: d.id)}}
  del expected

  r, g = result["reshard"], result["gather"]
  ratio = r["peak"] / g["peak"]
  ratio_temp = (r["peak"] + max_temp) / g["peak"]
  med = lambda xs: round(statistics.median(xs), 4)
  paths = collections.Counter(lf["path"] for lf in leaves)
  report = {
      "benchmark": "reshard",
      "quick": args.quick,
      "model": model,
      "params": n_params,
      "tree_bytes": tree_bytes,
      "dtype": cfg.param_dtype,
      "train_mesh": {"devices": [d.id for d in train_mesh.devices.flat],
                     "shape": dict(train_mesh.shape)},
      "rollout_mesh": {"devices": [d.id for d in rollout_mesh.devices.flat],
                       "shape": dict(rollout_mesh.shape)},
      "repeats": args.repeats,
      "baseline_device_bytes": max(base.values()),
      "baseline_by_device": {d.id: b for d, b in sorted(base.items(), key=lambda kv: kv[0].id)},
      "peak_device_bytes_reshard": r["peak"],
      "peak_device_bytes_gather": g["peak"],
      "peak_net_device_bytes_reshard": r["net"],
      "peak_net_device_bytes_gather": g["net"],
      "peak_by_device_reshard": r["peak_by_device"],
      "peak_by_device_gather": g["peak_by_device"],
      "xla_temp_bytes_max": max_temp,
      "peak_device_bytes_reshard_with_xla_temp": r["peak"] + max_temp,
      "ratio": round(ratio, 4),
      "ratio_with_xla_temp": round(ratio_temp, 4),
      "ratio_net": round(r["net"] / g["net"], 4),
      "target": f"<= {TARGET}",
      "met": bool(ratio <= TARGET and ratio_temp <= TARGET),
      "time_s_reshard": med(r["times"]),
      "time_s_gather": med(g["times"]),
      "times_s_reshard": [round(t, 4) for t in r["times"]],
      "times_s_gather": [round(t, 4) for t in g["times"]],
      "first_s_reshard": round(r["first"], 3),
      "first_s_gather": round(g["first"], 3),
      "memory_samples": {"reshard": r["samples"], "gather": g["samples"]},
      "host_copy_calls_reshard": r["host_copy_calls"],
      "host_copy_calls_gather": g["host_copy_calls"],
      "outputs_equal": bool(equal),
      "outputs_checked": [names[i] for i in check],
      "reshard_paths": dict(paths),
      "leaves": leaves,
      "init_s": round(init_s, 2),
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
  }
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
