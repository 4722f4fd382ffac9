"""Hugging Face checkpoints (Llama / Qwen2 / Qwen3 / Qwen3-MoE) in and out of the jaxrl model.

`load_hf` reads `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`) and returns `(ModelConfig, graphdef, params)`; `save_hf` writes a
directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

Layout: HF linear weights are `[out, in]`, jaxrl's are `[in, out]` split per head, so every
projection is transposed and reshaped. Both use the non-interleaved "rotate half" RoPE layout, so
q/k need no row permutation. Per-layer tensors are stacked on a leading `[num_layers]` axis, the
layout of both scanned and unrolled models. Qwen3-MoE experts are stacked on a second
`[num_experts]` axis: read from per-expert tensors (`mlp.experts.{e}.gate_proj`, what
transformers writes) or fused ones (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, its
in-memory layout), written per expert.

Tensors are read through `safetensors.safe_open(framework="numpy")`, which memory-maps each file;
each tensor is read once, straight into its stacked host buffer, and buffers are placed on devices
leaf by leaf and then released.

Rope scaling: "linear" and "llama3" (Llama 3.1+) are read from `rope_scaling` (older configs) or
`rope_parameters` (transformers 5, which also holds `rope_theta`) into the `ModelConfig.rope_*`
fields, and written back in both spellings. Anything the model cannot represent (other rope types
such as yarn, dynamic or longrope, partial rotary, sliding windows, o_proj/MLP biases, other
activations), or a config whose spellings disagree, is refused rather than silently dropped: a
silently wrong model trains fine and samples garbage.
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np

from jaxrl.core.errors import UserError
from jaxrl.models.model_config import DTYPES, ModelConfig
from jaxrl.models.transformer import abstract_model
from jaxrl.parallel import param_shardings

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# architecture -> (model_type, q/k/v bias, per-head q/k norm)
ARCHITECTURES = {
  "LlamaForCausalLM": ("llama", False, False),
  "Qwen2ForCausalLM": ("qwen2", True, False),
  "Qwen3ForCausalLM": ("qwen3", False, True),
  "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
}
# Architectures whose MLPs are mixtures of experts (`jaxrl.models.moe`).
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_HF_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                   "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class HFCheckpointError(UserError, ValueError):
  """A checkpoint directory that does not match what its config or index promises."""


class UnsupportedModelError(UserError, NotImplementedError):
  """A model config.json asking for something the jaxrl model cannot represent (an architecture,
  a rope type, biases, ...): refused rather than silently dropped."""


def _per_layer(name: str) -> str:
  return "model.layers.{i}." + name


def _hf_layout(cfg: ModelConfig, fused_experts: bool = False
               ) -> dict[str, tuple[str, object, object]]:
  """jaxrl name -> (HF tensor name, HF -> jaxrl, jaxrl -> HF) per layer or global tensor.

  The converters take and return one layer's (or the global) array; names containing `{i}` are
  per-layer and stacked on axis 0, names containing `{e}` also per expert, on axis 1.
  `fused_experts`: the experts as fused [E, ...] tensors (reading only: their `jaxrl -> HF`
  converters give the fused tensor's shape, not its values).
  """
  D, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ident = (lambda x: x, lambda x: x)

  def proj_in(heads):  # [heads*Dh, D] <-> [D, heads, Dh]
    return (lambda x: x.T.reshape(D, heads, Dh), lambda x: x.reshape(D, heads * Dh).T)

  def bias(heads):  # [heads*Dh] <-> [heads, Dh]
    return (lambda x: x.reshape(heads, Dh), lambda x: x.reshape(heads * Dh))

  transpose = (lambda x: x.T, lambda x: x.T)
  layout = {
    "embed": ("model.embed_tokens.weight", *ident),
    "final_norm": ("model.norm.weight", *ident),
    "attn_norm": (_per_layer("input_layernorm.weight"), *ident),
    "mlp_norm": (_per_layer("post_attention_layernorm.weight"), *ident),
    "wq": (_per_layer("self_attn.q_proj.weight"), *proj_in(H)),
    "wk": (_per_layer("self_attn.k_proj.weight"), *proj_in(K)),
    "wv": (_per_layer("self_attn.v_proj.weight"), *proj_in(K)),
    # [D, H*Dh] <-> [H, Dh, D]
    "wo": (_per_layer("self_attn.o_proj.weight"), lambda x: x.T.reshape(H, Dh, D),
           lambda x: x.reshape(H * Dh, D).T),
    "w_gate": (_per_layer("mlp.gate_proj.weight"), *transpose),
    "w_up": (_per_layer("mlp.up_proj.weight"), *transpose),
    "w_down": (_per_layer("mlp.down_proj.weight"), *transpose),
  }
  if cfg.qkv_bias:
    layout["bq"] = (_per_layer("self_attn.q_proj.bias"), *bias(H))
    layout["bk"] = (_per_layer("self_attn.k_proj.bias"), *bias(K))
    layout["bv"] = (_per_layer("self_attn.v_proj.bias"), *bias(K))
  if cfg.qk_norm:
    layout["q_norm"] = (_per_layer("self_attn.q_norm.weight"), *ident)
    layout["k_norm"] = (_per_layer("self_attn.k_norm.weight"), *ident)
  if not cfg.tie_embeddings:
    layout["lm_head"] = ("lm_head.weight", *transpose)
  if cfg.num_experts:
    F = cfg.moe_intermediate_size
    for n in ("w_gate", "w_up", "w_down"):
      del layout[n]
    layout["router"] = (_per_layer("mlp.gate.weight"), *transpose)  # [E, D] <-> [D, E]
    if fused_experts:
      # gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
      t = lambda x: x.transpose(0, 2, 1)
      twice = lambda x: np.concatenate([t(x), t(x)], axis=1)
      layout["we_gate"] = (_per_layer("mlp.experts.gate_up_proj"), lambda x: t(x[:, :F]), twice)
      layout["we_up"] = (_per_layer("mlp.experts.gate_up_proj"), lambda x: t(x[:, F:]), twice)
      layout["we_down"] = (_per_layer("mlp.experts.down_proj"), t, t)
    else:
      expert = lambda name: _per_layer("mlp.experts.{e}." + name)
      layout["we_gate"] = (expert("gate_proj.weight"), *transpose)
      layout["we_up"] = (expert("up_proj.weight"), *transpose)
      layout["we_down"] = (expert("down_proj.weight"), *transpose)
  return layout


def _slots(cfg: ModelConfig, hf_name: str) -> list[tuple[int, ...]]:
  """The index of every array an HF tensor name stands for: () global, (i,) per layer, (i, e)
  per layer and expert."""
  if "{e}" in hf_name:
    return [(i, e) for i in range(cfg.num_layers) for e in range(cfg.num_experts)]
  if "{i}" in hf_name:
    return [(i,) for i in range(cfg.num_layers)]
  return [()]


def _tensor_name(hf_name: str, idx: tuple[int, ...]) -> str:
  return hf_name.format(**dict(zip("ie", idx)))


def _hf_shape(jaxrl_shape: tuple[int, ...], to_hf) -> tuple[int, ...]:
  """The HF shape a converter expects, from the jaxrl shape (without the layer axis)."""
  return to_hf(np.empty(jaxrl_shape, np.int8)).shape


# rope_type -> the fields it needs (HF name -> ModelConfig name); see `rope_inv_freq`.
_ROPE_TYPES = {
  "linear": {"factor": "rope_factor"},
  "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
             "high_freq_factor": "rope_high_freq_factor",
             "original_max_position_embeddings": "rope_original_max_positions"},
}


def _rope_scaling(hf: dict, field: str, spec: dict, config_path: str) -> dict:
  """`ModelConfig` rope-scaling fields from one rope dict (`rope_scaling` or `rope_parameters`)."""
  if any(isinstance(v, dict) for v in spec.values()):
    raise UnsupportedModelError(f"{config_path}: {field} with per-layer-type entries is not "
                                "supported (jaxrl's rope is the same for every layer)")
  kind = spec.get("rope_type", spec.get("type", "default"))
  if kind in (None, "default"):
    return {"rope_scaling": "none"}
  if kind not in _ROPE_TYPES:
    raise UnsupportedModelError(
        f"{config_path}: {field}.rope_type={kind!r} is not supported (jaxrl's rope implements "
        f"unscaled, {' and '.join(repr(k) for k in _ROPE_TYPES)} rotary embeddings); remove the "
        "field only if the checkpoint was trained without it")
  out = {"rope_scaling": kind}
  for name, ours in _ROPE_TYPES[kind].items():
    value = spec.get(name)
    if value is None and name == "original_max_position_embeddings":
      # What transformers falls back to when the rope dict leaves it out.
      value = hf.get("max_position_embeddings")
    if value is None:
      raise HFCheckpointError(f"{config_path}: {field}.rope_type={kind!r} needs "
                              f"{field}.{name}, which is missing")
    out[ours] = int(value) if ours == "rope_original_max_positions" else float(value)
  return out


def _rope_fields(hf: dict, config_path: str) -> dict:
  """`ModelConfig` rope fields (theta and scaling) from an HF config.

  transformers 5 prefers `rope_scaling` over `rope_parameters` and the latter's theta over the
  top-level `rope_theta`; older versions read only `rope_scaling` and `rope_theta`. Where a config
  spells a value in more than one place they must agree, so every version builds the same model.
  """
  specs = {f: hf.get(f) for f in ("rope_scaling", "rope_parameters") if hf.get(f)}
  for field, spec in specs.items():
    if not isinstance(spec, dict):
      raise HFCheckpointError(f"{config_path}: {field}={spec!r} is not a dict")
  thetas = {f"{field}.rope_theta": spec["rope_theta"] for field, spec in specs.items()
            if spec.get("rope_theta") is not None}
  if hf.get("rope_theta") is not None:
    thetas["rope_theta"] = hf["rope_theta"]
  if len({float(t) for t in thetas.values()}) > 1:
    raise HFCheckpointError(f"{config_path}: rope theta disagrees between fields: {thetas}")
  partial = {f"{field}.partial_rotary_factor": spec.get("partial_rotary_factor")
             for field, spec in specs.items()}
  partial["partial_rotary_factor"] = hf.get("partial_rotary_factor")
  for name, value in partial.items():
    if value is not None and float(value) != 1.0:
      raise UnsupportedModelError(f"{config_path}: {name}={value!r} is not supported (jaxrl's "
                                  "rope rotates the whole head)")
  scalings = {field: _rope_scaling(hf, field, spec, config_path)
              for field, spec in specs.items()}
  if len(scalings) == 2 and scalings["rope_scaling"] != scalings["rope_parameters"]:
    raise HFCheckpointError(f"{config_path}: rope_scaling and rope_parameters disagree "
                            f"({hf['rope_scaling']!r} vs {hf['rope_parameters']!r})")
  out = next(iter(scalings.values()), {"rope_scaling": "none"})
  out["rope_theta"] = float(next(iter(thetas.values()), 10000.0))
  return out


def _moe_fields(hf: dict, architecture: str, config_path: str) -> dict:
  """`ModelConfig` mixture-of-experts fields from an HF config ({} for a dense architecture);
  refuses layers that keep a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1)."""
  if architecture not in MOE_ARCHITECTURES:
    return {}
  layers = int(hf["num_hidden_layers"])
  step = int(hf.get("decoder_sparse_step", 1) or 1)
  dense = sorted(set(hf.get("mlp_only_layers") or ()) | {i for i in range(layers)
                                                          if (i + 1) % step})
  if dense:
    raise UnsupportedModelError(f"{config_path}: layers {dense} have a dense MLP "
                                "(mlp_only_layers / decoder_sparse_step); jaxrl's "
                                "mixture-of-experts model has experts in every layer")
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  if experts is None:
    raise HFCheckpointError(f"{config_path}: missing field 'num_experts'")
  return {"num_experts": int(experts), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
          "moe_intermediate_size": int(hf["moe_intermediate_size"]),
          "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def config_from_hf(hf: dict, *, param_dtype: str | None = None, scan_layers: bool = False,
                   config_path: str = CONFIG_FILE) -> ModelConfig:
  """A `ModelConfig` from a parsed HF `config.json`; raises on anything it cannot represent."""
  archs = hf.get("architectures") or []
  supported = [a for a in archs if a in ARCHITECTURES]
  if len(archs) != 1 or not supported:
    raise UnsupportedModelError(f"{config_path}: architectures={archs!r} is not supported; "
                                f"expected one of {sorted(ARCHITECTURES)}")
  _, qkv_bias, qk_norm = ARCHITECTURES[supported[0]]
  moe = _moe_fields(hf, supported[0], config_path)
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedModelError(f"{config_path}: hidden_act={act!r} is not supported (only silu)")
  if not qkv_bias and hf.get("attention_bias", False):
    # Llama/Qwen3 attention_bias also adds an o_proj bias, which the model has no slot for.
    raise UnsupportedModelError(f"{config_path}: attention_bias=true is not supported for "
                                f"{supported[0]} (the model has no o_proj bias)")
  if hf.get("mlp_bias", False):
    raise UnsupportedModelError(f"{config_path}: mlp_bias=true is not supported")
  if hf.get("use_sliding_window", False):
    raise UnsupportedModelError(f"{config_path}: use_sliding_window=true is not supported")
  rope = _rope_fields(hf, config_path)
  try:
    d_model = int(hf["hidden_size"])
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or d_model // num_heads
    if param_dtype is None:
      stored = hf.get("dtype", hf.get("torch_dtype")) or "float32"
      param_dtype = _HF_DTYPE_NAMES.get(str(stored).replace("torch.", ""), "float32")
    if param_dtype not in DTYPES:
      raise ValueError(f"param_dtype={param_dtype!r} is not one of {sorted(DTYPES)}")
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), d_model=d_model,
        num_layers=int(hf["num_hidden_layers"]), num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads), head_dim=int(head_dim),
        mlp_dim=int(hf["intermediate_size"]), **rope,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=qkv_bias, qk_norm=qk_norm,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), param_dtype=param_dtype,
        dtype=param_dtype, scan_layers=scan_layers, **moe)
  except KeyError as e:
    raise HFCheckpointError(f"{config_path}: missing field {e.args[0]!r}") from None


def _open_safetensors(path: str):
  """`safe_open(path)`; a file the library cannot read is an HFCheckpointError naming it (the
  library's own error does not)."""
  from safetensors import SafetensorError, safe_open

  try:
    return safe_open(path, framework="numpy")
  except SafetensorError as e:
    raise HFCheckpointError(f"{path}: cannot read: {e}; download it again") from e


def _tensor_files(model_dir: str) -> dict[str, str]:
  """HF tensor name -> the safetensors file that holds it."""
  index_path = os.path.join(model_dir, INDEX_FILE)
  single_path = os.path.join(model_dir, SINGLE_FILE)
  if os.path.exists(index_path):
    with open(index_path) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise HFCheckpointError(f"{index_path}: no 'weight_map'")
    files = {}
    for name, shard in weight_map.items():
      path = os.path.join(model_dir, shard)
      if shard not in files and not os.path.exists(path):
        raise HFCheckpointError(f"{index_path}: shard file {path} (holding {name!r}) is missing")
      files[shard] = path
    return {name: files[shard] for name, shard in weight_map.items()}
  if os.path.exists(single_path):
    with _open_safetensors(single_path) as f:
      return {name: single_path for name in f.keys()}
  raise HFCheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} exists")


def load_hf(model_dir: str, *, mesh=None, param_dtype: str | None = None,
            scan_layers: bool = False):
  """Loads a Llama / Qwen2 / Qwen3 / Qwen3-MoE HF checkpoint: returns `(ModelConfig, graphdef, params)`.

  `param_dtype=None` keeps the checkpoint's dtype (its config's `dtype`/`torch_dtype`); the
  compute dtype follows the parameter dtype (`dataclasses.replace` the config and rebuild the
  graphdef with `abstract_model` for another). With `mesh`, each parameter is placed with
  `jaxrl.parallel.param_shardings`; otherwise on the default device. The host holds one converted
  copy of the parameters until placement, released leaf by leaf.
  """
  config_path = os.path.join(model_dir, CONFIG_FILE)
  if not os.path.exists(config_path):
    raise HFCheckpointError(f"{config_path} is missing")
  with open(config_path) as f:
    hf = json.load(f)
  cfg = config_from_hf(hf, param_dtype=param_dtype, scan_layers=scan_layers,
                       config_path=config_path)
  graphdef, abstract = abstract_model(cfg)
  files = _tensor_files(model_dir)
  fused = cfg.num_experts > 0 and "model.layers.0.mlp.experts.down_proj" in files
  layout = _hf_layout(cfg, fused_experts=fused)
  np_dtype = _NP_DTYPES[cfg.param_dtype]

  # Every (jaxrl name, layer) slot to fill, grouped by file so each file is opened once.
  wanted: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
  for name, (hf_name, _, _) in layout.items():
    for idx in _slots(cfg, hf_name):
      tensor = _tensor_name(hf_name, idx)
      if tensor not in files:
        where = INDEX_FILE if os.path.exists(os.path.join(model_dir, INDEX_FILE)) else SINGLE_FILE
        raise HFCheckpointError(f"{os.path.join(model_dir, where)}: tensor {tensor!r} "
                                "is missing")
      wanted.setdefault(files[tensor], []).append((name, idx, tensor))

  shapes = {path[0].key: x.shape for path, x in
            jax.tree_util.tree_flatten_with_path(abstract)[0]}
  host = {name: np.empty(shapes[name], np_dtype) for name in layout}
  for path, slots in wanted.items():
    with _open_safetensors(path) as f:
      for name, idx, tensor in slots:
        _, to_jaxrl, to_hf = layout[name]
        want = _hf_shape(shapes[name][len(idx):], to_hf)
        x = f.get_tensor(tensor)
        if tuple(x.shape) != tuple(want):
          raise HFCheckpointError(f"{path}: tensor {tensor!r} has shape {tuple(x.shape)}, "
                                  f"expected {tuple(want)} from {CONFIG_FILE}")
        host[name][idx] = to_jaxrl(x).astype(np_dtype)

  shardings = None
  if mesh is not None:
    shardings = param_shardings(abstract, mesh)
    flat_sh = {path[0].key: s for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}

  def place(path, _):
    name = path[0].key
    x = host.pop(name)
    return jax.device_put(x, flat_sh[name]) if shardings is not None else jax.device_put(x)

  params = jax.tree_util.tree_map_with_path(place, abstract)
  return cfg, graphdef, params


def config_to_hf(cfg: ModelConfig, architecture: str) -> dict:
  """The `config.json` dict for `cfg` as `architecture`; refuses a mismatched variant."""
  if architecture not in ARCHITECTURES:
    raise UnsupportedModelError(f"architecture={architecture!r} is not supported; expected one of "
                                f"{sorted(ARCHITECTURES)}")
  model_type, qkv_bias, qk_norm = ARCHITECTURES[architecture]
  if (architecture in MOE_ARCHITECTURES) != (cfg.num_experts > 0):
    raise ValueError(f"{architecture} does not match the model's num_experts={cfg.num_experts}")
  if (cfg.qkv_bias, cfg.qk_norm) != (qkv_bias, qk_norm):
    raise ValueError(f"{architecture} needs qkv_bias={qkv_bias}, qk_norm={qk_norm}; the model "
                     f"has qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}")
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  max_positions = 32768
  if cfg.rope_scaling != "none":
    rope["rope_type"] = cfg.rope_scaling
    for name, ours in _ROPE_TYPES[cfg.rope_scaling].items():
      rope[name] = getattr(cfg, ours)
    if cfg.rope_scaling == "llama3":
      # transformers warns unless max_position_embeddings exceeds the original context.
      max_positions = max(max_positions,
                          int(cfg.rope_factor * cfg.rope_original_max_positions))
  out = {
    "architectures": [architecture],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": cfg.rms_eps,
    # Both spellings: older transformers read rope_theta (and rope_scaling), newer ones
    # rope_parameters.
    "rope_theta": cfg.rope_theta,
    "rope_parameters": rope,
    "tie_word_embeddings": cfg.tie_embeddings,
    "max_position_embeddings": max_positions,
    "dtype": cfg.param_dtype,
    "torch_dtype": cfg.param_dtype,
    "use_cache": True,
  }
  if cfg.rope_scaling != "none":
    out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
  if model_type in ("llama", "qwen3"):
    out["attention_bias"] = False
  if model_type == "llama":
    out["mlp_bias"] = False
  if model_type in ("qwen2", "qwen3", "qwen3_moe"):
    out["use_sliding_window"] = False
  if model_type == "qwen3_moe":
    out.update(attention_bias=False, num_experts=cfg.num_experts,
               num_experts_per_tok=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.moe_intermediate_size,
               norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
  return out


def save_hf(model_dir: str, cfg: ModelConfig, params, *, architecture: str) -> None:
  """Writes `config.json` and `model.safetensors` loadable by `transformers` as `architecture`.

  Tensors are written in the parameter dtype. Tied models omit `lm_head.weight`, as HF does.
  """
  from safetensors.numpy import save_file

  hf_config = config_to_hf(cfg, architecture)
  layout = _hf_layout(cfg)
  flat = {path[0].key: x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing = sorted(set(layout) - set(flat))
  if missing:
    raise ValueError(f"params lack {missing} required by the model config")
  tensors = {}
  for name, (hf_name, _, to_hf) in layout.items():
    x = np.asarray(jax.device_get(flat[name]))
    for idx in _slots(cfg, hf_name):
      tensors[_tensor_name(hf_name, idx)] = np.ascontiguousarray(to_hf(x[idx]))
  os.makedirs(model_dir, exist_ok=True)
  save_file(tensors, os.path.join(model_dir, SINGLE_FILE), metadata={"format": "pt"})
  with open(os.path.join(model_dir, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
    f.write("\n")


__all__ = ["ARCHITECTURES", "MOE_ARCHITECTURES", "HFCheckpointError", "UnsupportedModelError", "config_from_hf",
           "config_to_hf", "load_hf", "save_hf"]
