"""The tokenizer interface jaxrl needs, and a character tokenizer for built-in tasks.

Nothing in jaxrl looks inside a tokenizer beyond these members: `pad_id`, `eos_id`, `eos_ids`,
`vocab_size`, `encode`, `decode`, `encode_prompt` (the tokens a task prompt becomes: with a chat
model, a rendered user turn that opens the assistant's) and `encode_observation` (the tokens an
environment's observation appends after a model turn). `eos_ids` holds every id that ends a generation (a Hugging Face
model may have several: Llama 3.1 Instruct stops at `<|eot_id|>`, `<|eom_id|>` or
`<|end_of_text|>`); `eos_id == eos_ids[0]` is the one jaxrl writes itself, e.g. at the end of a
supervised target. `jaxrl.data.hf_tokenizer.HFTokenizer` implements the protocol for Hugging
Face tokenizers and chat templates.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Tokenizer(Protocol):
  pad_id: int
  eos_id: int
  eos_ids: tuple[int, ...]
  vocab_size: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def encode_prompt(self, text: str) -> list[int]: ...

  def encode_observation(self, text: str) -> list[int]: ...


class CharTokenizer:
  """One id per character of `alphabet`; 0 is padding, 1 is end-of-sequence."""

  pad_id = 0
  eos_id = 1
  eos_ids = (1,)

  def __init__(self, alphabet: str):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    self.alphabet = alphabet
    self._ids = {ch: i + 2 for i, ch in enumerate(alphabet)}
    self._chars = ("", "", *alphabet)  # by id: padding and EOS decode to nothing
    self.vocab_size = len(alphabet) + 2

  def encode(self, text: str) -> list[int]:
    bad = sorted({ch for ch in text if ch not in self._ids})
    if bad:
      raise ValueError(f"characters {bad} are not in the tokenizer alphabet {self.alphabet!r}")
    return [self._ids[ch] for ch in text]

  def encode_prompt(self, text: str) -> list[int]:
    """Prompts are plain text: the built-in tasks write the whole context themselves."""
    return self.encode(text)

  def encode_observation(self, text: str) -> list[int]:
    return self.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of the ids, stopping at the first EOS; padding is dropped."""
    ids = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return "".join([self._chars[i] for i in ids if i >= 0])


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray,
                                                                                np.ndarray]:
  """Left-pads token lists to `length` -> (tokens [B, length] int32, valid [B, length] bool).

  A sequence longer than `length` is an error naming its row: nothing is silently truncated.
  """
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  valid = np.zeros((len(seqs), length), bool)
  for row, s in enumerate(seqs):
    if len(s) > length:
      raise ValueError(f"row {row}: prompt has {len(s)} tokens, more than the {length} allowed "
                       f"(config.rollout.max_prompt_len)")
    if len(s) == 0:
      raise ValueError(f"row {row}: empty prompt")
    tokens[row, length - len(s):] = s
    valid[row, length - len(s):] = True
  return tokens, valid
