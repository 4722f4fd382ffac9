"""GRPO on GSM8K from Qwen2.5-7B-Instruct at the field's usual batch: 64 prompts x 8 samples of
up to 1,024 new tokens, generated one step ahead (`rollout.lag = 1`).

The same task and reward as `qwen2_5_0_5b_gsm8k`; the model directory comes e.g. from
`hf download Qwen/Qwen2.5-7B-Instruct --local-dir models/Qwen2.5-7B-Instruct`. Sized for a
slice, not a CPU: `python -m jaxrl.plan --config configs/qwen2_5_7b_gsm8k.py --target v5p-32`
compiles every program of it for a TPU v5p-32 (16 chips) on a laptop and says whether it fits
(docs/plan.md has the targets it was compiled for and their figures).

Layout: the params, Adam's moments and the gradients over 'fsdp' x 'tensor' (f32 master
weights: 16 bytes a parameter, 122 GB in all); 'tensor' = 4 splits the sampler's KV cache by its
4 kv heads (the cache of 512 rows x 1,280 slots is 37.6 GB in bf16, whole on every chip of a
'data' or 'fsdp' axis); the sampler computes and publishes in bf16 (half the bytes a decode
step reads and a version moves).
"""

from jaxrl.recipes import qwen2_5_0_5b_gsm8k


def get_config():
  c = qwen2_5_0_5b_gsm8k.get_config()
  c.name = "qwen2_5_7b_gsm8k"
  c.model.hf_path = "models/Qwen2.5-7B-Instruct"
  c.rollout.num_prompts = 64
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = 1024
  c.rollout.dtype = "bfloat16"
  c.mesh.fsdp = -1
  c.mesh.tensor = 4
  c.val.batch_size = 128
  return c
