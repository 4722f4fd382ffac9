"""The config reference: every key of the schema with its default, allowed values and meaning.

Nothing here is a table of its own. A key's meaning is the comment where `jaxrl/recipes/default.py`
defines it: the comment at the end of its line, else the comment lines directly above it (read
with `tokenize` and `ast`); its default is what `get_config()` returns; its allowed values are
the requirements of its rules in `jaxrl.config.schema.RULES`. `python -m jaxrl.train --help`
prints it as text, and `docs/config.md` is its Markdown form:

    python -m jaxrl.config.reference --markdown > docs/config.md

No jax is imported here.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import sys
import textwrap
import tokenize
from typing import Any

from jaxrl.config.schema import PREFIX, RULES, flatten, is_section
from jaxrl.recipes import default as default_config

SOURCE = default_config.__file__


@dataclasses.dataclass(frozen=True)
class Entry:
  """One key of the schema (or a section, `section=True`) as the reference shows it."""

  key: str
  default: Any
  help: str
  allowed: str
  section: bool = False


def _target(node: ast.AST) -> str | None:
  """`c.a.b` -> "a.b" (the dotted key an assignment to the config sets), else None."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name) and node.id == "c" and parts:
    return ".".join(reversed(parts))
  return None


def _comments(source: str) -> dict[int, str]:
  """Line number -> the text of the comment on it (without '#')."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = tok.string[1:].strip()
  return out


def help_texts(source: str | None = None) -> dict[str, str]:
  """Dotted key (or section) -> its help, in the order `source` sets them: the comment at the end
  of the line that sets it, else the run of comment-only lines directly above it, joined into one
  line ("" when none)."""
  if source is None:
    with open(SOURCE, encoding="utf-8") as f:
      source = f.read()
  comments = _comments(source)
  lines = source.splitlines()
  out: dict[str, tuple[int, str]] = {}
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
      continue
    key = _target(node.targets[0])
    if key is None:
      continue
    trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    above = []
    n = node.lineno - 1
    while n >= 1 and lines[n - 1].strip().startswith("#"):
      above.append(comments.get(n, lines[n - 1].strip()[1:].strip()))
      n -= 1
    text = " ".join(trailing) if trailing else " ".join(reversed(above))
    out[key] = (node.lineno, " ".join(text.split()))
  return {k: h for k, (_, h) in sorted(out.items(), key=lambda kv: kv[1][0])}


def allowed(key: str, value: Any) -> str:
  """What `key` may hold: its rules' requirements joined by "; ", else by its type."""
  reqs = [req for k, (_, req) in RULES if k == key]
  if key == "task.name":
    reqs.append("a registered task name, or several joined by '+'")
  if reqs:
    return "; ".join(dict.fromkeys(reqs))
  if isinstance(value, bool):
    return "true or false"
  if isinstance(value, int):
    return "an integer"
  if isinstance(value, float):
    return "a number"
  return "a string"


def entries() -> list[Entry]:
  """Every section and key of `default.py`, in the order the file sets them."""
  helps = help_texts()
  flat = flatten(default_config.get_config())
  order = {k: i for i, k in enumerate(helps)}
  out = []
  for key, value in sorted(flat.items(), key=lambda kv: order.get(kv[0], len(order))):
    section = is_section(value)
    out.append(Entry(key, None if section else value, helps.get(key, ""),
                     "" if section else allowed(key, value), section))
  return out


def show(value: Any) -> str:
  """A default as it is written on the command line: true/false, numbers as Python writes them,
  strings in double quotes ("" for the empty one)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, str):
    return json.dumps(value)
  return repr(value)


def text(width: int = 100) -> str:
  """The reference as `--help` prints it: `--config.KEY=DEFAULT`, then its allowed values and
  meaning, indented; a section's meaning above its keys."""
  out = []
  wrap = lambda s, indent: textwrap.fill(s, width, initial_indent=indent,
                                         subsequent_indent=indent)
  for e in entries():
    if e.section:
      out.append("")
      out.append(f"[{e.key}]" + (f"  {e.help}" if e.help else ""))
      continue
    out.append(f"  --{PREFIX}{e.key}={show(e.default)}")
    out.append(wrap(f"{e.help} (allowed: {e.allowed})", "      "))
  return "\n".join(out)


def _cell(s: str) -> str:
  """Table-cell text: pipes, angle brackets and stars shown as themselves."""
  return s.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*").replace("\n", " ")


def markdown() -> str:
  """`docs/config.md`: one table per section."""
  out = ["# Config reference", "",
         "<!-- Generated by `python -m jaxrl.config.reference --markdown > docs/config.md` from",
         "     jaxrl/recipes/default.py (comments, defaults) and jaxrl/config/schema.py (RULES).",
         "     Do not edit by hand: tests/test_config_reference.py fails when it is stale. -->", "",
         "Every key of a run config, with its default, what it may hold and what it means. Set a",
         "key with `--config.KEY=VALUE` on `python -m jaxrl.train` (or `jaxrl-train`), or in a",
         "recipe file (`--config my_recipe.py`) that starts from",
         "`jaxrl.recipes.default.get_config()`. `python -m jaxrl.train --help` prints the same",
         "list; `python -m jaxrl.train --print_config [--config ...] [--config.KEY=VALUE ...]`",
         "prints the resolved config and its plan (meshes, micro-batches, memory) without",
         "running anything.", ""]
  header = ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
  every = entries()
  top = [e for e in every if "." not in e.key and not e.section]
  if top:
    out += ["## Top level", "", *header]
    out += [f"| `{e.key}` | `{_cell(show(e.default))}` | {_cell(e.allowed)} | {_cell(e.help)} |"
            for e in top]
    out.append("")
  for e in every:
    if e.section:
      out += [f"## `{e.key}`", ""]
      if e.help:
        out += [e.help, ""]
      rows = [x for x in every if not x.section and x.key.rpartition(".")[0] == e.key]
      if rows:
        out += header
        out += [f"| `{x.key}` | `{_cell(show(x.default))}` | {_cell(x.allowed)} | "
                f"{_cell(x.help)} |" for x in rows]
        out.append("")
  return "\n".join(out)


def main(argv: list[str]) -> int:
  if argv[1:] == ["--markdown"]:
    print(markdown())
  elif argv[1:] == []:
    print(text())
  else:
    print("jaxrl: usage: python -m jaxrl.config.reference [--markdown]", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
