"""OpenAI chat requests to prompt tokens through the model's own chat template, and generated text
back to `content` plus `tool_calls`.

Tools are rendered by the template (its `tools` variable, as transformers' `apply_chat_template`
passes them), so a model sees exactly the tool prompt it was trained with. Which tool-call
format a reply is parsed with follows from the template:

- `qwen` (Qwen2.5, Qwen3 and other Hermes-style templates: the template writes `<tool_call>`):
  each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `content` is the text
  before the first call.
- `llama3` (templates with `<|start_header_id|>`): the whole reply (after an optional
  `<|python_tag|>`) is one JSON object `{"name": ..., "parameters": {...}}`, or several joined by
  `;`, as Llama 3.1's JSON tool calling writes them.
- `none`: no tool calls are parsed.

A reply whose call does not parse (bad JSON, no name) is left as plain `content`: the tokens are
what the model wrote, and an agent sees that it wrote no valid call.

Assistant messages that carry `tool_calls` (from an earlier turn) have their JSON-string
`arguments` turned back into objects before rendering, since templates write them with `tojson`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Sequence

from jaxrl.core.errors import UserError

FORMATS = ("qwen", "llama3", "none")
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


class RequestError(UserError):
  """A request the client must change: `status` is its HTTP status, `param` the field at fault,
  `code` OpenAI's error code (e.g. `model_not_found`, `context_length_exceeded`)."""

  def __init__(self, message: str, *, status: int = 400, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code


def tool_format(template: str | None) -> str:
  """The tool-call format a chat template's replies use (see the module docstring)."""
  if not template:
    return "none"
  if "<tool_call>" in template:
    return "qwen"
  if "<|start_header_id|>" in template:
    return "llama3"
  return "none"


def check_tools(tools: Any) -> list[dict] | None:
  """`tools` of a request as a list of OpenAI function tools; RequestError naming the entry."""
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise RequestError(f"tools must be a list of tool objects, got {type(tools).__name__}",
                       param="tools")
  for i, t in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(t, Mapping) or t.get("type") != "function":
      raise RequestError(f"{where} must be an object with type 'function'", param=where)
    fn = t.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise RequestError(f"{where}.function must be an object with a non-empty string 'name'",
                         param=f"{where}.function")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fn["name"]):
      raise RequestError(f"{where}.function.name {fn['name']!r} must be 1-64 letters, digits, "
                         f"'_' or '-'", param=f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, Mapping) or
                               params.get("type", "object") != "object"):
      raise RequestError(f"{where}.function.parameters must be a JSON schema object "
                         f"(type 'object')", param=f"{where}.function.parameters")
  return list(tools)


def template_messages(messages: Any) -> list[dict]:
  """A request's `messages`, checked, as the template reads them (see the module docstring)."""
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list", param="messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
      raise RequestError(f"messages[{i}] must be an object with a string 'role'",
                         param=f"messages[{i}]")
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is served
      texts = []
      for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
          raise RequestError(f"messages[{i}].content[{j}]: only text parts are supported",
                             param=f"messages[{i}].content")
        texts.append(str(part.get("text", "")))
      m["content"] = "".join(texts)
    elif content is not None and not isinstance(content, str):
      raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                         param=f"messages[{i}].content")
    if m.get("tool_calls"):
      m["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
      m.setdefault("content", "")
    out.append(m)
  return out


def _call_for_template(call: Any) -> Any:
  if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
    return call
  fn = dict(call["function"])
  if isinstance(fn.get("arguments"), str):
    try:
      fn["arguments"] = json.loads(fn["arguments"])
    except ValueError:
      pass  # kept as written: the template shows what the model produced
  return {**call, "function": fn}


def _call(name: Any, arguments: Any) -> dict | None:
  if not isinstance(name, str) or not name or not isinstance(arguments, (Mapping, type(None))):
    return None
  return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments or {})}}


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
  """-> (content, tool_calls) of a reply in format `fmt`; ([text], []) when none parse."""
  if fmt == "qwen":
    found = _QWEN_CALL.findall(text)
    calls = []
    for body in found:
      try:
        obj = json.loads(body)
      except ValueError:
        return text, []
      call = _call(obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else None
      if call is None:
        return text, []
      calls.append(call)
    if not calls:
      return text, []
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls
  if fmt == "llama3":
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
      body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
      return text, []
    calls = []
    for piece in body.split(";"):
      try:
        obj = json.loads(piece)
      except ValueError:
        return text, []
      args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
      call = _call(obj.get("name"), args) if isinstance(obj, dict) else None
      if call is None:
        return text, []
      calls.append(call)
    return None, calls
  return text, []


def render_prompt(tokenizer, messages: Sequence[Mapping], tools: list[dict] | None,
                  **template_kwargs) -> list[int]:
  """Prompt tokens of a chat request: the template with the assistant turn opened, encoded
  without extra special tokens (the template writes its own)."""
  if tools and "tools" not in (getattr(tokenizer, "chat_template", None) or ""):
    raise RequestError("this model's chat template does not render tools", param="tools")
  return tokenizer.encode_chat(messages, True, tools=tools, **template_kwargs)
