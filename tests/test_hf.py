"""HF checkpoints: tiny random Llama / Qwen2 / Qwen3 models from `transformers` load into jaxrl
with the same logits, export back to a directory `transformers` loads, and broken checkpoints
fail naming the file, tensor or field."""

from __future__ import annotations

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

from jaxrl.models.hf import HFCheckpointError, load_hf, save_hf  # noqa: E402
from jaxrl.parallel import make_mesh  # noqa: E402

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=97, rms_norm_eps=1e-6)
VARIANTS = {
  "llama_untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
  "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
  "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
  "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False,
                                                           head_dim=32)),
}
TOKENS = np.random.default_rng(0).integers(0, 97, size=(2, 11)).astype(np.int64)


def _hf_model(variant: str, seed: int = 0):
  config_cls, arch, extra = VARIANTS[variant]
  config = getattr(transformers, config_cls)(**COMMON, **extra)
  torch.manual_seed(seed)
  model = getattr(transformers, arch)(config).to(torch.float32).eval()
  with torch.no_grad():
    # Default init leaves norms at 1 and biases at 0, which would hide a misplaced norm or bias.
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model


def _hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS)).logits.float().numpy()


def _jaxrl_logits(graphdef, params) -> np.ndarray:
  @jax.jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden, _ = model(tokens, positions, jnp.ones((b, t), bool))
    return model.logits(hidden)

  return np.asarray(run(params, jnp.asarray(TOKENS, jnp.int32)))


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
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0}
  _edit_config(path, architectures=["LlamaForCausalLM"], rope_scaling=llama3)
  with pytest.raises(NotImplementedError, match="rope_scaling.rope_type='llama3'"):
    load_hf(path)
  _edit_config(path, rope_scaling=None, rope_parameters=llama3)
  with pytest.raises(NotImplementedError, match="rope_parameters.rope_type='llama3'"):
    load_hf(path)
