"""Decoder language models (Llama / Qwen family)."""

from jaxrl.models.logprobs import left_positions, scale_logits, token_logprobs
from jaxrl.models.model_config import DTYPES, KVCache, ModelConfig
from jaxrl.models.transformer import Transformer, abstract_model, init_model

__all__ = ["DTYPES", "KVCache", "ModelConfig", "Transformer", "abstract_model", "init_model",
           "left_positions", "scale_logits", "token_logprobs"]
