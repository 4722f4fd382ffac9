"""GRPO on GSM8K from Llama-3.2-1B-Instruct with LoRA: `llama3_2_1b_gsm8k` with the adapters of
`qwen2_5_0_5b_gsm8k_lora` (rank 16, alpha 32, all seven projections, 10x the full recipe's
learning rate; see there why)."""

from jaxrl.recipes import llama3_2_1b_gsm8k, qwen2_5_0_5b_gsm8k_lora


def get_config():
  c = qwen2_5_0_5b_gsm8k_lora.add_lora(llama3_2_1b_gsm8k.get_config())
  c.name = "llama3_2_1b_gsm8k_lora"
  return c
