"""Decoder language models (Llama / Qwen family)."""

from jaxrl.models.transformer import (DTYPES, KVCache, ModelConfig, Transformer, abstract_model,
                                      init_model, left_positions, scale_logits, token_logprobs)

__all__ = ["DTYPES", "KVCache", "ModelConfig", "Transformer", "abstract_model", "init_model",
           "left_positions", "scale_logits", "token_logprobs"]
