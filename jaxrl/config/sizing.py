"""The memory plan's inputs (`PlanInputs`) from a run config alone, before anything is built:
the model's shape (the config's `model` keys, or a Hugging Face directory's config.json), its
parameter counts, the batch as each device's micro-batches see it, the dtypes, and where the
sampler's rows, cache and params copy go on the mesh. `jaxrl.config.memory` turns them into
bytes. No jax is imported.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxrl.config.mesh import MeshShape
from jaxrl.config.microbatch import resolve_microbatches
from jaxrl.core.names import lag_bound
from jaxrl.data import hf_files

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_CACHE_BYTES = {**DTYPE_BYTES, "float8_e4m3fn": 1, "float8_e5m2": 1}
XLA_BLOCK_K = 256  # the blockwise attention's key block (`jaxrl.kernels.attention.xla`)
AUTO_DENSE_MAX_LENGTH = 1024  # `model.attention = "auto"` on CPU: dense up to this row length
@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """What the plan reads from a run config, per device where it says so."""

  vocab: int
  d_model: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp_dim: int
  params: int  # the model's parameters
  trained_params: int  # what the optimizer trains (LoRA: the adapters alone)
  param_bytes: int  # master dtype (LoRA: the frozen base's)
  compute_bytes: int
  rollout_param_bytes: int
  cache_bytes: int
  remat: str  # as planned: "none" for unrolled layers
  attention: str  # "dense" or "xla", resolved for the row length
  microbatches: int
  positions: int  # per device and micro-batch (`microbatch_positions`)
  attention_pairs: int  # query-key pairs per device and micro-batch (per head)
  completion_tokens: int  # per device and micro-batch (the fused log-prob's rows)
  batch_bytes: int  # one train batch per device
  kv_rows: int  # per device
  kv_head_shards: int  # the cache's kv heads split over 'tensor'
  cache_slots: int
  prompt_len: int
  lag: int
  colocated: bool
  param_shards: int
  rollout_param_shards: int
  ref_params: bool
  # Mixture of experts (0: dense): experts per layer, per token, each one's width, the experts'
  # parameters (in `params`; router included) and the devices one expert weight is split over.
  experts: int = 0
  experts_per_tok: int = 0
  expert_width: int = 0
  expert_params: int = 0
  expert_shards: int = 1
  batch_shards: int = 1  # devices a batch's rows are split over ('data' x 'fsdp')
  backend: str = "cpu"  # the platform the plan is for: "cpu", "gpu" or "tpu" (module docstring)


def param_count(vocab: int, d: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                mlp: int, tie_embeddings: bool = False, qkv_bias: bool = False,
                qk_norm: bool = False) -> int:
  """Parameters of the decoder (`jaxrl.models.transformer`): embeddings (and an untied head),
  per layer q/k/v/o and SwiGLU projections and two norms, a final norm."""
  qkv = (heads + 2 * kv_heads) * head_dim
  per_layer = d * qkv + heads * head_dim * d + 3 * d * mlp + 2 * d
  per_layer += qkv * qkv_bias + 2 * head_dim * qk_norm
  return vocab * d * (1 if tie_embeddings else 2) + d + layers * per_layer


def expert_param_count(d: int, layers: int, experts: int, width: int) -> int:
  """Parameters of the mixture-of-experts MLPs: per layer a router [d, E] and E SwiGLU experts
  (gate and up [d, F], down [F, d])."""
  return layers * (d * experts + 3 * experts * d * width)


def microbatch_positions(rows: int, shards: int, microbatches: int, prompt_len: int,
                         completion_len: int, group: int = 0) -> tuple[int, int]:
  """(positions, longest row) of one device's micro-batch: rows x (prompt + completion), or with
  shared prompts (`group` > 1) groups x (prompt + group x completion) as one packed row each."""
  per = max(rows // max(shards, 1) // max(microbatches, 1), 1)
  if group > 1:
    row = prompt_len + group * completion_len
    return max(per // group, 1) * row, row
  return per * (prompt_len + completion_len), prompt_len + completion_len


def _model_dims(good: Mapping[str, Any]) -> dict[str, Any] | None:
  """The model's shape: the config's, or a Hugging Face directory's config.json."""
  keys = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "mlp_dim", "tie_embeddings", "qkv_bias", "qk_norm")
  moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
  if good.get("model.hf_path"):
    try:
      hf = hf_files.read_json(os.path.join(good["model.hf_path"], hf_files.MODEL_CONFIG_FILE))
      heads = int(hf["num_attention_heads"])
      return dict(vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
                  num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
                  num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                  head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                  mlp_dim=int(hf["intermediate_size"]),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  qkv_bias="qwen2" in str(hf.get("model_type", "")).lower(), qk_norm=False,
                  **{k: int(hf.get(k) or 0) for k in moe_keys})
    except (hf_files.HFTokenizerError, OSError, ValueError, KeyError, TypeError,
            ZeroDivisionError):
      return None
  if not all(f"model.{k}" in good for k in keys):
    return None
  dims = {k: good[f"model.{k}"] for k in keys + moe_keys if f"model.{k}" in good}
  dims["vocab_size"] = dims["vocab_size"] or 256  # the task's character tokenizer: small
  return dims


NEEDED = ("model.param_dtype", "model.dtype", "model.remat", "model.scan_layers",
          "model.attention", "rollout.num_prompts", "rollout.group_size", "rollout.max_prompt_len",
          "rollout.max_new_tokens", "rollout.max_total_tokens", "rollout.lag", "rollout.dtype",
          "rollout.engine", "rollout.engine_slots", "train.num_microbatches",
          "train.microbatch_tokens", "train.share_prompts", "ref_kl.coef", "model.lora.rank",
          "model.lora.targets")


def inputs_from_config(good: Mapping[str, Any], mesh: MeshShape, backend: str = "cpu",
                       num_processes: int = 1, vocab: int | None = None) -> PlanInputs | None:
  """The plan's inputs from a flat (dotted keys) run config on `mesh`; None when a key it needs
  is missing or bad (validation names those) or the model's shape is unknown. `vocab`: the
  tokenizer's size where `model.vocab_size` is 0 (known once the task is built).

  `train.packing` (where the config has it): each device's micro-batch is one packed row of
  `train.microbatch_tokens` positions."""
  dims = _model_dims(good)
  if dims is None or not all(k in good for k in NEEDED):
    return None
  if vocab and not good.get("model.vocab_size") and not good.get("model.hf_path"):
    dims["vocab_size"] = vocab
  v, d, layers, heads, kv, hd, mlp = (dims[k] for k in (
      "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"))
  n = param_count(v, d, layers, heads, kv, hd, mlp, dims["tie_embeddings"], dims["qkv_bias"],
                  dims["qk_norm"])
  e, k, f = (dims.get(x, 0) for x in ("num_experts", "num_experts_per_tok",
                                      "moe_intermediate_size"))
  n_experts = expert_param_count(d, layers, e, f) if e else 0
  if e:  # the experts and router instead of the dense MLP
    n += n_experts - layers * 3 * d * mlp
  trained = n
  if good["model.lora.rank"]:
    widths = {"q": (d, heads * hd), "k": (d, kv * hd), "v": (d, kv * hd), "o": (heads * hd, d),
              "gate": (d, mlp), "up": (d, mlp), "down": (mlp, d)}
    targets = [t.strip() for t in good["model.lora.targets"].split(",") if t.strip()]
    trained = layers * good["model.lora.rank"] * sum(sum(widths.get(t, (0, 0))) for t in targets)
  rows, group = good["rollout.num_prompts"] * good["rollout.group_size"], good["rollout.group_size"]
  lp = good["rollout.max_prompt_len"]
  new = good["rollout.max_total_tokens"] or good["rollout.max_new_tokens"]
  shards = mesh.data * mesh.fsdp
  share = group if good["train.share_prompts"] and group > 1 else 0
  m = resolve_microbatches(good["train.num_microbatches"], rows, lp + new, shards,
                           good["train.microbatch_tokens"], group=share, prompt_len=lp)
  share = share if share and rows % (share * m) == 0 else 0
  positions, row = microbatch_positions(rows, shards, m, lp, new, share)
  per = max(rows // shards // m, 1)
  if good.get("train.packing"):  # token-budget packing: one packed row per shard and micro-batch
    tokens = good["train.microbatch_tokens"]
    positions = row = tokens
    m = -(-rows * (lp + new) // shards // max(tokens, 1))
    per, share = max(tokens // (lp + new), 1), 0
  attention = good["model.attention"]
  if attention == "auto":
    attention = "dense" if backend == "cpu" and row <= AUTO_DENSE_MAX_LENGTH else "xla"
  if attention != "dense":
    pairs = positions * min(XLA_BLOCK_K, row)
  elif share:  # each prompt over itself, each completion over its prompt and itself
    pairs = per // share * lp * lp + per * new * (lp + new)
  elif good.get("train.packing"):  # a dense mask over the whole packed row
    pairs = row * row
  else:
    pairs = per * (lp + new) ** 2
  rollout = good["rollout.dtype"]
  param_b, compute_b = DTYPE_BYTES[good["model.param_dtype"]], DTYPE_BYTES[good["model.dtype"]]
  rollout_b = param_b if rollout == "auto" else DTYPE_BYTES[rollout]
  # The sampler's KV cache at `rollout.kv_cache_dtype` ("auto": bfloat16 on a GPU or TPU, the
  # sampler's compute dtype on CPU; `jaxrl.models.model_config.resolve_kv_cache_dtype`).
  kv_dtype = good.get("rollout.kv_cache_dtype", "auto")
  if kv_dtype == "auto":
    kv_dtype = "bfloat16" if backend in ("gpu", "tpu") else None
  cache_b = KV_CACHE_BYTES[kv_dtype] if kv_dtype else (
      compute_b if rollout == "auto" else DTYPE_BYTES[rollout])
  colocated = not mesh.disaggregated
  r_data, _, r_tensor = (mesh.data, mesh.fsdp, mesh.tensor) if colocated else mesh.rollout_shape
  # On several processes a colocated run generates each process's share on its own devices
  # (`parallel.distributed.local_mesh`): rows over them, params whole on each or split over
  # `mesh.rollout_tensor` of them.
  per_process = colocated and num_processes > 1
  if per_process:
    r_tensor = max(mesh.rollout_tensor, 1)
    r_data = max(mesh.size // num_processes // r_tensor, 1)
  share_rows = -(-rows // max(num_processes, 1))
  slots = good["rollout.engine_slots"] if good["rollout.engine"] == "continuous" else 0
  kv_rows = -(-(slots or share_rows) // r_data)
  kv_split = r_tensor if kv % r_tensor == 0 else 1
  return PlanInputs(
      vocab=v, d_model=d, layers=layers, heads=heads, kv_heads=kv, head_dim=hd, mlp_dim=mlp,
      params=n, trained_params=trained, param_bytes=param_b, compute_bytes=compute_b,
      rollout_param_bytes=rollout_b, cache_bytes=cache_b,
      remat=good["model.remat"] if good["model.scan_layers"] else "none", attention=attention,
      microbatches=m, positions=positions, attention_pairs=pairs,
      completion_tokens=per * new, batch_bytes=-(-rows * (5 * lp + 10 * new + 12) // shards),
      # The cache's rows go over 'data', its kv heads over 'tensor' where they divide
      # (`parallel.sharding.kv_cache_shardings`).
      kv_rows=kv_rows, kv_head_shards=kv_split, cache_slots=lp + new,
      prompt_len=lp, lag=lag_bound({"lag": good["rollout.lag"],
                                        "max_lag": good.get("rollout.max_lag", 0)}),
      colocated=colocated,
      param_shards=mesh.fsdp * mesh.tensor,
      rollout_param_shards=mesh.fsdp * mesh.tensor if colocated and not per_process
      else r_tensor,
      ref_params=good["ref_kl.coef"] != 0,
      experts=e, experts_per_tok=k if e else 0, expert_width=f if e else 0,
      expert_params=n_experts,
      # `parallel.sharding`: the experts' axis over 'fsdp', their width over 'tensor'.
      expert_shards=(mesh.fsdp if e and e % mesh.fsdp == 0 else 1)
      * (mesh.tensor if f and f % mesh.tensor == 0 else 1),
      batch_shards=shards, backend=backend)
