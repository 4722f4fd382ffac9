"""The sandboxed jinja environment chat templates render in, mirroring transformers'.

Chat templates come from model repositories, i.e. are untrusted code: `sandbox_environment` is
transformers' `_compile_jinja_template` (immutable sandbox, trim_blocks, lstrip_blocks,
loopcontrols, the `{% generation %}` tag, `tojson` without HTML escaping, `raise_exception`,
`strftime_now`, a restricted `dict` and `namespace`), and `plain` / `clean_messages` rebuild what
a template is given from plain types. `jaxrl.data.hf_tokenizer.HFTokenizer` renders with these.
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

from jaxrl.data.hf_files import HFTokenizerError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(HFTokenizerError):
  """A chat template that is missing, does not parse, raises, or cannot do what was asked."""


class RaisedByTemplate(jinja2.exceptions.TemplateError):
  """`raise_exception(message)` called by the template itself (told apart from our own bugs)."""


def _raise_exception(message):
  raise RaisedByTemplate(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON that
  # transformers writes (and exposes these json.dumps options).
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.now().strftime(fmt)


class _TemplateDict:
  """`dict(...)` inside templates, without exposing the dict type itself to the sandbox."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
  """`namespace(...)` that refuses underscore names, so templates cannot reach CPython internals."""

  def __init__(*args, **kwargs):  # noqa: N805  (same signature trick as jinja's Namespace)
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
        f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: marks assistant text for transformers' assistant
  masks. We render the body unchanged; without the tag such templates would not even parse."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def sandbox_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  major, minor, patch = (int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
  if (major, minor, patch) < (3, 1, 6):
    # Chat templates come from model repositories, i.e. are untrusted code; older jinja2 has known
    # sandbox escapes (transformers refuses them too).
    raise ChatTemplateError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); installed "
                            f"{jinja2.__version__}")
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _TemplateNamespace
  return env


def plain(value: Any) -> Any:
  """Template inputs rebuilt from plain JSON-like types, as transformers does before rendering:
  arbitrary objects have methods the sandbox does not know to be dangerous."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {plain(k): plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(plain(v) for v in value)
  if isinstance(value, np.generic):
    return plain(value.item())
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  return f"<{type(value).__name__}>"


def clean_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
  """None-valued keys dropped (OpenAI-style `content=None` breaks templates that test `in`), and
  reasoning copied to both `reasoning_content` and `thinking`, the names templates read."""
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise TypeError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
    m = plain({k: v for k, v in m.items() if v is not None})
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out
