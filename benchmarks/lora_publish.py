"""LoRA publishing: bytes and time per published params version, with and without adapters, and
whether the sampler should apply the adapters in every matmul or get merged weights.

LoRA: rank 16, alpha 32, on all seven projections (q, k, v, o, gate, up, down) of every layer
(`ModelConfig.lora_*`, `jaxrl.models.lora`). Three parts, one JSON object on stdout (progress on
stderr):

1. `bytes`: what one published version moves on the Qwen2.5-0.5B shape (f32, from shapes alone):
   the adapters (`lora.nbytes`, checked against sum over targets of L x (din + dout) x r x 4) vs
   the whole model without LoRA; target: adapters <= 1/50 of the model.
2. `publish`: time per version on a Qwen2.5-0.5B-shaped f32 tree (random values put straight
   into their shardings) on benchmarks/reshard.py's meshes: train mesh devices 0-3 (1, 4, 1),
   rollout mesh devices 4-7 (1, 1, 4), both by `param_shardings`.
     colocated       without LoRA: a fresh copy of the params (`jax.tree.map(jnp.copy, .)`,
                     jitted); with LoRA: `lora.AdapterSync(cfg, lambda t: t)(params)` after its
                     first call (the merge alone)
     disaggregated   without LoRA: `parallel.reshard(params, rollout shardings)`; with LoRA:
                     `AdapterSync(cfg, move=reshard onto the rollout mesh)` after its first call
                     (the adapters moved, then merged on the rollout mesh)
   Each AdapterSync's first call (the frozen base moved once, compiles) is reported apart. Timed
   calls of the two sides alternate (same machine load); `speedup` = median of the per-pair
   ratios without / with LoRA (> 1: publishing with LoRA is faster).
3. `sampler`: apply vs merge for the jaxrl sampler (`rollout.sampler.make_sampler`, driven as
   benchmarks/sampler_throughput.py drives it: every row generates exactly N tokens): (i) the LoRA
   model's graphdef with the unmerged params (adapters applied in every matmul) vs (ii) the base
   graphdef with `lora.merge(...)` params, plus the merge per version (one version per sampled
   batch). Cases: `default` (the default recipe's model, vocab 14, 128 prompts x 8 samples =
   1024 rows, prompt 6, 4 new tokens, unrolled layers) and `mid` (Qwen2.5-0.5B layer dims, 4
   layers scanned, vocab 32768 so that the layers hold about the share of the weights they hold
   in the 24-layer model, 4 prompts x 2 samples, prompt 16, 32 new tokens). Adapters' B is random
   (not LoRA's zero init), so the adapters change the model; the two paths' tokens for the same
   keys are compared. `break_even_tokens_per_version`: the merge's time over what applying costs
   per generated token (prefill included): merging pays once a version samples more tokens.

Times: medians of `--repeats` calls (`--sampler-repeats` for the sampler), each blocked until
ready, after one untimed call (reported as `first_*`).

  PYTHONPATH=. python benchmarks/lora_publish.py [--repeats 3]   # ~3-4 min on 2 shared cores
  PYTHONPATH=. python benchmarks/lora_publish.py --parts bytes,sampler --mid-layers 8
  PYTHONPATH=. python benchmarks/lora_publish.py --quick   # smoke test: tiny shapes, ~30 s
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(_flags + ["--xla_force_host_platform_device_count=8"])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sampler_throughput as st  # noqa: E402  (benchmarks/sampler_throughput.py: the driver)
from jaxrl import parallel  # noqa: E402
from jaxrl.recipes.default import get_config  # noqa: E402
from jaxrl.models import lora  # noqa: E402
from jaxrl.models.layers import lora_dims  # noqa: E402
from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import abstract_model  # noqa: E402
from jaxrl.rollout.static_sampler import make_sampler  # noqa: E402

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
TARGET_RATIO = 1 / 50  # adapter bytes / model bytes per published version
DEFAULT_VOCAB = st.DEFAULT_VOCAB  # the `add` task's CharTokenizer


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def with_lora(cfg: ModelConfig, rank: int, alpha: float) -> ModelConfig:
  return dataclasses.replace(cfg, lora_rank=rank, lora_alpha=float(alpha), lora_targets=TARGETS)


def dims(cfg: ModelConfig) -> dict:
  return {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "num_layers", "num_heads",
                                       "num_kv_heads", "head_dim", "mlp_dim", "qkv_bias",
                                       "tie_embeddings", "scan_layers", "param_dtype",
                                       "lora_rank", "lora_alpha", "lora_targets")}


def adapter_params_arithmetic(cfg: ModelConfig) -> int:
  """sum over targets of L x (din + dout) x r: A [L, din, r] and B [L, r, dout] per target."""
  return sum(cfg.num_layers * sum(lora_dims(cfg, t)) * cfg.lora_rank for t in cfg.lora_targets)


def bytes_report(cfg: ModelConfig) -> dict:
  """Bytes per published version, from shapes alone (nothing allocated)."""
  _, abstract = abstract_model(cfg)
  adapters, base = lora.split(abstract)
  a, m = lora.nbytes(adapters), lora.nbytes(base)
  itemsize = np.dtype(cfg.param_dtype).itemsize
  return {"model_config": dims(cfg),
          "adapter_params": sum(int(x.size) for x in jax.tree.leaves(adapters)),
          "adapter_params_arithmetic": adapter_params_arithmetic(cfg),
          "model_params": sum(int(x.size) for x in jax.tree.leaves(base)),
          "adapter_bytes": a, "model_bytes": m,
          "adapter_bytes_arithmetic": adapter_params_arithmetic(cfg) * itemsize,
          "ratio": a / m, "model_over_adapters": round(m / a, 2),
          "target": "adapter_bytes / model_bytes <= 1/50", "met": a / m <= TARGET_RATIO}


def median(xs):
  return round(statistics.median(xs), 5)


def timed(fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def side_by_side(name: str, without, with_, repeats: int, check=None) -> dict:
  """`repeats` alternating timed calls of `without()` and `with_()` (outputs dropped after each;
  `check(out)` runs untimed on each `with_` output)."""
  tw, tl = [], []
  for r in range(repeats):
    out, t = timed(without)
    del out
    tw.append(t)
    out, t = timed(with_)
    if check is not None:
      check(out)
    del out
    tl.append(t)
    gc.collect()
    log(f"[{name}] {r + 1}/{repeats}: without LoRA {tw[-1]:.3f}s, with {tl[-1]:.3f}s")
  return {"without_lora_s": median(tw), "with_lora_s": median(tl),
          "without_lora_times_s": [round(t, 4) for t in tw],
          "with_lora_times_s": [round(t, 4) for t in tl],
          "speedup": round(statistics.median(a / b for a, b in zip(tw, tl)), 3)}


def put_random(abstract, shardings, seed: int):
  """Random normal leaves (x 0.02), drawn by numpy one leaf at a time and put straight into
  their shardings (benchmarks/reshard.py's tree; a jitted threefry draw of 0.5B values takes
  minutes on 2 shared cores, and the values do not matter here)."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree_util.tree_flatten(abstract)
  out = []
  for a, s in zip(leaves, treedef.flatten_up_to(shardings)):
    x = rng.standard_normal(a.shape, dtype=np.float32)
    x *= 0.02
    out.append(jax.device_put(x.astype(a.dtype, copy=False), s).block_until_ready())
    del x
  return treedef.unflatten(out)


def publish_report(cfg: ModelConfig, repeats: int, seed: int, quick: bool) -> dict:
  devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit(f"needs 8 devices, got {len(devices)}")
  train_mesh = parallel.make_mesh(1, 4, 1, devices[:4])
  rollout_mesh = parallel.make_mesh(1, 1, 4, devices[4:8])
  _, abstract = abstract_model(cfg)
  log(f"[publish] creating the params on the train mesh ({'tiny' if quick else '0.5B'})")
  t0 = time.perf_counter()
  params = put_random(abstract, parallel.param_shardings(abstract, train_mesh), seed)
  init_s = time.perf_counter() - t0
  adapters, base = lora.split(params)
  a_bytes, m_bytes = lora.nbytes(adapters), lora.nbytes(base)
  log(f"[publish] base {m_bytes / 1e9:.3f} GB, adapters {a_bytes / 1e6:.2f} MB, made in "
      f"{init_s:.1f}s")
  out = {"model_config": dims(cfg), "adapter_bytes": a_bytes, "model_bytes": m_bytes,
         "train_mesh": {"devices": [d.id for d in train_mesh.devices.flat],
                        "shape": dict(train_mesh.shape)},
         "rollout_mesh": {"devices": [d.id for d in rollout_mesh.devices.flat],
                          "shape": dict(rollout_mesh.shape)},
         "init_s": round(init_s, 2)}
  # Reference merged weights (the adapted leaves, on the host) to check both syncs against.
  names = [lora.WEIGHTS[t] for t in cfg.lora_targets]
  checked = names if quick else ["wq", "wk"]  # the whole 1.4 GB on the host is not worth it
  expected = {n: np.asarray(jax.device_get(lora.merge(cfg, params)[n][...])) for n in checked}

  def checker(kind, sync, moved, mesh):
    def check(merged):
      if moved is not None:
        moved.append(sync.last_moved_bytes)
      for n in checked:
        x = merged[n][...]
        ok = set(x.sharding.device_set) == set(mesh.devices.flat) and np.allclose(
            np.asarray(jax.device_get(x)), expected[n], rtol=1e-6, atol=1e-6)
        if not ok:
          raise RuntimeError(f"{kind}: merged {n} differs from lora.merge's or is misplaced")
    return check

  # ---- colocated: a copy of the whole params vs the merge alone.
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
  sync = lora.AdapterSync(cfg, lambda t: t)
  _, first_copy = timed(lambda: copy(base))
  first, first_s = timed(lambda: sync(params))
  first_moved = sync.last_moved_bytes
  moved = []
  checker("colocated", sync, None, train_mesh)(first)
  del first
  log(f"[colocated] first: copy {first_copy:.2f}s, AdapterSync {first_s:.2f}s")
  co = side_by_side("colocated", lambda: copy(base), lambda: sync(params), repeats,
                    checker("colocated", sync, moved, train_mesh))
  co.update({"first_without_lora_s": round(first_copy, 4), "first_with_lora_s": round(first_s, 4),
             "moved_bytes_first": first_moved, "moved_bytes_after": moved,
             "without_lora": "jit(tree.map(jnp.copy)) of the whole params",
             "with_lora": "AdapterSync(cfg, lambda t: t)(params): merge only"})
  out["colocated"] = co

  # ---- disaggregated: reshard the whole params vs move the adapters and merge there.
  rollout_sh = parallel.param_shardings(base, rollout_mesh)
  move = lambda t: parallel.reshard(t, parallel.param_shardings(t, rollout_mesh))
  _, first_reshard = timed(lambda: parallel.reshard(base, rollout_sh))
  sync = lora.AdapterSync(cfg, move)
  first, first_s = timed(lambda: sync(params))
  first_moved = sync.last_moved_bytes
  moved = []
  checker("disaggregated", sync, None, rollout_mesh)(first)
  del first
  log(f"[disaggregated] first: reshard {first_reshard:.2f}s, AdapterSync {first_s:.2f}s "
      f"(base moved)")
  di = side_by_side("disaggregated", lambda: parallel.reshard(base, rollout_sh),
                    lambda: sync(params), repeats,
                    checker("disaggregated", sync, moved, rollout_mesh))
  di.update({"first_without_lora_s": round(first_reshard, 4),
             "first_with_lora_s": round(first_s, 4),
             "moved_bytes_first": first_moved, "moved_bytes_after": moved,
             "base_bytes": sync.base_bytes,
             "without_lora": "parallel.reshard(params, rollout shardings)",
             "with_lora": "AdapterSync(cfg, move=reshard onto the rollout mesh)(params): adapters "
                          "moved, merged on the rollout mesh"})
  out["disaggregated"] = di
  out["merged_leaves_checked"] = checked
  return out


# ---- apply vs merge in the sampler ---------------------------------------------------------------


def random_params(cfg: ModelConfig, seed: int):
  """(graphdef, params) drawn by numpy (no init program to compile), with `init_model`'s
  distributions (norms 1, biases 0, weights N(0, init_std), adapters' A He-uniform as
  `nnx.LoRA`'s) except the adapters' B: N(0, init_std), not LoRA's zeros, so that the adapted
  model differs from its base. As benchmarks/sampler_throughput.py draws large models."""
  graphdef, abstract = abstract_model(cfg)
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    if "norm" in name:
      a = np.ones(x.shape, np.float32)
    elif name in ("bq", "bk", "bv"):
      a = np.zeros(x.shape, np.float32)
    elif name == "lora_a":  # [L, din, r]
      limit = np.sqrt(6.0 / x.shape[1])
      a = rng.uniform(-limit, limit, x.shape).astype(np.float32)
    else:
      a = rng.standard_normal(x.shape, dtype=np.float32)
      a *= cfg.init_std
    return jnp.asarray(a, x.dtype)

  return graphdef, jax.tree_util.tree_map_with_path(leaf, abstract)


def sampler_report(name: str, cfg: ModelConfig, prompts: int, group: int, prompt_len: int,
                   new_tokens: int, repeats: int, seed: int) -> dict:
  case = st.Case(name, cfg, prompts, group, prompt_len, new_tokens, "qwen2")
  tokens_np, valid_np = st.make_prompts(case, seed)
  toks, valid = jnp.asarray(tokens_np), jnp.asarray(valid_np)
  rows = prompts * group
  request_ids = jnp.arange(rows, dtype=jnp.int32)
  t0 = time.perf_counter()
  graphdef, params = random_params(cfg, seed)
  params = jax.block_until_ready(params)
  base_graphdef, _ = abstract_model(lora.base_config(cfg))
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  log(f"[sampler {name}] {n_params / 1e6:.1f}M params ({time.perf_counter() - t0:.1f}s), "
      f"{rows} rows x {new_tokens} tokens")
  kw = dict(num_samples=group, max_new_tokens=new_tokens, eos_id=cfg.vocab_size, pad_id=0)
  apply_gen = make_sampler(graphdef, **kw)
  merge_gen = make_sampler(base_graphdef, **kw)
  call = lambda gen, p, k: gen(p, toks, valid, jax.random.key(k), request_ids, 1.0, top_k=0,
                               top_p=1.0)
  merge = lambda: lora.merge(cfg, params)

  a_out, a_first = timed(lambda: call(apply_gen, params, 0))
  merged, m_first = timed(merge)
  b_out, b_first = timed(lambda: call(merge_gen, merged, 0))
  assert bool(a_out.mask.all()) and bool(b_out.mask.all()), "a row stopped early"
  same = np.asarray(a_out.tokens) == np.asarray(b_out.tokens)
  lp_a, lp_b = np.asarray(a_out.logprobs), np.asarray(b_out.logprobs)
  first_diff = [int(i) for i in np.argwhere(~same.all(-1)).ravel()[:5]]
  # Rows equal up to their first different token: compare log-probs there.
  upto = np.cumprod(same, axis=-1).astype(bool)
  lp_diff = float(np.abs(lp_a - lp_b)[upto].max()) if upto.any() else None
  del a_out, b_out
  log(f"[sampler {name}] first calls: apply {a_first:.2f}s, merge {m_first:.2f}s, merged "
      f"{b_first:.2f}s; tokens equal: {bool(same.all())}")

  ta, tm, tb = [], [], []
  for r in range(repeats):  # the two sides alternate, in turn first
    if r % 2:
      merged, t = timed(merge)
      tm.append(t)
      _, t = timed(lambda: call(merge_gen, merged, r + 1))
      tb.append(t)
    _, t = timed(lambda: call(apply_gen, params, r + 1))
    ta.append(t)
    if not r % 2:
      merged, t = timed(merge)
      tm.append(t)
      _, t = timed(lambda: call(merge_gen, merged, r + 1))
      tb.append(t)
    log(f"[sampler {name}] {r + 1}/{repeats}: apply {ta[-1]:.4f}s, merge {tm[-1]:.4f}s + "
        f"merged sample {tb[-1]:.4f}s")
  gen_tokens = rows * new_tokens
  pair = lambda num, den: round(statistics.median(n / d for n, d in zip(num, den)), 3)
  merged_total = [m + b for m, b in zip(tm, tb)]
  # What applying costs per generated token over sampling merged weights, and the tokens a
  # version must sample for its one merge to pay for itself (None: applying was not slower).
  overhead = statistics.median(a - b for a, b in zip(ta, tb)) / gen_tokens
  break_even = round(statistics.median(tm) / overhead) if overhead > 0 else None
  # The same from the fastest call of each (contention from other jobs only adds time).
  overhead_min = (min(ta) - min(tb)) / gen_tokens
  break_even_min = round(min(tm) / overhead_min) if overhead_min > 0 else None
  return {
      "model_config": dims(cfg), "params_millions": round(n_params / 1e6, 2),
      "prompts": prompts, "samples_per_prompt": group, "rows": rows, "prompt_len": prompt_len,
      "new_tokens": new_tokens, "generated_tokens_per_call": gen_tokens,
      "apply": {"first_call_s": round(a_first, 3), "median_call_s": median(ta),
                "call_s": [round(t, 4) for t in ta], "tokens_per_s": round(gen_tokens /
                                                                            median(ta), 1)},
      "merged": {"first_call_s": round(b_first, 3), "median_call_s": median(tb),
                 "call_s": [round(t, 4) for t in tb], "tokens_per_s": round(gen_tokens /
                                                                             median(tb), 1)},
      "merge_per_version": {"first_call_s": round(m_first, 3), "median_s": median(tm),
                            "call_s": [round(t, 4) for t in tm]},
      "merged_plus_merge_s": median(merged_total),
      "merged_plus_merge_tokens_per_s": round(gen_tokens / median(merged_total), 1),
      # > 1: the merged sampler is faster (per-pair medians of apply time / merged time).
      "speedup_merged_over_apply": pair(ta, tb),
      "speedup_merged_plus_merge_over_apply": pair(ta, merged_total),
      "faster": "merge" if statistics.median(ta) > statistics.median(merged_total) else "apply",
      "apply_overhead_s_per_token": overhead,
      "break_even_tokens_per_version": break_even,
      "min_s": {"apply": round(min(ta), 5), "merged": round(min(tb), 5),
                "merge": round(min(tm), 5)},
      "speedup_merged_plus_merge_over_apply_min": round(min(ta) / (min(tb) + min(tm)), 3),
      "break_even_tokens_per_version_min": break_even_min,
      "tokens_equal": bool(same.all()),
      "token_match_fraction": float(same.mean()),
      "rows_differing": int((~same.all(-1)).sum()), "first_rows_differing": first_diff,
      "max_abs_logprob_diff_equal_prefix": lp_diff,
  }


def sampler_cases(args) -> dict:
  default = ModelConfig.from_config(get_config().model, DEFAULT_VOCAB)
  r = get_config().rollout
  if args.quick:
    return {"default": (with_lora(default, args.rank, args.alpha), 8, 2, r.max_prompt_len,
                        r.max_new_tokens)}
  mid = ModelConfig.qwen2_5_0_5b(scan_layers=True, num_layers=args.mid_layers)
  if args.mid_vocab:
    mid = dataclasses.replace(mid, vocab_size=args.mid_vocab)
  return {"default": (with_lora(default, args.rank, args.alpha), r.num_prompts, r.group_size,
                      r.max_prompt_len, r.max_new_tokens),
          "mid": (with_lora(mid, args.rank, args.alpha), args.mid_prompts, args.mid_group,
                  args.mid_prompt_len, args.mid_new_tokens)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--repeats", type=int, default=3,
                  help="timed publishes of each side (median)")
  ap.add_argument("--sampler-repeats", type=int, default=5,
                  help="timed sampler calls of each side (median)")
  ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
  ap.add_argument("--parts", default="bytes,publish,sampler",
                  help="comma list of: bytes, publish, sampler")
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--alpha", type=float, default=32.0)
  ap.add_argument("--mid-layers", type=int, default=4, help="layers of the mid sampler case")
  ap.add_argument("--mid-vocab", type=int, default=32768,
                  help="its vocab (0: Qwen2.5's 151936; the default keeps the layers' share of "
                       "the weights near the full 24-layer model's)")
  ap.add_argument("--mid-prompts", type=int, default=4)
  ap.add_argument("--mid-group", type=int, default=2)
  ap.add_argument("--mid-prompt-len", type=int, default=16)
  ap.add_argument("--mid-new-tokens", type=int, default=32)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  parts = {p.strip() for p in args.parts.split(",") if p.strip()}
  if parts - {"bytes", "publish", "sampler"} or min(args.repeats, args.sampler_repeats) < 1:
    ap.error("--parts: a comma list of bytes, publish, sampler; repeats >= 1")
  t_start = time.perf_counter()
  qwen = with_lora(ModelConfig.qwen2_5_0_5b(scan_layers=True), args.rank, args.alpha)
  tiny = with_lora(ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                               tie_embeddings=True), args.rank, args.alpha)
  report = {
      "benchmark": "lora_publish", "quick": args.quick, "repeats": args.repeats,
      "sampler_repeats": args.sampler_repeats,
      "lora": {"rank": args.rank, "alpha": args.alpha, "targets": list(TARGETS)},
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(), "devices": jax.device_count(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
  }
  if "bytes" in parts:
    report["bytes"] = bytes_report(qwen)
    b = report["bytes"]
    log(f"[bytes] Qwen2.5-0.5B f32: adapters {b['adapter_bytes']:,} B vs model "
        f"{b['model_bytes']:,} B: 1/{b['model_over_adapters']}")
  if "publish" in parts:
    cfg = tiny if args.quick else qwen
    report["publish"] = publish_report(cfg, args.repeats, args.seed, args.quick)
    report["publish"]["model"] = "tiny" if args.quick else "Qwen2.5-0.5B shape"
    gc.collect()  # the closures' cycles hold the publish's arrays
  if "sampler" in parts:
    report["sampler"] = {}
    for name, (cfg, p, g, lp, n) in sampler_cases(args).items():
      report["sampler"][name] = sampler_report(name, cfg, p, g, lp, n, args.sampler_repeats,
                                               args.seed)
      gc.collect()
    report["sampler_conclusion"] = {
        name: {"faster_per_version": s["faster"],
               "merge_path_supported": s["faster"] == "merge",
               "speedup_merged_plus_merge_over_apply": s["speedup_merged_plus_merge_over_apply"],
               "tokens_per_version": s["generated_tokens_per_call"],
               "break_even_tokens_per_version": s["break_even_tokens_per_version"]}
        for name, s in report["sampler"].items()}
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
