"""A safe parser for the integer arithmetic a model writes: + - * /, unary minus, parentheses.

Model output is untrusted text, so it is never handed to `eval`, `exec` or `ast`: a hand-written
recursive-descent parser accepts exactly the grammar below and evaluates with
`fractions.Fraction`, so (8/4)*3 is exactly 6 and 7/2*2 exactly 7 - no float rounding decides
a reward. Every failure (a stray character, a division by zero, input over `max_len` characters,
nesting over `max_depth`) is an `ExprError`; nothing else escapes. Without exponentiation the
value of a `max_len`-character input stays small enough to compute instantly.

  expr    := term (("+" | "-") term)*
  term    := unary (("*" | "/") unary)*
  unary   := "-" unary | primary
  primary := INTEGER | "(" expr ")"

Whitespace between tokens is ignored; "2 (3)" (implicit product) and "+3" are errors.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

MAX_LEN = 200
MAX_DEPTH = 32


class ExprError(ValueError):
  """The text is not a valid expression (or cannot be evaluated: division by zero)."""


@dataclasses.dataclass(frozen=True)
class Evaluated:
  value: Fraction
  numbers: tuple[int, ...]  # the integer literals in the order written


def _tokenize(text: str) -> list[str]:
  tokens, i, n = [], 0, len(text)
  while i < n:
    ch = text[i]
    if ch in " \t":
      i += 1
    elif ch in "+-*/()":
      tokens.append(ch)
      i += 1
    elif "0" <= ch <= "9":  # ASCII digits only: str.isdigit also accepts e.g. superscripts
      j = i
      while j < n and "0" <= text[j] <= "9":
        j += 1
      tokens.append(text[i:j])
      i = j
    else:
      raise ExprError(f"unexpected character {ch!r} at {i}")
  return tokens


class _Parser:
  def __init__(self, tokens: list[str], max_depth: int):
    self.tokens = tokens
    self.pos = 0
    self.depth = 0
    self.max_depth = max_depth
    self.numbers: list[int] = []

  def peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str:
    tok = self.peek()
    if tok is None:
      raise ExprError("unexpected end of expression")
    self.pos += 1
    return tok

  def enter(self):
    # Parentheses and unary minus both nest; bounding them bounds the recursion.
    self.depth += 1
    if self.depth > self.max_depth:
      raise ExprError(f"nesting deeper than {self.max_depth}")

  def expr(self) -> Fraction:
    value = self.term()
    while self.peek() in ("+", "-"):
      if self.take() == "+":
        value += self.term()
      else:
        value -= self.term()
    return value

  def term(self) -> Fraction:
    value = self.unary()
    while self.peek() in ("*", "/"):
      if self.take() == "*":
        value *= self.unary()
      else:
        divisor = self.unary()
        if divisor == 0:
          raise ExprError("division by zero")
        value /= divisor
    return value

  def unary(self) -> Fraction:
    if self.peek() == "-":
      self.take()
      self.enter()
      value = -self.unary()
      self.depth -= 1
      return value
    return self.primary()

  def primary(self) -> Fraction:
    tok = self.take()
    if tok == "(":
      self.enter()
      value = self.expr()
      if self.take() != ")":
        raise ExprError("expected ')'")
      self.depth -= 1
      return value
    if tok.isdigit():
      self.numbers.append(int(tok))
      return Fraction(int(tok))
    raise ExprError(f"unexpected {tok!r}")


def evaluate(text: str, max_len: int = MAX_LEN, max_depth: int = MAX_DEPTH) -> Evaluated:
  """The exact value of `text` and the integers it uses; ExprError for anything else."""
  if not isinstance(text, str):
    raise ExprError(f"expected str, got {type(text).__name__}")
  if len(text) > max_len:
    raise ExprError(f"longer than {max_len} characters")
  tokens = _tokenize(text)
  if not tokens:
    raise ExprError("empty expression")
  p = _Parser(tokens, max_depth)
  value = p.expr()
  if p.peek() is not None:
    raise ExprError(f"unexpected {p.peek()!r} after a complete expression")
  return Evaluated(value, tuple(p.numbers))
