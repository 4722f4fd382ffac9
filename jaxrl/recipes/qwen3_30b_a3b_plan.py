"""Qwen3-30B-A3B's shape (`ModelConfig.qwen3_30b_a3b()`: 48 layers, 128 experts of width 768 per
layer, 8 per token; 30.5B parameters, 3.35B active per token) on the default task, with random
weights: a recipe for planning, not for training (docs/moe.md). `--print_config` shows its memory
plan per device without any weights on disk, e.g. over 8 devices, the experts split over them:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxrl.train \\
      --config configs/qwen3_30b_a3b_plan.py --config.mesh.fsdp=8 \\
      --config.mesh.rollout_tensor=1 --print_config

For a real run, name the checkpoint instead (`model.hf_path`: its config.json then sets these
keys) and a task of its own, as `qwen2_5_0_5b_gsm8k` does.

Laid out for slices of several hosts, where `python -m jaxrl.plan` compiles it (docs/plan.md):
params, Adam's moments and gradients over every chip ('fsdp' = -1: f32 master weights are 16
bytes a parameter, 488 GB in all), and each host's sampler on its own chips with a bf16 copy of
the model split over 4 of them (`mesh.rollout_tensor`: 61 GB whole, 15 GB a chip).
"""

from jaxrl.recipes import default


def get_config():
  c = default.get_config()
  c.name = "qwen3_30b_a3b_plan"
  # The preset's architecture (tests/test_moe_plan.py checks these against it).
  c.model.vocab_size = 151936
  c.model.d_model = 2048
  c.model.num_layers = 48
  c.model.num_heads = 32
  c.model.num_kv_heads = 4
  c.model.head_dim = 128
  c.model.mlp_dim = 6144
  c.model.rope_theta = 1000000.0
  c.model.rms_eps = 1e-6
  c.model.qk_norm = True
  c.model.num_experts = 128
  c.model.num_experts_per_tok = 8
  c.model.moe_intermediate_size = 768
  c.model.norm_topk_prob = True
  c.model.param_dtype = "float32"  # master weights and Adam moments in f32
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True
  c.model.remat = "full"
  c.sft.enabled = False
  c.rollout.num_prompts = 16
  c.rollout.group_size = 8
  c.rollout.max_prompt_len = 256
  c.rollout.max_new_tokens = 512
  c.rollout.lag = 1
  c.train.microbatch_tokens = 8192
  c.val.batch_size = 64
  c.moe.routing_replay = "rollout"
  c.mesh.fsdp = -1
  c.mesh.rollout_tensor = 4
  c.rollout.dtype = "bfloat16"
  return c
