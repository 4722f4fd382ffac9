"""GRPO on GSM8K from Llama-3.2-1B-Instruct: the Llama 3 variant of `qwen2_5_0_5b_gsm8k`.

Same data and reward; the model directory comes e.g. from
`hf download meta-llama/Llama-3.2-1B-Instruct --local-dir
models/Llama-3.2-1B-Instruct` (a gated model: accept its license first). Llama 3.2 uses Llama-3
rope scaling and tied embeddings; its chat template writes a dated system header, and
generation ends at either <|eot_id|> or <|end_of_text|> (generation_config.json lists both).
"""

from jaxrl.recipes import qwen2_5_0_5b_gsm8k


def get_config():
  c = qwen2_5_0_5b_gsm8k.get_config()
  c.name = "llama3_2_1b_gsm8k"
  c.model.hf_path = "models/Llama-3.2-1B-Instruct"
  return c
