"""A recipe's train step at its real model shape: step time, model FLOPs, MFU, compiled memory and
padding, on random weights and a GSM8K-like batch; with `--rollout`, its sampler's decode speed
against the memory roofline.

Prints ONE JSON object on stdout (progress goes to stderr).

  PYTHONPATH=. python benchmarks/recipe_scale.py --recipe configs/qwen2_5_0_5b_gsm8k.py --steps 5
  PYTHONPATH=. python benchmarks/recipe_scale.py --recipe configs/llama3_2_1b_gsm8k.py --packing
  PYTHONPATH=. python benchmarks/recipe_scale.py --rollout --hf   # + the sampler, HF generate
  PYTHONPATH=. python benchmarks/recipe_scale.py --quick            # CPU smoke test, < 2 min

The model. The recipe's `model.hf_path` checkpoint is not read (it need not exist): the
architecture comes from `--hf-config path/to/config.json` when given, else from `ARCHITECTURES`
(published shapes) by the checkpoint directory's name, with random weights. As the trainer
does with a checkpoint, the recipe sets `param_dtype`, `scan_layers`, compute `dtype`, `remat`
and `attention`. `--layers N` keeps the first N layers; `--quick` keeps 2 layers, a 4,096-token
vocabulary, 4 prompts x 4 samples of 32 + 64 tokens and 256-token packed rows.

The step. The recipe's RL step as the trainer builds it: `rl_step_config` (objective, shared
prompts, micro-batching, token-budget packing when `train.packing`), the recipe's optimizer, the
train mesh of `mesh.*` over the visible devices. `--packing/--no-packing`, `--microbatches` and
`--microbatch-tokens` override the recipe. One batch of rollout.num_prompts x group_size rows of
max_prompt_len + max_new_tokens positions, drawn once (seeded) from the length distribution
below, is timed for `--steps` steps after `--warmup` untimed ones; packed and unpacked runs with
the same `--seed` time the same data. The step is compiled once ahead of time (`lower().compile()`,
its `memory_analysis()` reported) and that executable is what is timed.

The length distribution (GSM8K-like; an assumption stated here, not measured from a model):
- prompt (chat template + question + instruction), per group: Normal(mean 120, sd 25) tokens,
  rounded, clipped to [8, max_prompt_len];
- completion, per row: LogNormal(median 180, sigma 0.5) tokens, rounded, clipped to
  [1, max_new_tokens] (a row at the cap is a truncated answer);
- with `--quick` both are scaled by the quick budgets over the recipe's (32/256, 64/512 for the
  GSM8K recipes), so rows keep the same shape relative to their budget.
Tokens are uniform over [2, vocab); rewards are 0/1 at random; rollout log-probs are random.

Model FLOPs per step (`model_flops`; the PaLM appendix-B convention, no rematerialisation):

    6 x P x T  +  12 x L x H x Dh x C

- P: parameters that multiply activations at every position: all parameters except the input
  embedding table when it is a lookup only (untied); a tied table is counted once, as the LM
  head. Norm scales and biases are included (negligible). The LM head is counted at every trained
  position, prompt positions too, as 6 N D does (the step scores only completion tokens).
- T: trained positions: each group's prompt once (its real tokens, as the step runs it with
  shared prompts) plus every completion at its real length.
- C: the sum of causal context lengths: a prompt of p tokens gives 1 + ... + p; completion token
  j (from 0) of that group's row gives p + j + 1. L layers, H query heads of Dh each: q k^T and
  attention x v are 2 H Dh flops per context position each, times 3 for forward + backward.
Not counted: padding positions, a prompt repeated when packing cuts a long group into several
units, remat's recomputed forward, the optimizer. MFU = model FLOPs / (median step time x the
bf16 peak of one device x the train mesh's devices); the peak comes from `PEAK_TFLOPS` by
`jax.devices()[0].device_kind` (null on CPU) or `--peak-tflops`.

Padding (`padding` in the JSON, on the timed batch and on `--padding-batches` more batches of
the same distribution):
- `unpacked_rows`: 1 - real / (rows x (max_prompt_len + max_new_tokens)), real = each row's
  prompt + completion, as a row-per-sample layout pads;
- `unpacked_shared_prompts`: the same over what the unpacked step runs with shared prompts,
  groups x max_prompt_len + rows x max_new_tokens;
- `packed`: `packing.padding_fraction` of the packing units (each group's prompt once + its
  completions, cut into several units where a group exceeds a packed row, as `packing.pack`
  cuts them) into packed rows of `train.microbatch_tokens`.

The rollout (`--rollout`, on with `--quick`; `"rollout": null` otherwise). The recipe's
sampler as the trainer builds it: `make_sampler` on the sampler's model (`rollout_model`: the
`rollout.dtype` params and compute, "auto" keeping the trainer's, and the KV cache in
`rollout.kv_cache_dtype`, or `--kv-cache-dtype`), params placed
on the train mesh (colocated) with rows split over its 'data' axis, rollout.num_prompts x
group_size rows, prompts of max_prompt_len real tokens (uniform over [2, vocab)), max_new_tokens
new tokens each, the recipe's temperature / top-k / top-p, random weights of the same shape.
`eos_id = vocab_size` (never sampled), so every row generates every token. `--rollout-warmup`
untimed calls (the first compiles), then `--rollout-calls` timed calls, each followed by a timed
`prefill` alone (the sampler's `generate.prefill`, same inputs):
- `tokens_per_s` = rows x max_new_tokens / median call time (prefill + decode);
- `ms_per_decode_step` = (median call - median prefill) / (max_new_tokens - 1): token 0 comes
  from prefill's logits, the decode loop runs max_new_tokens - 1 forwards.
`--quick` shrinks it to 2 prompts x 2 samples of 32 + 8 tokens.

Roofline bytes per decode step (`decode_roofline`, from shapes; memory traffic only, no FLOPs,
no communication):

    W x bw  +  L x 2 x K x Dh x bc x B x (Lp + N / 2)

- W: the parameters a step's matmuls read, `flop_params` (an untied input table is a lookup of B
  rows, not read whole); bw: bytes of the sampler's param dtype, as the params are stored (the
  recipes' "auto" rollout dtype keeps f32 weights, cast to bf16 compute inside the step);
- the filled KV cache, keys and values (2): L layers, K kv heads of Dh, bc bytes of the cache's
  dtype (`kv_cache_dtype` in the JSON: what the sampler's prefill returns, by
  `rollout.kv_cache_dtype`; "auto" is bfloat16 on a GPU or TPU, the compute dtype on CPU), B rows, Lp prompt slots plus the mean filled new slots: decode step s = 1 .. N-1 writes
  token s-1 and attends Lp + s slots, mean N / 2.
`roofline_tokens_per_s` = B / (bytes per step / peak bandwidth) and `fraction_of_roofline` =
(B / decode step time) / that. The peak bandwidth comes from `PEAK_GBS` by `device_kind` (HBM
spec sheets; the H200 is 4,800 GB/s there, where the issue's ~4.3 TB/s is what it achieves: pass
`--peak-gbs 4300` for that), or `--peak-gbs`, times the train mesh's devices (a memory-only
bound: on several devices the weights' all-gathers are not counted); null on CPU. The
static sampler attends over all Lp + N slots of its cache at every step (masked), so it reads
`kv_bytes_full_cache` a step, more than the filled part the roofline counts.

Hugging Face `generate` (`--hf`, off by default; needs torch and transformers, the `parity`
extra): the same rows, prompts and new tokens (`min_new_tokens = max_new_tokens`, no EOS, KV
cache on, `num_return_sequences` = group_size) on `Qwen2ForCausalLM` (q/k/v biases) or
`LlamaForCausalLM` of the same shape with random weights, bf16 on CUDA when JAX runs on a GPU,
float32 on the CPU (`sampler_throughput.HFRunner`); its calls alternate with jaxrl's, and
`ratio_jaxrl_over_hf` is the median of the per-pair ratios. `--hf` sets
XLA_PYTHON_CLIENT_PREALLOCATE=false (unless set) so that torch finds GPU memory JAX has not taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config.loader import load_recipe
from jaxrl.core.types import TrainBatch
from jaxrl.learner import packing
from jaxrl.learner.rl import rl_step_config
from jaxrl.learner.step import (
  build_train_step,
  check_batch,
  make_optimizer,
  shard_params,
  shared_group,
  to_rows,
)
from jaxrl.models.hf_checkpoint import config_from_hf
from jaxrl.core.names import KV_CACHE_DTYPES
from jaxrl.models.model_config import ModelConfig, resolve_kv_cache_dtype
from jaxrl.models.transformer import abstract_model, init_model
from jaxrl.parallel.sharding import make_mesh, mesh_of
from jaxrl.rollout.precision import rollout_model
from jaxrl.rollout.samplers import rows_over
from jaxrl.rollout.static_sampler import make_sampler, resolve_fused_sampling

# Published config.json shapes, by the recipe checkpoint directory's name (lower case).
ARCHITECTURES = {
    "qwen2.5-0.5b": {"vocab_size": 151936, "d_model": 896, "num_layers": 24, "num_heads": 14,
                     "num_kv_heads": 2, "head_dim": 64, "mlp_dim": 4864, "tie_embeddings": True,
                     "qkv_bias": True, "rope_theta": 1e6, "rms_eps": 1e-6},
    "llama-3.2-1b": {"vocab_size": 128256, "d_model": 2048, "num_layers": 16, "num_heads": 32,
                     "num_kv_heads": 8, "head_dim": 64, "mlp_dim": 8192, "tie_embeddings": True,
                     "rope_theta": 500000.0, "rope_scaling": "llama3", "rope_factor": 32.0,
                     "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                     "rope_original_max_positions": 8192, "rms_eps": 1e-5},
}

# Dense bf16 peak TFLOP/s of one device, by a substring of `device_kind` (first match wins, so
# the more specific names come first). TPU v5e reports "TPU v5 lite", v6e "TPU v6 lite".
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
               ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0),
               ("TPU v5", 459.0), ("TPU v6 lite", 918.0), ("TPU v6e", 918.0))

# GSM8K-like lengths at the recipe's budgets (see the module docstring).
PROMPT_MEAN, PROMPT_SD, PROMPT_MIN = 120.0, 25.0, 8
COMPLETION_MEDIAN, COMPLETION_SIGMA = 180.0, 0.5

QUICK = {"layers": 2, "vocab": 4096, "prompts": 4, "group": 4, "prompt_len": 32,
         "new_tokens": 64, "microbatch_tokens": 256}
# --quick's rollout: a few rows and tokens, so the smoke run stays short on a CPU.
QUICK_ROLLOUT = {"prompts": 2, "group": 2, "new_tokens": 8}

# Peak HBM bandwidth of one device in GB/s (spec sheets), by substrings of `device_kind` that
# must all occur (first match wins, so the more specific entries come first). A100 80GB reports
# e.g. "A100-SXM4-80GB"; the H100 SXM "H100 80GB HBM3".
PEAK_GBS = ((("H100", "PCIe"), 2000.0), (("H100",), 3350.0), (("H200",), 4800.0),
            (("A100", "80GB"), 2039.0), (("A100",), 1555.0), (("TPU v4",), 1200.0),
            (("TPU v5 lite",), 819.0), (("TPU v5e",), 819.0), (("TPU v5p",), 2765.0),
            (("TPU v5",), 2765.0), (("TPU v6 lite",), 1640.0), (("TPU v6e",), 1640.0))
MA_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
             "alias_size_in_bytes", "generated_code_size_in_bytes")


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def flop_params(model_cfg: ModelConfig) -> int:
  """P of `model_flops`: every parameter of the built model, less the input embedding table when
  untied (a lookup, no multiply); a tied table stays, counted once as the LM head."""
  _, state = abstract_model(model_cfg)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
  lookup = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.d_model
  return total - lookup


def model_flops(params: int, layers: int, heads: int, head_dim: int, prompt_lens,
                completion_lens, group: int) -> dict:
  """Model FLOPs of one train step (forward + backward) over groups of `group` consecutive rows
  sharing a prompt: `prompt_lens` [groups] real prompt tokens, `completion_lens` [groups x group]
  real completion tokens. 6 P T + 12 L H Dh C (module docstring): T counts each prompt once, C
  sums causal context lengths (prompt token i: i + 1; completion token j: p + j + 1)."""
  p = np.asarray(prompt_lens, np.int64)
  c = np.asarray(completion_lens, np.int64).reshape(len(p), group)
  positions = int(p.sum() + c.sum())
  context = int((p * (p + 1) // 2).sum() + (c * p[:, None] + c * (c + 1) // 2).sum())
  dense = 6 * params * positions
  attention = 12 * layers * heads * head_dim * context
  return {"params": params, "trained_positions": positions, "context_sum": context,
          "dense_flops": dense, "attention_flops": attention, "flops": dense + attention}


def sample_lengths(rng, prompts: int, group: int, prompt_len: int, new_tokens: int,
                   scale_prompt: float = 1.0, scale_completion: float = 1.0):
  """(prompt lengths [prompts], completion lengths [prompts x group]) of the GSM8K-like
  distribution, scaled (quick) and clipped to the budgets."""
  p = rng.normal(PROMPT_MEAN * scale_prompt, PROMPT_SD * scale_prompt, prompts)
  p = np.clip(np.rint(p), min(PROMPT_MIN, prompt_len), prompt_len).astype(np.int64)
  c = rng.lognormal(math.log(COMPLETION_MEDIAN * scale_completion), COMPLETION_SIGMA,
                    prompts * group)
  c = np.clip(np.rint(c), 1, new_tokens).astype(np.int64)
  return p, c


def make_batch(rng, p_lens, c_lens, group: int, prompt_len: int, new_tokens: int,
               vocab: int) -> TrainBatch:
  """Rows in groups of `group` with one left-padded prompt each (the layout shared prompts need)
  and right-padded completions of the given real lengths."""
  b = len(c_lens)
  prompt_valid = np.arange(prompt_len)[None, :] >= (prompt_len - np.repeat(p_lens, group))[:, None]
  prompts = np.repeat(rng.integers(2, vocab, (len(p_lens), prompt_len)), group, 0)
  mask = np.arange(new_tokens)[None, :] < np.asarray(c_lens)[:, None]
  tokens = rng.integers(2, vocab, (b, new_tokens))
  return TrainBatch(
      prompt_tokens=np.where(prompt_valid, prompts, 0).astype(np.int32),
      prompt_valid=prompt_valid,
      tokens=np.where(mask, tokens, 0).astype(np.int32),
      mask=mask,
      rollout_logprobs=np.where(mask, -rng.uniform(0.05, 4.0, (b, new_tokens)), 0.0)
      .astype(np.float32),
      rewards=rng.integers(0, 2, b).astype(np.float32),
      group_id=(np.arange(b) // group).astype(np.int32),
      temperature=np.ones(b, np.float32),
      completion_valid=mask)


def packing_units(row_prompts, c_lens, group: int, budget: int) -> list[int]:
  """Lengths of the packing units as `packing.pack` forms them from rows with `row_prompts` and
  `c_lens` real tokens: consecutive rows of one group after one copy of its prompt, a new unit
  (with its own prompt copy) when the next row would overflow `budget`. `group` <= 1: every row
  is its own unit."""
  g = max(group, 1)
  units, fill, prev = [], 0, -1
  for r, c in enumerate(int(x) for x in c_lens):
    p = int(row_prompts[r])
    if r // g != prev or p + fill + c > budget:
      units.append(p)
      fill, prev = 0, r // g
    units[-1] += c
    fill += c
  return units


def padding(p_lens, c_lens, group: int, prompt_len: int, new_tokens: int, budget: int,
            share: int) -> dict:
  """Padding fractions of one batch (module docstring); `group` rows per prompt, `share` the
  step's prompt-sharing group (0: none)."""
  rows = len(c_lens)
  row_prompts = np.repeat(p_lens, group)
  real_rows = int(row_prompts.sum() + np.sum(c_lens))
  real_shared = int(np.sum(p_lens) + np.sum(c_lens))
  units = packing_units(row_prompts, c_lens, share, budget)
  return {"unpacked_rows": 1 - real_rows / (rows * (prompt_len + new_tokens)),
          "unpacked_shared_prompts": 1 - real_shared / (len(p_lens) * prompt_len
                                                        + rows * new_tokens),
          "packed": packing.padding_fraction(units, budget),
          "packed_rows_used": len(packing.first_fit_fills(units, budget)),
          "packing_units": len(units)}


def train_mesh(cfg):
  """The recipe's train mesh over the visible devices (a -1 axis takes what the others leave)."""
  axes = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
  if -1 in axes:
    axes[axes.index(-1)] = jax.device_count() // math.prod(a for a in axes if a != -1)
  return make_mesh(*axes)


def recipe_model(cfg, args) -> tuple[ModelConfig, str]:
  """The architecture (`--hf-config`, else `ARCHITECTURES` by the checkpoint's name) with the
  recipe's run fields, as the trainer sets them on a loaded checkpoint."""
  m = cfg.model
  if args.hf_config:
    with open(args.hf_config) as f:
      arch = config_from_hf(json.load(f), param_dtype=m.param_dtype, config_path=args.hf_config)
    source = args.hf_config
  else:
    name = os.path.basename(os.path.normpath(m.hf_path or "")).lower().replace("-instruct", "")
    if name not in ARCHITECTURES:
      raise SystemExit(f"recipe_scale: no known shape for model.hf_path={m.hf_path!r}; pass "
                       f"--hf-config path/to/config.json (known: {', '.join(ARCHITECTURES)})")
    arch = ModelConfig(**ARCHITECTURES[name])
    source = f"ARCHITECTURES[{name!r}]"
  over = {"param_dtype": m.param_dtype, "dtype": m.dtype, "scan_layers": m.scan_layers,
          "remat": m.remat, "attention": m.attention}
  layers = args.layers or (QUICK["layers"] if args.quick else None)
  if layers:
    over["num_layers"] = layers
  if args.quick:
    over["vocab_size"] = QUICK["vocab"]
  return dataclasses.replace(arch, **over), source


def apply_overrides(cfg, args) -> dict:
  """The recipe's batch and micro-batching, with `--quick` and the flags applied (in place);
  returns the length scales of the quick distribution."""
  r, t = cfg.rollout, cfg.train
  scales = {"prompt": 1.0, "completion": 1.0}
  if args.quick:
    scales = {"prompt": QUICK["prompt_len"] / r.max_prompt_len,
              "completion": QUICK["new_tokens"] / r.max_new_tokens}
    r.num_prompts, r.group_size = QUICK["prompts"], min(QUICK["group"], r.group_size)
    r.max_prompt_len, r.max_new_tokens = QUICK["prompt_len"], QUICK["new_tokens"]
    r.max_total_tokens = 0
    t.microbatch_tokens = QUICK["microbatch_tokens"]
    if t.num_microbatches > 0:  # whole groups in every micro-batch, so prompts stay shared
      t.num_microbatches = min(t.num_microbatches, 2)
  if args.microbatch_tokens:
    t.microbatch_tokens = args.microbatch_tokens
  if args.microbatches is not None:
    t.num_microbatches = args.microbatches
  if args.packing is not None:
    t.packing = args.packing
  if t.get("packing", False):
    t.num_microbatches = 0  # packing counts micro-batches itself (the config requires 0)
  return scales


def memory_stats(compiled) -> dict | None:
  """`memory_analysis()` of the compiled step as ints (None where the backend has none)."""
  try:
    ma = compiled.memory_analysis()
  except Exception as e:  # noqa: BLE001  (some backends raise instead of returning None)
    return {"error": f"{type(e).__name__}: {e}"}
  if ma is None:
    return None
  return {f: int(getattr(ma, f)) for f in MA_FIELDS if getattr(ma, f, None) is not None}


def micro_batches(step_cfg, batch: TrainBatch, shards: int, share: int) -> dict:
  """The micro-batches the step runs on `batch`: the fixed count, or with packing the streams
  `packing.pack` allocates (capacity) and fills (used), ceil(used / shards) micro-batches."""
  b, lp = batch.prompt_tokens.shape
  n = batch.tokens.shape[1]
  if not step_cfg.pack_tokens:
    return {"count": step_cfg.num_microbatches, "rows_each": b // step_cfg.num_microbatches}
  streams = packing.capacity(b, lp, n, step_cfg.pack_tokens, shards)
  # On the host CPU where there is one (JAX_PLATFORMS may leave only the accelerator): this is
  # bookkeeping, not part of the timed step.
  try:
    host = jax.devices("cpu")[0]
  except RuntimeError:
    host = jax.devices()[0]
  with jax.default_device(host):
    packed = jax.jit(packing.pack, static_argnames=("group", "budget", "streams"))(
        batch.prompt_tokens, batch.prompt_valid, batch.tokens, batch.mask | batch.completion_valid,
        batch.temperature, group=share, budget=step_cfg.pack_tokens, streams=streams)
    used, overflow = int(packed.used), int(packed.overflow)
  return {"count": -(-used // shards), "streams_capacity": streams, "streams_used": used,
          "stream_tokens": step_cfg.pack_tokens, "overflow_units": overflow}


def time_step(cfg, model_cfg: ModelConfig, step_cfg, mesh, batch: TrainBatch, steps: int,
              warmup: int) -> dict:
  """Compiles the step once, runs `warmup` untimed calls and `steps` timed ones on `batch`."""
  t = cfg.train
  opt = make_optimizer(t.learning_rate, b1=t.b1, b2=t.b2, eps=t.adam_eps,
                       weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                       warmup_steps=t.warmup_steps, schedule=t.lr_schedule,
                       total_steps=t.steps, final_frac=t.final_lr_frac)
  t0 = time.perf_counter()
  graphdef, params = init_model(model_cfg, cfg.seed)
  step, init_state = build_train_step(graphdef, opt, step_cfg, mesh, params)
  state = init_state(params)
  del params  # the state holds the (donated) params now
  dev_batch = to_rows(batch, mesh)
  jax.block_until_ready((state, dev_batch))
  init_s = time.perf_counter() - t0
  check_batch(batch, step_cfg)
  t0 = time.perf_counter()
  compiled = step.jitted.lower(state, dev_batch).compile()
  compile_s = time.perf_counter() - t0
  log(f"init {init_s:.1f}s, compile {compile_s:.1f}s")
  times, metrics = [], None
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, dev_batch)
    jax.block_until_ready((state, metrics))
    dt = time.perf_counter() - t0
    if i >= warmup:
      times.append(dt)
    log(f"step {i}{' (warm-up)' if i < warmup else ''}: {dt * 1e3:.1f} ms")
  if int(metrics["skipped_nonfinite"]) or int(metrics["prompt_layout_errors"]):
    raise RuntimeError("the step skipped its update: its timing is not a train step's")
  return {"init_s": round(init_s, 2), "compile_s": round(compile_s, 2),
          "step_s": [round(x, 5) for x in times], "median_step_s": statistics.median(times),
          "loss": float(metrics["loss"]), "applied_steps": int(state.step),
          "memory_analysis": memory_stats(compiled)}


def peak_tflops(kind: str, override: float | None) -> tuple[float | None, str]:
  if override is not None:
    return override, "--peak-tflops"
  for name, tf in PEAK_TFLOPS:
    if name.lower() in kind.lower():
      return tf, f"PEAK_TFLOPS[{name!r}]"
  return None, "unknown device kind (pass --peak-tflops)"


def peak_gbs(kind: str, override: float | None) -> tuple[float | None, str]:
  """Peak memory bandwidth (GB/s) of one device of `kind`, and where it came from."""
  if override is not None:
    return override, "--peak-gbs"
  for names, gbs in PEAK_GBS:
    if all(n.lower() in kind.lower() for n in names):
      return gbs, f"PEAK_GBS[{' '.join(names)!r}]"
  return None, "unknown device kind (pass --peak-gbs)"


def decode_roofline(weight_params: int, weight_bytes: int, layers: int, kv_heads: int,
                    head_dim: int, cache_bytes: int, rows: int, prompt_len: int, new_tokens: int,
                    peak_gbs: float | None = None) -> dict:
  """Bytes one decode step must read (module docstring): `weight_params` parameters of
  `weight_bytes` each, once, plus the filled KV cache averaged over the decode steps
  (layers x 2 x kv_heads x head_dim x `cache_bytes` x rows x (prompt_len + new_tokens / 2)); with
  `peak_gbs` (GB/s, all devices together) the tokens/s that traffic allows, rows per step."""
  per_slot = layers * 2 * kv_heads * head_dim * cache_bytes * rows  # one slot of every row
  mean_new = new_tokens / 2 if new_tokens > 1 else 0.0  # decode step s attends Lp + s slots
  weights = weight_params * weight_bytes
  kv = per_slot * (prompt_len + mean_new)
  per_step = weights + kv
  out = {"weights_bytes": weights, "kv_bytes_mean": kv, "bytes_per_step": per_step,
         "mean_filled_new_tokens": mean_new,
         "kv_bytes_full_cache": per_slot * (prompt_len + new_tokens),
         "peak_gbs_total": peak_gbs, "roofline_tokens_per_s": None}
  if peak_gbs:
    out["roofline_tokens_per_s"] = rows / (per_step / (peak_gbs * 1e9))
  return out


def rollout_shape(cfg, quick: bool) -> dict:
  """Prompts, samples per prompt, prompt and new tokens of the rollout (`QUICK_ROLLOUT` shrinks
  the quick one)."""
  r = cfg.rollout
  if quick:
    return {"prompts": QUICK_ROLLOUT["prompts"], "group": min(QUICK_ROLLOUT["group"], r.group_size),
            "prompt_len": r.max_prompt_len,
            "new_tokens": min(QUICK_ROLLOUT["new_tokens"], r.max_new_tokens)}
  return {"prompts": r.num_prompts, "group": r.group_size, "prompt_len": r.max_prompt_len,
          "new_tokens": r.max_new_tokens}


def hf_runner(rollout_cfg: ModelConfig, shape: dict, prompts, valid, threads: int):
  """`sampler_throughput.HFRunner` on the rollout's shape (bf16 on CUDA when JAX runs on a GPU,
  f32 on the CPU), or (None, why not)."""
  here = os.path.dirname(os.path.abspath(__file__))
  if here not in sys.path:
    sys.path.insert(0, here)
  # Imported here: it sets OMP_WAIT_POLICY before torch is imported, and only --hf needs it.
  import sampler_throughput as st
  reason = st.hf_unavailable_reason()
  if reason:
    return None, reason
  device = "cuda" if jax.default_backend() == "gpu" else "cpu"
  dtype = "bfloat16" if device == "cuda" else "float32"
  model = dataclasses.replace(rollout_cfg, param_dtype=dtype, dtype=dtype)
  case = st.Case("recipe rollout", model, shape["prompts"], shape["group"], shape["prompt_len"],
                 shape["new_tokens"], "qwen2" if model.qkv_bias else "llama")
  return st.HFRunner(case, prompts, valid, threads, device), None


def time_rollout(cfg, model_cfg: ModelConfig, mesh, args) -> dict:
  """The recipe's sampler on random weights (module docstring): tokens/s, ms per decode step,
  the roofline, and HF `generate` side by side with `--hf`."""
  r = cfg.rollout
  shape = rollout_shape(cfg, args.quick)
  P, G, Lp, N = shape["prompts"], shape["group"], shape["prompt_len"], shape["new_tokens"]
  rows = P * G
  rcfg = rollout_model(cfg, model_cfg)
  if args.kv_cache_dtype:  # the flag replaces the recipe's rollout.kv_cache_dtype
    rcfg = dataclasses.replace(rcfg, kv_cache_dtype=resolve_kv_cache_dtype(
        args.kv_cache_dtype, rcfg.dtype))
  t0 = time.perf_counter()
  graphdef, params = init_model(rcfg, cfg.seed)
  params = shard_params(params, mesh)  # colocated: the trainer samples on the train mesh
  jax.block_until_ready(params)
  init_s = time.perf_counter() - t0
  # eos_id outside the vocabulary is never drawn: every row decodes all N tokens.
  gen = make_sampler(graphdef, num_samples=G, max_new_tokens=N, eos_id=rcfg.vocab_size, pad_id=0)
  sample = rows_over(mesh, gen)
  rng = np.random.default_rng(args.seed + 1)
  prompts = rng.integers(2, rcfg.vocab_size, (P, Lp)).astype(np.int32)
  valid = np.ones((P, Lp), bool)
  request_ids = np.arange(rows, dtype=np.int32)
  sampling = (float(r.temperature), int(r.get("top_k", 0)), float(r.get("top_p", 1.0)))
  calls = [0]

  def call():
    calls[0] += 1
    out = sample(params, prompts, valid, jax.random.key(calls[0]), request_ids, sampling[0],
                 top_k=sampling[1], top_p=sampling[2])
    return jax.block_until_ready(out)

  def prefill():
    jax.block_until_ready(gen.prefill(params, prompts, valid, mesh=mesh_of(params)))

  hf, hf_reason = (None, "off (pass --hf)")
  if args.hf:
    hf, hf_reason = hf_runner(rcfg, shape, prompts, valid, args.torch_threads)
  log(f"rollout: {rows} rows ({P} x {G}) of {Lp} + {N}, {rcfg.param_dtype} params, "
      f"{rcfg.dtype} compute, KV cache {rcfg.kv_cache_dtype or rcfg.dtype}; init {init_s:.1f}s; "
      f"HF: {hf_reason or 'on'}")
  first_s = None
  for i in range(args.rollout_warmup):
    t0 = time.perf_counter()
    out = call()
    first_s = first_s or time.perf_counter() - t0
    prefill()
    if hf is not None:
      hf()
    log(f"rollout warm-up {i}: {time.perf_counter() - t0:.2f}s")
  call_s, prefill_s, hf_s = [], [], []
  for i in range(args.rollout_calls):  # jaxrl and HF alternate: both see the same load
    t0 = time.perf_counter()
    out = call()
    call_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    prefill()
    prefill_s.append(time.perf_counter() - t0)
    if hf is not None:
      t0 = time.perf_counter()
      hf()
      hf_s.append(time.perf_counter() - t0)
    log(f"rollout call {i}: {call_s[-1] * 1e3:.1f} ms (prefill {prefill_s[-1] * 1e3:.1f} ms)"
        + (f", HF {hf_s[-1] * 1e3:.1f} ms" if hf_s else ""))
  if not bool(np.asarray(out.mask).all()):
    raise RuntimeError("a row stopped early: its timing is not max_new_tokens tokens")

  med, med_pre = statistics.median(call_s), statistics.median(prefill_s)
  step_s = max(med - med_pre, 0.0) / (N - 1) if N > 1 else None
  peak, peak_source = peak_gbs(jax.devices()[0].device_kind, args.peak_gbs)
  cache = jax.eval_shape(lambda: gen.prefill(params, prompts, valid))[0]
  kv_dtype = str(jax.tree.leaves(cache.k)[0].dtype)  # what the sampler's cache holds
  roof = decode_roofline(flop_params(rcfg), jnp.dtype(rcfg.param_dtype).itemsize,
                         rcfg.num_layers, rcfg.num_kv_heads, rcfg.head_dim,
                         jnp.dtype(kv_dtype).itemsize, rows, Lp, N,
                         None if peak is None else peak * mesh.size)
  rt = roof["roofline_tokens_per_s"]
  report = {
      "rows": rows, "prompts": P, "group_size": G, "prompt_len": Lp, "new_tokens": N,
      "param_dtype": rcfg.param_dtype, "dtype": rcfg.dtype, "rollout_dtype": r.dtype,
      "kv_cache_dtype": kv_dtype, "rollout_kv_cache_dtype": r.get("kv_cache_dtype", "auto"),
      "fused_sampling": resolve_fused_sampling(None),
      "kv_bytes_per_position_row": rcfg.num_layers * 2 * rcfg.num_kv_heads * rcfg.head_dim
      * jnp.dtype(kv_dtype).itemsize,
      "sampling": dict(zip(("temperature", "top_k", "top_p"), sampling)),
      "init_s": round(init_s, 2), "first_call_s": first_s and round(first_s, 3),
      "call_s": [round(x, 5) for x in call_s], "prefill_s": [round(x, 5) for x in prefill_s],
      "median_call_s": round(med, 5), "median_prefill_s": round(med_pre, 5),
      "tokens_per_s": round(rows * N / med, 1),
      "ms_per_decode_step": None if step_s is None else round(step_s * 1e3, 4),
      "roofline": {**roof, "peak_gbs_per_device": peak, "peak_source": peak_source,
                   "devices": mesh.size,
                   "formula": "W bw + L 2 K Dh bc B (Lp + N/2) (module docstring)"},
      "fraction_of_roofline": (None if rt is None or not step_s
                               else round(rows / step_s / rt, 4)),
      "call_fraction_of_roofline": None if rt is None else round(rows * N / med / rt, 4),
      "hf": None, "hf_reason": hf_reason,
  }
  if hf is not None:
    pair = [h / j for j, h in zip(call_s, hf_s)]
    report["hf"] = {"class": type(hf.model).__name__, "device": hf.device,
                    "dtype": str(next(hf.model.parameters()).dtype),
                    "attn_implementation": hf.attn_impl, "init_s": round(hf.init_s, 2),
                    "call_s": [round(x, 5) for x in hf_s],
                    "median_call_s": round(statistics.median(hf_s), 5),
                    "tokens_per_s": round(rows * N / statistics.median(hf_s), 1)}
    report["ratio_jaxrl_over_hf"] = round(statistics.median(pair), 3)
    report["ratio_per_pair"] = [round(x, 3) for x in pair]
  return report


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--recipe", default="configs/qwen2_5_0_5b_gsm8k.py", help="a run config file")
  ap.add_argument("--hf-config", default=None,
                  help="an HF config.json for the architecture (default: ARCHITECTURES by the "
                       "recipe's model.hf_path name)")
  ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
  ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --quick 3)")
  ap.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
  ap.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                  help="token-budget packing (default: the recipe's train.packing)")
  ap.add_argument("--microbatches", type=int, default=None,
                  help="train.num_microbatches (0: auto by train.microbatch_tokens)")
  ap.add_argument("--microbatch-tokens", type=int, default=None, help="train.microbatch_tokens")
  ap.add_argument("--peak-tflops", type=float, default=None,
                  help="bf16 peak TFLOP/s of one device (default: PEAK_TFLOPS by device kind)")
  ap.add_argument("--seed", type=int, default=0, help="the batch's lengths and tokens")
  ap.add_argument("--padding-batches", type=int, default=16,
                  help="more batches of the distribution for the padding estimate")
  ap.add_argument("--quick", action="store_true", help="CPU smoke test (module docstring)")
  ap.add_argument("--rollout", action=argparse.BooleanOptionalAction, default=None,
                  help="time the recipe's sampler too (default: on with --quick)")
  ap.add_argument("--rollout-calls", type=int, default=None,
                  help="timed sampler calls (default 3; --quick 2)")
  ap.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                  help="the sampler's KV cache dtype (default: the recipe's "
                       "rollout.kv_cache_dtype)")
  ap.add_argument("--rollout-warmup", type=int, default=1,
                  help="untimed sampler calls first (>= 1: the first compiles)")
  ap.add_argument("--peak-gbs", type=float, default=None,
                  help="peak memory GB/s of one device (default: PEAK_GBS by device kind)")
  ap.add_argument("--hf", action="store_true",
                  help="Hugging Face generate side by side (needs torch + transformers)")
  ap.add_argument("--torch-threads", type=int, default=2, help="torch CPU threads for --hf")
  args = ap.parse_args(argv)
  if args.rollout is None:
    args.rollout = args.quick
  if args.rollout_calls is None:
    args.rollout_calls = 2 if args.quick else 3
  if args.rollout_calls < 1 or args.rollout_warmup < 1:
    ap.error("--rollout-calls >= 1 and --rollout-warmup >= 1")
  if args.hf:
    # Before JAX starts its backend: without preallocation JAX takes GPU memory as it needs it,
    # leaving the rest to torch (JAX's default takes 75% up front).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.steps is None:
    args.steps = 3 if args.quick else 5
  if args.steps < 1 or args.warmup < 0:
    ap.error("--steps >= 1 and --warmup >= 0")
  return args


def padding_report(rng, p_lens, c_lens, cfg, share: int, scales: dict, extra: int) -> dict:
  r = cfg.rollout
  pad = lambda p, c: padding(p, c, r.group_size, r.max_prompt_len, r.max_new_tokens,
                             cfg.train.microbatch_tokens, share)
  timed = pad(p_lens, c_lens)
  more = [pad(*sample_lengths(rng, r.num_prompts, r.group_size, r.max_prompt_len,
                              r.max_new_tokens, scales["prompt"], scales["completion"]))
          for _ in range(extra)]
  keys = ("unpacked_rows", "unpacked_shared_prompts", "packed")
  mean = {k: round(statistics.fmean(m[k] for m in more), 4) for k in keys} if more else None
  lengths = {"prompt_mean": round(float(np.mean(p_lens)), 1),
             "completion_mean": round(float(np.mean(c_lens)), 1),
             "completion_median": float(np.median(c_lens)),
             "completions_at_cap": int(np.sum(c_lens == r.max_new_tokens))}
  return {"timed_batch": {k: round(v, 4) if isinstance(v, float) else v for k, v in timed.items()},
          f"mean_of_{extra}_batches": mean, "timed_batch_lengths": lengths,
          "distribution": {"prompt": f"Normal({PROMPT_MEAN * scales['prompt']:g}, "
                                     f"{PROMPT_SD * scales['prompt']:g}) clipped to "
                                     f"[{min(PROMPT_MIN, r.max_prompt_len)}, {r.max_prompt_len}]",
                           "completion": f"LogNormal(median "
                                         f"{COMPLETION_MEDIAN * scales['completion']:g}, sigma "
                                         f"{COMPLETION_SIGMA}) clipped to [1, "
                                         f"{r.max_new_tokens}]",
                           "seed": None},
          "microbatch_tokens": cfg.train.microbatch_tokens}


def main(argv=None):
  args = parse_args(argv)
  t_start = time.perf_counter()
  cfg = load_recipe(args.recipe)
  scales = apply_overrides(cfg, args)
  model_cfg, source = recipe_model(cfg, args)
  mesh = train_mesh(cfg)
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  step_cfg = rl_step_config(cfg, shards)
  r = cfg.rollout
  rng = np.random.default_rng(args.seed)
  p_lens, c_lens = sample_lengths(rng, r.num_prompts, r.group_size, r.max_prompt_len,
                                  r.max_new_tokens, scales["prompt"], scales["completion"])
  batch = make_batch(rng, p_lens, c_lens, r.group_size, r.max_prompt_len, r.max_new_tokens,
                     model_cfg.vocab_size)
  log(f"{args.recipe}: {model_cfg.num_layers} layers, d {model_cfg.d_model}, vocab "
      f"{model_cfg.vocab_size}; {len(c_lens)} rows of {r.max_prompt_len} + {r.max_new_tokens}; "
      f"packing {bool(step_cfg.pack_tokens)}; mesh {dict(mesh.shape)}")

  flops = model_flops(flop_params(model_cfg), model_cfg.num_layers, model_cfg.num_heads,
                      model_cfg.head_dim, p_lens, c_lens, r.group_size)
  # The prompt-sharing group the step uses on these rows (0 when micro-batches would cut groups).
  share = shared_group(step_cfg, len(c_lens))
  mb = micro_batches(step_cfg, batch, shards, share)
  timing = time_step(cfg, model_cfg, step_cfg, mesh, batch, args.steps, args.warmup)
  kind = jax.devices()[0].device_kind
  peak, peak_source = peak_tflops(kind, args.peak_tflops)
  med = timing["median_step_s"]
  achieved = flops["flops"] / med
  pad = padding_report(rng, p_lens, c_lens, cfg, share, scales,
                       args.padding_batches)
  pad["distribution"]["seed"] = args.seed

  report = {
      "benchmark": "recipe_scale",
      "command": shlex.join(["python", *sys.argv]),
      "quick": args.quick,
      "recipe": args.recipe,
      "device": {"kind": kind, "backend": jax.default_backend(), "count": jax.device_count(),
                 "peak_bf16_tflops": peak, "peak_source": peak_source},
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "model": {"source": source, **{k: getattr(model_cfg, k) for k in (
          "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "mlp_dim", "tie_embeddings", "qkv_bias", "rope_theta", "rope_scaling", "param_dtype",
          "dtype", "scan_layers", "remat", "attention")}},
      "batch": {"prompts": r.num_prompts, "group_size": r.group_size,
                "rows": len(c_lens), "max_prompt_len": r.max_prompt_len,
                "max_new_tokens": r.max_new_tokens},
      "step": {"mesh": dict(mesh.shape), "row_shards": shards,
               "packing": bool(step_cfg.pack_tokens), "shared_prompts": share,
               "num_microbatches": step_cfg.num_microbatches,
               "microbatch_tokens": cfg.train.microbatch_tokens, "micro_batches": mb,
               "logprob_impl": step_cfg.logprob_impl or "auto",
               "objective": {"policy": step_cfg.objective.policy,
                             "correction": list(step_cfg.objective.correction)}},
      "timing": {k: (round(v, 5) if k == "median_step_s" else v) for k, v in timing.items()
                 if k != "memory_analysis"},
      "compiled_memory": timing["memory_analysis"],
      "flops": {**flops, "formula": "6 P T + 12 L H Dh C (module docstring)"},
      "achieved_tflops": round(achieved / 1e12, 4),
      "mfu": None if peak is None else round(achieved / (peak * 1e12 * mesh.size), 5),
      "trained_positions_per_s": round(flops["trained_positions"] / med, 1),
      "padding": pad,
      "rollout": time_rollout(cfg, model_cfg, mesh, args) if args.rollout else None,
      "total_wall_s": round(time.perf_counter() - t_start, 1),
  }
  print(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  main()
