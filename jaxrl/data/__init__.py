"""Tokenizers and prompt sources."""

from jaxrl.data.tokenizer import CharTokenizer, Tokenizer, left_pad

__all__ = ["CharTokenizer", "Tokenizer", "left_pad"]
