"""HF checkpoints: tiny random Llama / Qwen2 / Qwen3 models from `transformers` load into jaxrl
with the same logits, export back to a directory `transformers` loads, and broken checkpoints
fail naming the file, tensor or field."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.parity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from jaxrl.models import abstract_model  # noqa: E402
from hf_fixtures import random_hf_model  # noqa: E402  (tests/ is on sys.path)
from jaxrl.models.hf_checkpoint import HFCheckpointError, load_hf, save_hf  # noqa: E402
from jaxrl.parallel import make_mesh  # noqa: E402

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=97, rms_norm_eps=1e-6)
# Llama-3 rope scaling with a small original context, so that with head_dim 16 and theta 1e4
# (wavelengths 6.3, 20, 63, 199, ...) all three bands occur: kept (< 16 positions), blended
# (16..64) and divided by the factor (> 64); checked in the test. Passed in the older
# `rope_scaling` spelling, which transformers 5 converts; linear in the newer one.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}
VARIANTS = {
  "llama_untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
  "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
  "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
  "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False,
                                                           head_dim=32)),
  "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False,
                                                          rope_scaling=dict(LLAMA3_ROPE))),
  "linear_rope": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True,
                                                          rope_parameters=dict(LINEAR_ROPE))),
}
TOKENS = np.random.default_rng(0).integers(0, 97, size=(2, 11)).astype(np.int64)
# Long enough, and far enough past the original context, for every rope band to matter.
LONG_TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 48)).astype(np.int64)
ROPE_OFFSET = 100


def _hf_model(variant: str, seed: int = 0):
  config_cls, arch, extra = VARIANTS[variant]
  model = random_hf_model(config_cls, arch, seed, **COMMON, **extra)
  if "rope" in variant:
    # Sharper attention, so that the rope frequencies (what the rope variants test) visibly
    # move the logits.
    with torch.no_grad():
      for name, p in model.named_parameters():
        if "q_proj" in name or "k_proj" in name:
          p.mul_(6.0)
  return model


def _hf_logits(model, tokens=TOKENS, offset=0) -> np.ndarray:
  positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape) + offset
  with torch.no_grad():
    return model(torch.from_numpy(tokens), position_ids=positions).logits.float().numpy()


def _jaxrl_logits(graphdef, params, tokens=TOKENS, offset=0) -> np.ndarray:
  @jax.jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t) + offset, (b, t))
    hidden, _ = model(tokens, positions, jnp.ones((b, t), bool))
    return model.logits(hidden)

  return np.asarray(run(params, jnp.asarray(tokens, jnp.int32)))


def _save(model, path, **kw):
  model.save_pretrained(str(path), safe_serialization=True, **kw)
  return str(path)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_load_matches_hf_logits_and_save_round_trips(variant, tmp_path):
  model = _hf_model(variant)
  expected = _hf_logits(model)
  cfg, graphdef, params = load_hf(_save(model, tmp_path / "hf"))
  assert cfg.param_dtype == "float32" and cfg.tie_embeddings == VARIANTS[variant][2][
      "tie_word_embeddings"]
  np.testing.assert_allclose(_jaxrl_logits(graphdef, params), expected, atol=1e-4, rtol=0)

  out = str(tmp_path / "out")
  save_hf(out, cfg, params, architecture=VARIANTS[variant][1])
  again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(again).__name__ == VARIANTS[variant][1]
  np.testing.assert_allclose(_hf_logits(again), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant,scan", [("llama3_rope", True), ("linear_rope", False)])
def test_rope_scaling_matches_hf_logits_and_save_round_trips(variant, scan, tmp_path):
  model = _hf_model(variant, seed=2)
  spec = LLAMA3_ROPE if variant == "llama3_rope" else LINEAR_ROPE
  expected = _hf_logits(model, LONG_TOKENS, ROPE_OFFSET)
  cfg, graphdef, params = load_hf(_save(model, tmp_path / "hf"), scan_layers=scan)
  assert (cfg.rope_scaling, cfg.rope_factor) == (spec["rope_type"], spec["factor"])
  assert cfg.rope_theta == spec.get("rope_theta", 10000.0)
  if variant == "llama3_rope":
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_positions) == (1.0, 4.0, 64)
    wavelen = 2 * np.pi * cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    divided, kept = (wavelen > 64 / 1.0).sum(), (wavelen < 64 / 4.0).sum()
    assert divided > 0 and kept > 0 and divided + kept < cfg.head_dim // 2
  got = _jaxrl_logits(graphdef, params, LONG_TOKENS, ROPE_OFFSET)
  print(f"{variant}: max |jaxrl - hf| = {np.abs(got - expected).max():.3g}")
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
  # The scaling is what makes them agree: the same weights with unscaled rope are far off.
  unscaled, _ = abstract_model(dataclasses.replace(cfg, rope_scaling="none"))
  assert np.abs(_jaxrl_logits(unscaled, params, LONG_TOKENS, ROPE_OFFSET) - expected).max() > 1e-2

  out = str(tmp_path / "out")
  save_hf(out, cfg, params, architecture="LlamaForCausalLM")
  with open(os.path.join(out, "config.json")) as f:
    saved = json.load(f)
  scaling = {k: v for k, v in spec.items() if k != "rope_theta"}
  assert saved["rope_scaling"] == scaling
  assert saved["rope_parameters"] == {**scaling, "rope_theta": cfg.rope_theta}
  again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert {k: again.config.rope_parameters[k] for k in scaling} == scaling
  reloaded = _hf_logits(again, LONG_TOKENS, ROPE_OFFSET)
  print(f"{variant}: max |transformers reload - hf| = {np.abs(reloaded - expected).max():.3g}")
  np.testing.assert_allclose(reloaded, expected, atol=1e-4, rtol=0)
  assert load_hf(out, scan_layers=scan)[0] == cfg


def test_sharded_checkpoint_onto_a_mesh_with_scanned_layers(tmp_path, devices):
  model = _hf_model("qwen2_tied", seed=1)
  path = _save(model, tmp_path / "hf", max_shard_size="20KB")
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  mesh = make_mesh(1, 2, 2, devices)
  cfg, graphdef, params = load_hf(path, mesh=mesh, scan_layers=True)
  assert cfg.scan_layers
  assert params["wq"][...].sharding.mesh == mesh
  assert params["wq"][...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor",
                                                                        None)
  np.testing.assert_allclose(_jaxrl_logits(graphdef, params), _hf_logits(model), atol=1e-4,
                             rtol=0)


def test_bfloat16_params(tmp_path):
  model = _hf_model("llama_untied")
  cfg, _, params = load_hf(_save(model, tmp_path / "hf"), param_dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16" and params["embed"][...].dtype == jnp.bfloat16


def test_missing_shard_file_names_it(tmp_path):
  path = _save(_hf_model("llama_untied"), tmp_path / "hf", max_shard_size="20KB")
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
  os.remove(os.path.join(path, shard))
  with pytest.raises(HFCheckpointError, match=shard):
    load_hf(path)


def test_missing_tensor_names_it(tmp_path):
  from safetensors.numpy import load_file, save_file

  path = _save(_hf_model("llama_untied"), tmp_path / "hf")
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(HFCheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
    load_hf(path)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
  from safetensors.numpy import load_file, save_file

  path = _save(_hf_model("llama_untied"), tmp_path / "hf")
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(HFCheckpointError,
                     match=r"k_proj\.weight.*\(16, 64\), expected \(32, 64\)"):
    load_hf(path)


def _edit_config(path, **fields):
  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    hf = json.load(f)
  hf.update(fields)
  with open(config_path, "w") as f:
    json.dump(hf, f)


def test_unsupported_architecture_and_rope_scaling(tmp_path):
  path = _save(_hf_model("llama_untied"), tmp_path / "hf")
  _edit_config(path, architectures=["GPT2LMHeadModel"])
  with pytest.raises(NotImplementedError, match="architectures=.*GPT2LMHeadModel"):
    load_hf(path)
  _edit_config(path, architectures=["LlamaForCausalLM"])
  unsupported = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 4096},
  }
  for kind, spec in unsupported.items():
    _edit_config(path, rope_scaling=spec, rope_parameters=None)
    with pytest.raises(NotImplementedError, match=f"rope_scaling.rope_type='{kind}'"):
      load_hf(path)
    _edit_config(path, rope_scaling=None, rope_parameters={**spec, "rope_theta": 10000.0})
    with pytest.raises(NotImplementedError, match=f"rope_parameters.rope_type='{kind}'"):
      load_hf(path)
  _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5})
  with pytest.raises(NotImplementedError, match="rope_parameters.partial_rotary_factor=0.5"):
    load_hf(path)


def test_rope_scaling_missing_or_conflicting_fields_are_named(tmp_path):
  path = _save(_hf_model("llama_untied"), tmp_path / "hf")
  no_factor = {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}
  _edit_config(path, rope_scaling=None, rope_parameters=no_factor)
  with pytest.raises(HFCheckpointError, match=r"needs rope_parameters\.factor"):
    load_hf(path)
  _edit_config(path, rope_scaling={"type": "linear"}, rope_parameters=None)
  with pytest.raises(HFCheckpointError, match=r"needs rope_scaling\.factor"):
    load_hf(path)
  # Like transformers, a llama3 dict without its original context uses max_position_embeddings.
  no_orig = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
  _edit_config(path, rope_scaling=no_orig, rope_parameters=None, max_position_embeddings=512)
  assert load_hf(path)[0].rope_original_max_positions == 512
  _edit_config(path, rope_scaling=LLAMA3_ROPE, rope_parameters={**LLAMA3_ROPE, "factor": 4.0})
  with pytest.raises(HFCheckpointError, match="rope_scaling and rope_parameters disagree"):
    load_hf(path)
  _edit_config(path, rope_scaling=None, rope_parameters={"rope_type": "default",
                                                          "rope_theta": 500000.0},
               rope_theta=10000.0)
  with pytest.raises(HFCheckpointError, match="rope theta disagrees"):
    load_hf(path)
