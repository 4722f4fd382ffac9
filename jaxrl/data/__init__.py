"""Tokenizers and prompt sources."""

from jaxrl.data.sources import MixedSource, TaskSource, alphabet_of
from jaxrl.data.tokenizer import CharTokenizer, Tokenizer, left_pad

__all__ = ["CharTokenizer", "MixedSource", "TaskSource", "Tokenizer", "alphabet_of", "left_pad"]
