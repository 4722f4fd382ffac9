"""Mixture-of-experts models in the memory plan (`jaxrl.config.memory`): the experts' params,
optimizer state and gradients split over 'fsdp', and the dispatch buffers of a micro-batch, for
the Qwen3-30B-A3B shape without any weights on disk."""

import pytest

from jaxrl.config import memory, validate
from jaxrl.config.plan import plan_lines
from jaxrl.config.schema import flatten
from jaxrl.models import ModelConfig
from jaxrl.recipes import default, default_moe, qwen3_30b_a3b_plan


def _inputs(cfg, devices: int = 8):
  mesh = validate(cfg, devices)
  return memory.inputs_from_config(flatten(cfg), mesh), mesh


def _recipe(fsdp: int = 8):
  cfg = qwen3_30b_a3b_plan.get_config()
  cfg.mesh.fsdp = fsdp
  cfg.mesh.rollout_tensor = 1  # one process here: the recipe's 4 is each host's of a slice
  return cfg


def test_recipe_is_the_preset():
  cfg, preset = qwen3_30b_a3b_plan.get_config(), ModelConfig.qwen3_30b_a3b()
  arch = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "mlp_dim", "rope_theta", "rms_eps", "qkv_bias", "qk_norm", "tie_embeddings",
          "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
  assert {k: cfg.model[k] for k in arch} == {k: getattr(preset, k) for k in arch}


def test_qwen3_30b_a3b_expert_bytes():
  """Experts per layer: router D E = 2048 x 128 = 262,144 and 3 E D F = 3 x 128 x 2048 x 768 =
  603,979,776; x 48 layers = 29,003,612,160, of the preset's 30,532,122,624 parameters
  (tests/test_moe.py counts both from the model's shapes). Over fsdp 8 (16 experts each), f32:
  29,003,612,160 x 4 / 8 = 14,501,806,080 bytes of params, twice that for Adam's two moments
  and for the gradients (2 micro-batches: the accumulator and one micro-batch's). Dispatch, one
  micro-batch of one group (256 + 8 x 512 = 4,352 positions), one layer kept (remat full):
  4,352 x (3 x 8 x 2048 x 2 + 2 x 128 x 4 + 3 x 8 x 4) = 4,352 x 99,424 = 432,693,248 bytes."""
  i, _ = _inputs(_recipe())
  assert i.params == 30_532_122_624
  assert i.expert_params == 29_003_612_160
  assert (i.positions, i.microbatches, i.expert_shards) == (4352, 2, 8)
  e = memory.expert_bytes(i)
  assert e == {"params": 14_501_806_080, "optimizer": 29_003_612_160,
               "gradients": 29_003_612_160, "dispatch": 432_693_248}
  plan = memory.plan_memory(i)
  # The rest of the params (1,528,510,464: attention, norms, embeddings) split over all 8.
  assert plan.parts["params"] == 1_528_510_464 * 4 // 8 + 14_501_806_080
  assert plan.parts["dispatch"] == 432_693_248
  # Experts that fsdp does not divide stay whole on every device: 96 over 64.
  odd = _recipe(64)
  odd.model.num_experts = 96
  i, _ = _inputs(odd, 64)
  assert i.expert_shards == 1
  assert memory.expert_bytes(i)["params"] == 48 * (2048 * 96 + 3 * 96 * 2048 * 768) * 4


def test_experts_change_the_plan_of_a_tiny_model():
  """The tiny MoE variant (4 experts of width 96, 2 per token, d_model 64, 2 layers): the dense
  MLP's 3 x 64 x 192 = 36,864 per layer become 64 x 4 + 3 x 4 x 64 x 96 = 73,984, and the
  activations count the tokens' 2 x 96 active width."""
  dense, _ = _inputs(default.get_config(), 1)
  moe, _ = _inputs(default_moe.get_config(), 1)
  assert moe.params - dense.params == 2 * (73_984 - 36_864)
  assert moe.expert_params == 2 * 73_984
  assert memory.expert_bytes(dense) == dict.fromkeys(
      ("params", "optimizer", "gradients", "dispatch"), 0)
  assert memory.plan_memory(dense).parts["dispatch"] == 0
  assert memory.activation_bytes(moe) == memory.activation_bytes(dense)  # 2 x 96 == 192


def test_print_config_plans_the_preset():
  cfg = _recipe()
  _, mesh = _inputs(cfg)
  lines = plan_lines(cfg, mesh, 8, "cpu")
  plan = next(line for line in lines if line.startswith("memory plan"))
  assert "dispatch" in plan and "experts (128 per layer, 8 per token, over 8 device(s))" in plan


@pytest.mark.parametrize("key", ["num_experts", "moe_intermediate_size"])
def test_hf_config_experts_are_planned(tmp_path, key):
  """A Qwen3-MoE config.json (no weights) plans the same experts as the keys do."""
  import json
  cfg = _recipe()
  p = ModelConfig.qwen3_30b_a3b()
  (tmp_path / "config.json").write_text(json.dumps({
      "vocab_size": p.vocab_size, "hidden_size": p.d_model, "num_hidden_layers": p.num_layers,
      "num_attention_heads": p.num_heads, "num_key_value_heads": p.num_kv_heads,
      "head_dim": p.head_dim, "intermediate_size": p.mlp_dim, "num_experts": p.num_experts,
      "num_experts_per_tok": p.num_experts_per_tok,
      "moe_intermediate_size": p.moe_intermediate_size}))
  good = flatten(cfg)
  good["model.hf_path"] = str(tmp_path)
  _, mesh = _inputs(cfg)
  i = memory.inputs_from_config(good, mesh)
  assert getattr(i, {"num_experts": "experts", "moe_intermediate_size": "expert_width"}[key]) \
      == getattr(p, key)
  # qk_norm is not read from config.json (2 x 128 per layer fewer).
  assert i.expert_params == 29_003_612_160
