"""GRPO on GSM8K from Qwen2.5-0.5B-Instruct: a real model from local files.

Needs two things on disk (nothing is downloaded at run time):
- `model.hf_path`: the Hugging Face model directory (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json, generation_config.json), e.g. from
  `hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct`;
- `task.path` / `task.val_path`: GSM8K-format JSONL, one {"question", "answer"} object per line,
  the final answer after "####" (the `main` config of openai/gsm8k, train and test splits).

Prompts are the question plus an instruction, rendered as a user message through the model's
chat template; the reward is 1 when the answer after the last "####" (or the last number)
equals the gold one. The sizes below are for an accelerator slice (fsdp over every device);
on a CPU use toy sizes, and validate on a few questions rather than the whole test split, e.g.

    head -n 16 data/gsm8k/test.jsonl > data/gsm8k/test16.jsonl
    python -m jaxrl.train --config configs/qwen2_5_0_5b_gsm8k.py --config.model.dtype=float32 \
      --config.rollout.num_prompts=2 --config.rollout.group_size=4 \
      --config.rollout.max_new_tokens=64 --config.train.steps=3 \
      --config.task.val_path=data/gsm8k/test16.jsonl --config.val.batch_size=8
"""

from jaxrl.recipes import default


def get_config():
  c = default.get_config()
  c.name = "qwen2_5_0_5b_gsm8k"
  c.model.hf_path = "models/Qwen2.5-0.5B-Instruct"
  c.model.param_dtype = "float32"  # master weights and Adam moments in f32
  c.model.dtype = "bfloat16"  # compute; log-probs are always f32
  c.model.scan_layers = True  # 24 layers: compile time flat in depth
  c.model.remat = "full"  # 768-token rows: keep layer inputs, not [rows, heads, T, T] scores

  c.task.name = "math"
  c.task.path = "data/gsm8k/train.jsonl"
  c.task.val_path = "data/gsm8k/test.jsonl"
  c.task.instruction = "Let's think step by step and output the final answer after \"####\"."
  c.sft.enabled = False  # an instruct model needs no format warm-up

  c.rollout.num_prompts = 64
  c.rollout.group_size = 8
  c.rollout.max_prompt_len = 256  # chat template + question + instruction
  c.rollout.max_new_tokens = 512
  c.rollout.temperature = 1.0
  c.rollout.lag = 1  # generation of step t+1 overlaps training on step t
  c.loss.eps_high = 0.28  # clip-higher: low-probability tokens may still rise
  # Decoupled PPO: the ratio and its clip against the trainer's recompute before the update, and
  # truncated importance weights for everything between the sampler and that recompute (one
  # update of lag, bf16 sampling against f32 training).
  c.loss.ratio_base = "trainer"
  c.loss.correction = "token_tis"

  c.train.steps = 200
  c.train.learning_rate = 1e-6
  c.train.warmup_steps = 10
  c.train.lr_schedule = "constant"
  c.train.weight_decay = 0.01
  c.train.b2 = 0.999
  # Rows packed end to end into 8,192-position micro-batches per batch shard (no padding to the
  # longest row; each group's prompt once): with remat=full a layer keeps only its input, ~43 KB
  # a position over 24 layers in bf16, so a micro-batch's activations stay near 1 GiB. Longer
  # packed rows cost more attention than they save: blockwise attention (xla, cudnn) computes
  # every query-key pair of a packed row, 4 x 8,192 x 896 FLOPs a position per layer here (~0.7x
  # the model's own 2 x params), growing with the row.
  c.train.packing = True
  c.train.num_microbatches = 0  # counted by tokens
  c.train.microbatch_tokens = 8192

  c.val.every = 20
  c.val.batch_size = 256
  c.checkpoint.every = 50
  c.mesh.fsdp = -1  # shard params, optimizer state and batch rows over every device
  return c
