"""GRPO on GSM8K from Qwen2.5-0.5B-Instruct with LoRA: `qwen2_5_0_5b_gsm8k` training low-rank
adapters on a frozen base instead of every weight.

Same model directory, data, reward, rollout and loss as the full recipe. RL trains rank-16
adapters (alpha 32) on all seven projections of every layer, q, k, v, o, gate, up and down:
adapters on the MLP as well as attention are what let LoRA match full fine-tuning; attention
alone falls behind (Schulman et al., "LoRA Without Regret", Thinking Machines 2025). A policy-
gradient update carries a few bits per episode, so even a small rank holds what RL learns; 16 is
ample. The optimizer keeps Adam moments for the adapters alone and a published version moves
adapter bytes only.

Export: `python -m jaxrl.export --run_dir R --out O` writes the merged model; `--adapter` writes
a PEFT adapter for the starting model (`peft.PeftModel.from_pretrained`, or vLLM's LoRA
serving).
"""

from jaxrl.recipes import qwen2_5_0_5b_gsm8k


def add_lora(c):
  """`c` (a full-fine-tuning recipe) with the RL phase on LoRA adapters; returns `c`."""
  c.model.lora.rank = 16
  c.model.lora.alpha = 32.0  # scale alpha / rank = 2 (PEFT's scaling)
  c.model.lora.dropout = 0.0  # RL does not overfit a fixed dataset; no need to regularise
  c.model.lora.targets = "q,k,v,o,gate,up,down"
  # 10x the full recipe's train.learning_rate (1e-6). With B at zero and A small at init, a step
  # moves W0 + alpha / rank * A B far less than the same learning rate moves a full weight: the
  # best LoRA rate is about 10x full fine-tuning's, nearly independent of the rank under
  # alpha / rank scaling, in supervised and RL training alike ("LoRA Without Regret").
  c.model.lora.learning_rate = 1e-5
  return c


def get_config():
  c = add_lora(qwen2_5_0_5b_gsm8k.get_config())
  c.name = "qwen2_5_0_5b_gsm8k_lora"
  return c
