"""Request fields checked and response bodies built, as plain dicts in the OpenAI wire format.

Besides OpenAI's fields every choice carries what a trainer needs to train on the exact tokens
(no re-tokenisation): `prompt_token_ids` (the prompt the engine saw), `token_ids` (every
generated token, the EOS included when one ended the reply) and `policy_versions` (per generated
token, the params version that produced it). The token-id names follow vLLM's `return_token_ids`
option (`prompt_token_ids`, `token_ids`); chat responses also carry `prompt_token_ids` at the top
level, as vLLM's do. `policy_versions` is jaxrl's (no anchor has one). They are always returned.

Log-probs are those of the sampling distribution (the logits divided by the request's
temperature; the model's own at temperature 1), which is what the trainer recomputes.
The returned text is exactly the decoding of `token_ids` (a stop string, when one ends a
reply, is kept in both).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Mapping

from jaxrl.serving.chat_tools import RequestError
from jaxrl.serving.dispatcher import Completion


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
  """OpenAI's error object."""
  return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _number(body: Mapping, key: str, default, lo, hi, kind=float, lo_open=False):
  v = body.get(key)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
    raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}",
                       param=key)
  if v < lo or (lo_open and v == lo) or v > hi:
    raise RequestError(f"{key}={v} must be in {'(' if lo_open else '['}{lo}, {hi}]", param=key)
  return kind(v)


def sampling(body: Mapping, budget: int) -> dict:
  """Sampling fields of a request -> temperature, top_p, top_k, max_tokens, n, stop."""
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
  max_tokens = _number({key: max_tokens}, key, budget, 1, budget, int)
  stop = body.get("stop")
  if isinstance(stop, str):
    stop = [stop]
  if stop is not None and (not isinstance(stop, list) or
                           not all(isinstance(s, str) and s for s in stop) or len(stop) > 4):
    raise RequestError("stop must be a non-empty string or a list of up to 4 of them",
                       param="stop")
  return dict(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
              top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
              top_k=_number(body, "top_k", 0, 0, 1 << 30, int),
              max_tokens=max_tokens, n=_number(body, "n", 1, 1, 16, int), stop=stop or [])


def finish(tokenizer, c: Completion, max_tokens: int, stop: list[str]) -> tuple[Completion, str,
                                                                                str]:
  """(the reply cut at max_tokens or its first stop string, its text, finish_reason)."""
  n, reason = len(c.tokens), "stop" if c.hit_eos else "length"
  if n > max_tokens:
    n, reason = max_tokens, "length"
  if stop:
    for i in range(1, n + 1):
      text = tokenizer.decode(c.tokens[:i])
      if any(s in text for s in stop):
        n, reason = i, "stop"
        break
  if n < len(c.tokens):
    c = Completion(c.tokens[:n], c.logprobs[:n], c.versions[:n], False)
  return c, tokenizer.decode(c.tokens), reason


def token_text(tokenizer, t: int) -> str:
  """One token as text, special tokens included."""
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is not None:
    return backend.decode([int(t)], skip_special_tokens=False)
  return tokenizer.decode([int(t)])


def chat_logprobs(tokenizer, c: Completion) -> dict:
  content = []
  for t, lp in zip(c.tokens, c.logprobs):
    s = token_text(tokenizer, t)
    content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                    "top_logprobs": []})
  return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, c: Completion) -> dict:
  tokens = [token_text(tokenizer, t) for t in c.tokens]
  offsets, at = [], 0
  for s in tokens:
    offsets.append(at)
    at += len(s)
  return {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": None,
          "text_offset": offsets}


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex}"


def chat_response(model: str, prompt: list[int], choices: list[dict]) -> dict:
  done = sum(len(ch["token_ids"]) for ch in choices)
  return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
          "model": model, "choices": choices, "prompt_token_ids": prompt,
          "usage": usage(len(prompt), done)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def exact_fields(prompt: list[int], c: Completion) -> dict[str, Any]:
  """The fields every choice carries (module docstring)."""
  return {"prompt_token_ids": list(prompt), "token_ids": list(c.tokens),
          "policy_versions": list(c.versions)}


class LiveText:
  """The text of a reply as its tokens arrive (streaming), cut as `finish` cuts it: at
  `max_tokens` tokens or the first token whose decoding holds a stop string (kept).

  `feed(tokens)` takes all the reply's tokens so far -> (index, text piece) of each token not
  sent yet and within the cut: the text it adds to the decoding so far ("" while it ends inside
  a multi-byte character). `done`: the cut is reached. `rest(text)`: what the final text adds to
  the pieces sent."""

  def __init__(self, tokenizer, max_tokens: int, stop: list[str]):
    self.tok, self.max_tokens, self.stop = tokenizer, max_tokens, stop
    self.sent, self.emitted, self.cut = 0, "", False

  def feed(self, tokens: list[int]) -> list[tuple[int, str]]:
    out = []
    while not self.cut and self.sent < min(len(tokens), self.max_tokens):
      now, piece = self.tok.decode(tokens[:self.sent + 1]), ""
      if now.startswith(self.emitted) and not now.endswith("\ufffd"):
        piece, self.emitted = now[len(self.emitted):], now
      out.append((self.sent, piece))
      self.sent += 1
      self.cut = any(s in now for s in self.stop)
    return out

  @property
  def done(self) -> bool:
    """The cut is reached: later tokens are not part of the reply."""
    return self.cut or self.sent >= self.max_tokens

  def rest(self, text: str) -> str:
    return text[len(self.emitted):] if text.startswith(self.emitted) else ""
