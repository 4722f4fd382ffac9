"""Memory plan: the per-device bytes a run needs, from its config alone, before anything compiles.

Both programs that can be live at once are counted (`plan_memory`):

- the train step: params (master dtype), Adam's mu and nu, the gradients (twice with
  micro-batches: the accumulator and one micro-batch's), a reference copy for `ref_kl`, the lag
  ring's train batches, and the step's activation temporaries (`activation_bytes`);
- the sampler: its published params copy (rollout dtype), the KV cache (rows or engine slots x
  (prompt + completion budget) x layers x 2 x kv heads x head dim x cache dtype) and its prefill
  temporaries.

Mixture-of-experts models (`model.num_experts` > 0, `expert_bytes`): every layer's router and E
experts replace the dense MLP in the params, their optimizer state and gradients, with the
experts' axis split over 'fsdp' and their width over 'tensor' where those divide them; the
activations count each token's k experts' width (k x `moe_intermediate_size`) as the MLP's;
and the dispatch's own buffers per layer kept (`dispatch`: the sorted token copies in and out of
the grouped matmuls and the weighted outputs, N k x d_model each in the compute dtype, the
router's f32 logits and probabilities, N x E each, and three int32 indices per assignment).

On a TPU or GPU (`backend`), XLA:TPU's buffer assignment of the Qwen2.5-0.5B GSM8K recipe's
programs on v5p-8 (`python -m jaxrl.plan`, its dumped memory-usage report and live ranges) showed
three things the CPU compiler does not, which the plan counts there:
- the micro-batch loop keeps its gradient carry twice (the loop's input and output buffers) next
  to the micro-batch's own gradients: three params-sized gradient trees, not two;
- the embedding lookup's gradient is a scatter-add into a dense `[vocab, d_model]` buffer per
  device (in and out: two of them, in the params' dtype, split like the embedding);
- the sampler's token pick held about eleven `[rows, vocab]` f32 buffers at its peak (the
  top-k / top-p filter's sort over the whole batch: values, indices, the sorted copy,
  cumulative sums and masks), not two; sorted 64 rows at a time (`filter_logits`) it holds about
  five, and XLA:GPU's compile about four (`SAMPLER_VOCAB_BUFFERS`).
With the experts of a mixture-of-experts model split over devices, XLA:TPU gathers every shard's
token-expert assignments to each device in the train step, and copies the experts' gate and up
weights into another layout in the decode (the 30B-A3B plan recipe on v5p-64 and v5p-128).

`rollout.lag` >= 1 runs them at once (their sum); lag 0 alternates them (the larger phase).
Disaggregated (`mesh.rollout`), the sampler's part is on other devices: the larger of the two.

The activation temporaries are counted in buffers of `positions x width` per micro-batch and
device (`ACTIVATION_BUFFERS`), calibrated against the compiled train step's
`memory_analysis().temp_size_in_bytes` on CPU in float32 with scanned layers
(tests/test_memory_budget.py checks agreement within 20%): with `model.remat` "full" each layer
keeps its input and one layer is recomputed at a time; "dots" keeps the weight matmuls' outputs
too; "none" keeps everything, including each layer's [positions, heads, keys] f32 attention
scores when attention is dense. Unrolled layers (`model.scan_layers = false`) are planned as
"none" whatever the policy: XLA schedules their recomputation freely (measured on CPU: 8-23% under
that). `positions` is one number (`microbatch_positions`), so packing rows into a token budget
plugs in there.

No jax is imported: `jaxrl.config.validate` calls `check_device` before anything is built, and
the run prints `MemoryPlan.render()` at its start. `JAXRL_DEVICE_MEMORY_BYTES` (a testing and
override knob) sets the per-device limit where the backend does not say (CPU) or overrides it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxrl.config.mesh import MeshShape
# The plan's inputs, read from a config (`sizing`); named here too, where callers find them.
from jaxrl.config.sizing import (  # noqa: F401
    DTYPE_BYTES, KV_CACHE_BYTES, NEEDED, PlanInputs, expert_param_count, inputs_from_config,
    microbatch_positions, param_count)
from jaxrl.config.schema import PREFIX

LIMIT_ENV = "JAXRL_DEVICE_MEMORY_BYTES"
WARN_FRACTION = 0.9  # a plan above this share of the device's memory is a warning line
GIB = 1 << 30

# Buffers of `positions x width` of the train step's temporaries, by remat policy: per layer kept
# for the backward pass, and for the one layer being differentiated (recomputed). Widths: d
# (d_model), qkv ((heads + 2 kv heads) x head dim), mlp (mlp_dim), each in the compute dtype, and
# scores (the attention's query-key pairs x heads, always f32). Fitted by least squares to 17
# shapes per policy (compiled train steps on CPU, f32; every one within 10%), then rounded.
ACTIVATION_BUFFERS = {
    #         kept per layer: d, qkv, mlp, scores   one layer: d, qkv, mlp, scores
    "full": ((1.0, 0.0, 0.0, 0.0), (7.0, 0.0, 6.0, 2.5)),
    "dots": ((4.0, 2.0, 1.0, 0.0), (0.0, 0.0, 7.5, 1.5)),
    "none": ((11.5, 0.0, 6.5, 1.0), (0.0, 0.0, 0.0, 4.0)),
}
LOGPROB_CHUNK = 1024  # the fused log-prob's vocabulary chunk (`kernels.fused_logprob.xla`)
# XLA:TPU's mixture-of-experts step with the experts split over devices (`ragged_dot`): buffers
# of every shard's token-expert assignments x d_model (the tokens gathered to each device), at
# its peak. Qwen3-30B-A3B plan recipe compiled for v5p-64 and v5p-128: 10 of 2 GiB each.
TPU_GATHERED_DISPATCH_BUFFERS = 10
# `[rows, vocab]` f32 buffers of the sampler's token pick at its peak (module docstring), from
# the 0.5B recipe's decode (512 rows of 151,936, 0.29 GiB a buffer): CPU as calibrated there;
# XLA:TPU on v5e-4 1.48 GiB; XLA:GPU for an H200 1.20 GiB (a deviceless compile sorts with XLA's
# fallback, not CUB's, which a GPU present would pick).
SAMPLER_VOCAB_BUFFERS = {"cpu": 2, "tpu": 5, "gpu": 4}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes of each part (`parts`), of each program (`train`, `rollout`) and the peak
  of both as the run overlaps them (`total`)."""

  parts: dict[str, int]
  train: int
  rollout: int
  total: int
  inputs: PlanInputs

  def largest(self, n: int = 2) -> list[tuple[str, int]]:
    return sorted(self.parts.items(), key=lambda kv: -kv[1])[:n]

  def render(self) -> str:
    """One paragraph: the parts of each program, how they overlap and the total."""
    i, p = self.inputs, self.parts
    unit, scale = ("GiB", GIB) if self.total >= GIB else ("MiB", 1 << 20)
    g = lambda n: f"{n / scale:,.2f}"
    train = ", ".join(f"{k} {g(p[k])}" for k in TRAIN_PARTS if p.get(k))
    rollout = ", ".join(f"{k} {g(p[k])}" for k in ROLLOUT_PARTS if p.get(k))
    how = ("on other devices (disaggregated): the larger" if not i.colocated else
           f"rollout.lag {i.lag}: both at once" if i.lag else "rollout.lag 0: one at a time")
    if i.experts:
      e = expert_bytes(i)
      train += (f"; of which experts ({i.experts} per layer, {i.experts_per_tok} per token, "
                f"over {i.expert_shards} device(s)): params {g(e['params'])}, optimizer "
                f"{g(e['optimizer'])}, gradients {g(e['gradients'])}")
    return (f"memory plan per device ({unit}): train step {g(self.train)} ({train}; remat "
            f"{i.remat}, {i.attention} attention, {i.microbatches} micro-batch(es) of "
            f"{i.positions:,} positions) | sampler {g(self.rollout)} ({rollout}; KV cache "
            f"{i.kv_rows:,} rows x {i.cache_slots:,} slots) | {how}: {g(self.total)}")


TRAIN_PARTS = ("params", "optimizer", "gradients", "ref_params", "batches", "activations",
               "dispatch")
ROLLOUT_PARTS = ("rollout_params", "kv_cache", "sampler_temps")


def expert_bytes(i: PlanInputs) -> dict[str, int]:
  """Per device, the experts' share of the train step: their params (master dtype, split over
  `expert_shards`), Adam's two moments and the gradients (twice with micro-batches) of them, and
  the dispatch buffers of one micro-batch (module docstring): per layer kept for the backward
  pass (every layer, one with `remat` "full"), positions x (3 k d_model x compute bytes + 2 E x
  4 + 3 k x 4). All 0 for a dense model or LoRA (the experts stay frozen)."""
  if not i.experts:
    return dict.fromkeys(("params", "optimizer", "gradients", "dispatch"), 0)
  params = i.expert_params * i.param_bytes // i.expert_shards
  trained = 0 if i.trained_params != i.params else params
  k = i.experts_per_tok
  per_layer = i.positions * (3 * k * i.d_model * i.compute_bytes + 2 * i.experts * 4 + 3 * k * 4)
  kept = 1 if i.remat == "full" else i.layers
  dispatch = kept * per_layer
  if i.backend == "tpu" and i.expert_shards > 1:  # every shard's assignments on each device
    gathered = k * i.completion_tokens * i.batch_shards * i.d_model * i.compute_bytes
    dispatch = max(dispatch, TPU_GATHERED_DISPATCH_BUFFERS * gathered)
  return {"params": params, "optimizer": 2 * trained,
          "gradients": trained * (2 if i.microbatches > 1 else 1), "dispatch": dispatch}


def activation_bytes(i: PlanInputs) -> int:
  """The train step's temporaries besides the gradients: each layer's kept activations and one
  layer's recomputation (`ACTIVATION_BUFFERS`), or the fused log-prob's vocabulary chunks when
  they are larger (they are not live at the same time on CPU: measured)."""
  kept, layer = ACTIVATION_BUFFERS[i.remat]
  mlp = i.experts_per_tok * i.expert_width if i.experts else i.mlp_dim  # a token's active width
  widths = (i.d_model, (i.heads + 2 * i.kv_heads) * i.head_dim, mlp)
  scores = i.attention_pairs * i.heads * 4

  def buffers(counts, n: int) -> float:
    dense = sum(c * w for c, w in zip(counts[:3], widths)) * i.positions * i.compute_bytes
    return n * (dense + counts[3] * scores)

  logprob = 3 * i.completion_tokens * min(LOGPROB_CHUNK, i.vocab) * 4
  return int(buffers(kept, i.layers) + max(buffers(layer, 1), logprob))


def plan_memory(i: PlanInputs) -> MemoryPlan:
  """The per-device plan of `i` (module docstring)."""
  experts = expert_bytes(i)
  params = (i.params - i.expert_params) * i.param_bytes // i.param_shards + experts["params"]
  lora = i.trained_params != i.params
  trained = i.trained_params * 4 if lora else params  # LoRA adapters: f32, replicated
  if lora:
    params += trained
  copies = 2 if i.lag and i.colocated else 1  # the version sampled and the one just published
  kv = i.kv_rows * i.cache_slots * (
      i.layers * 2 * i.kv_heads * i.head_dim * i.cache_bytes // i.kv_head_shards + 1)
  accelerator = i.backend in ("gpu", "tpu")
  # Gradient trees: the micro-batch loop's carry (twice on an accelerator) and a micro-batch's own.
  trees = 1 if i.microbatches == 1 else (3 if accelerator else 2)
  # The embedding lookup's dense gradient buffers on an accelerator (module docstring).
  embed = 2 * i.vocab * i.d_model * i.param_bytes // i.param_shards if accelerator and not lora \
      else 0
  vocab_buffers = SAMPLER_VOCAB_BUFFERS.get(i.backend, SAMPLER_VOCAB_BUFFERS["cpu"])
  parts = {
      "params": params,
      "optimizer": 2 * trained,
      "gradients": trained * trees + embed,
      "ref_params": trained if i.ref_params else 0,
      "batches": i.batch_bytes * (i.lag + 1),
      # The optimizer's update (one params-sized tree) runs after the backward pass.
      "activations": max(activation_bytes(i), trained),
      "dispatch": experts["dispatch"],
      "rollout_params": copies * i.params * i.rollout_param_bytes // i.rollout_param_shards,
      "kv_cache": kv,
      # Prefill's and decode's temporaries: about one layer's keys and values in flight (x 1.25)
      # and the token pick's [rows, vocab] f32 buffers (`SAMPLER_VOCAB_BUFFERS`; on CPU, compiled
      # for 4 shapes: within 25%, and the sampler's whole peak within 15%).
      "sampler_temps": kv * 5 // (4 * i.layers) + vocab_buffers * i.kv_rows * i.vocab * 4
      # XLA:TPU's decode copies the experts' gate and up weights into the layout its grouped
      # products read (the 30B-A3B plan recipe's decode on v5p-64: 9 GiB of temporaries).
      + (2 * i.layers * i.experts * i.d_model * i.expert_width * i.rollout_param_bytes
         // i.rollout_param_shards if i.backend == "tpu" and i.experts else 0),
  }
  train = sum(parts[k] for k in TRAIN_PARTS)
  rollout = sum(parts[k] for k in ROLLOUT_PARTS)
  state = parts["params"] + parts["optimizer"] + parts["ref_params"] + parts["batches"]
  one_copy = i.params * i.rollout_param_bytes // i.rollout_param_shards
  if not i.colocated:
    total = max(train, rollout)
  elif i.lag:
    total = train + rollout
  else:
    total = max(train + one_copy, state + rollout)
  return MemoryPlan(parts, train, rollout, total, i)


def advice(plan: MemoryPlan, good: Mapping[str, Any] | None = None) -> list[str]:
  """The config keys that lower the plan's largest parts, largest part first."""
  good = good or {}
  i = plan.inputs
  auto = good.get("train.num_microbatches") == 0
  keys_of = {
      "activations": ["train.microbatch_tokens" if auto else "train.num_microbatches"]
      + (["model.remat"] if i.remat != "full" else [])
      + (["model.attention"] if i.attention == "dense" else []),
      "kv_cache": (["rollout.engine_slots"] if good.get("rollout.engine") == "continuous" else
                   ["rollout.num_prompts", "rollout.group_size"])
      + ["rollout.max_new_tokens", "mesh.data"],
      "sampler_temps": ["rollout.num_prompts", "rollout.max_prompt_len"],
      "rollout_params": ["rollout.dtype", "mesh.tensor"],
      "params": ["mesh.fsdp", "model.param_dtype"],
      "optimizer": ["mesh.fsdp", "model.lora.rank"],
      "gradients": ["mesh.fsdp", "model.lora.rank"],
      "ref_params": ["ref_kl.coef"],
      "dispatch": ["train.microbatch_tokens" if auto else "train.num_microbatches",
                   "model.remat", "mesh.data"],
      "batches": ["rollout.num_prompts", "rollout.lag"],
  }
  out: list[str] = []
  for part, _ in plan.largest(2):
    out += [k for k in keys_of[part][:3] if k not in out]
  if i.lag and i.colocated and "rollout.lag" not in out:
    out.append("rollout.lag")  # 0 alternates the two programs instead of summing them
  return out


def _gib(n: float) -> str:
  return f"{n / GIB:,.2f} GiB"


def summary(plan: MemoryPlan) -> str:
  """"<total> per device (train step <x>, sampler <y>; largest: <part> <n>, ...)"."""
  big = ", ".join(f"{k} {_gib(v)}" for k, v in plan.largest())
  return (f"{_gib(plan.total)} per device (train step {_gib(plan.train)}, sampler "
          f"{_gib(plan.rollout)}; largest: {big})")


def check_device(good: Mapping[str, Any], mesh: MeshShape | None, limit: int | None,
                 problems: list[str], notes: list[str], backend: str = "cpu",
                 num_processes: int = 1) -> MemoryPlan | None:
  """Compares the plan of `good` with `limit`, one device's bytes (None: unknown, no check).

  Over the limit: one problem line, led by the key that lowers the largest part, naming the
  plan's largest parts and the keys that lower them. Over `WARN_FRACTION` of it: one line in
  `notes` (a warning; the run goes on). Returns the plan (None when it cannot be made). A config
  already refused is not planned: its sizes may be absurd (a batch no memory holds).
  """
  if mesh is None or problems:
    return None
  i = inputs_from_config(good, mesh, backend, num_processes)
  if i is None:
    return None
  plan = plan_memory(i)
  if not limit:
    return plan
  keys = advice(plan, good)
  lower = ", ".join(PREFIX + k for k in keys)
  if plan.total > limit:
    problems.append(f"{PREFIX}{keys[0]}: the memory plan needs {summary(plan)}, over the "
                    f"device's {_gib(limit)}; lower it with {lower}")
  elif plan.total > WARN_FRACTION * limit:
    notes.append(f"jaxrl: warning: the memory plan needs {summary(plan)}, "
                 f"{plan.total / limit:.0%} of the device's {_gib(limit)}; {lower} lower it")
  return plan


def device_limit(reported: int | None, environ: Mapping[str, str] = os.environ) -> int | None:
  """One device's memory limit: `JAXRL_DEVICE_MEMORY_BYTES` when set (a testing and override
  knob), else `reported` (the backend's `bytes_limit`; None on CPU, where host memory is checked
  instead)."""
  text = environ.get(LIMIT_ENV, "").strip()
  if text:
    try:
      return int(float(text))
    except ValueError:
      return reported
  return reported
