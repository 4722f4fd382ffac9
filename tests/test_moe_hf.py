"""Qwen3-MoE checkpoints in and out of Hugging Face: a tiny random `Qwen3MoeForCausalLM` made by
`transformers` loads with the same logits (<= 1e-5 in float32) and the same greedy tokens
(decoded through jaxrl's key/value cache), from per-expert or fused expert tensors; export
reloads in `transformers` with the same logits."""

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

from hf_fixtures import random_hf_model  # noqa: E402  (tests/ is on sys.path)
from jaxrl.models.hf_checkpoint import UnsupportedModelError, load_hf, save_hf  # noqa: E402
from jaxrl.models.model_config import KVCache  # noqa: E402

ARCH = "Qwen3MoeForCausalLM"
CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
          "moe_intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2,
          "vocab_size": 61, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
TOKENS = np.random.default_rng(0).integers(0, 61, size=(2, 9)).astype(np.int64)
NEW_TOKENS = 8


def _hf_model(seed=0, **extra):
  model = random_hf_model("Qwen3MoeConfig", ARCH, seed, **{**CONFIG, **extra})
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "mlp.gate." in name:  # decisive routing: every token's top-k well separated
        p.copy_(torch.randn_like(p))
      elif "experts" in name:  # experts large enough to move the logits
        p.mul_(10.0)
  return model


def _hf_logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens)).logits.float().numpy()


def _jaxrl_logits(graphdef, params, tokens=TOKENS) -> np.ndarray:
  @jax.jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    hidden, _ = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool))
    return model.logits(hidden)

  return np.asarray(run(params, jnp.asarray(tokens, jnp.int32)))


def _jaxrl_greedy(cfg, graphdef, params, tokens=TOKENS) -> np.ndarray:
  """Greedy continuation through a prefill and single-token decode steps over the cache."""
  b, t = tokens.shape

  @jax.jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    cache = KVCache.zeros(cfg, b, t + NEW_TOKENS)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden, cache = model(tokens, pos, jnp.ones((b, t), bool), cache=cache)
    nxt = jnp.argmax(model.logits(hidden[:, -1]), -1)
    out = [nxt]
    for i in range(NEW_TOKENS - 1):
      hidden, cache = model(nxt[:, None], jnp.full((b, 1), t + i), jnp.ones((b, 1), bool),
                            cache=cache, cache_index=t + i)
      nxt = jnp.argmax(model.logits(hidden[:, 0]), -1)
      out.append(nxt)
    return jnp.stack(out, 1)

  return np.asarray(run(params, jnp.asarray(tokens, jnp.int32)))


def _hf_greedy(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    out = model.generate(torch.from_numpy(tokens), max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
  return out[:, tokens.shape[1]:].numpy()


@pytest.mark.parametrize("scan,norm", [(False, True), (True, False)])
def test_qwen3_moe_logits_greedy_and_export_round_trip(tmp_path, scan, norm):
  model = _hf_model(norm_topk_prob=norm)
  model.save_pretrained(str(tmp_path / "hf"))
  cfg, graphdef, params = load_hf(str(tmp_path / "hf"), scan_layers=scan)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
          cfg.norm_topk_prob) == (8, 2, 24, norm)
  expected = _hf_logits(model)
  np.testing.assert_allclose(_jaxrl_logits(graphdef, params), expected, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(_jaxrl_greedy(cfg, graphdef, params), _hf_greedy(model))

  save_hf(str(tmp_path / "out"), cfg, params, architecture=ARCH)
  again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                            dtype=torch.float32).eval()
  assert type(again).__name__ == ARCH and again.config.norm_topk_prob == norm
  np.testing.assert_allclose(_hf_logits(again), expected, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(_hf_greedy(again), _hf_greedy(model))
  cfg2, graphdef2, params2 = load_hf(str(tmp_path / "out"), scan_layers=scan)
  assert cfg2 == cfg
  np.testing.assert_allclose(_jaxrl_logits(graphdef2, params2), expected, atol=1e-5, rtol=0)


def test_fused_expert_tensors_load_the_same(tmp_path):
  """The experts as transformers holds them in memory (gate_up_proj [E, 2F, D], down_proj
  [E, D, F]) load into the same model as the per-expert tensors it writes."""
  from safetensors.numpy import load_file, save_file

  model = _hf_model(seed=1)
  model.save_pretrained(str(tmp_path / "hf"))
  tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
  fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
  for i in range(CONFIG["num_hidden_layers"]):
    get = lambda e, n, i=i: tensors[f"model.layers.{i}.mlp.experts.{e}.{n}.weight"]
    fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(8)])
    fused[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
        [get(e, "down_proj") for e in range(8)])
  os.makedirs(tmp_path / "fused")
  save_file(fused, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
  with open(tmp_path / "hf" / "config.json") as f, open(tmp_path / "fused" / "config.json",
                                                        "w") as g:
    g.write(f.read())
  _, graphdef, params = load_hf(str(tmp_path / "fused"))
  np.testing.assert_allclose(_jaxrl_logits(graphdef, params), _hf_logits(model), atol=1e-5,
                             rtol=0)


def test_dense_layers_in_a_moe_checkpoint_are_refused(tmp_path):
  model = _hf_model()
  model.save_pretrained(str(tmp_path / "hf"))
  path = tmp_path / "hf" / "config.json"
  hf = json.loads(path.read_text())
  path.write_text(json.dumps({**hf, "mlp_only_layers": [1]}))
  with pytest.raises(UnsupportedModelError, match=r"layers \[1\] have a dense MLP"):
    load_hf(str(tmp_path / "hf"))
