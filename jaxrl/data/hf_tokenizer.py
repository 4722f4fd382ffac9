"""Hugging Face tokenizers and chat templates, with `tokenizers` + `jinja2` only (the `hf` extra).

`HFTokenizer.from_dir(path)` reads a Hugging Face model directory and implements jaxrl's
`Tokenizer` protocol (`pad_id`, `eos_id`, `eos_ids`, `vocab_size`, `encode`, `decode`) plus the
chat-template side a trainer needs: `render_chat`, `encode_chat`, `encode_prompt` (what a task row
becomes) and `encode_observation` (what an environment reply appends in a multi-turn rollout).
The directory's files are read by `jaxrl.data.hf_files`; templates render in the sandbox of
`jaxrl.data.chat_template`. Both errors, and the file names, are importable from here.

transformers is not imported at run time; its behaviour is the reference, pinned by parity tests
(`tests/test_hf_tokenizer.py`, `parity` marker). What we mirror, and why each piece matters:

- Files. `tokenizer.json` is the whole tokenizer (normalizer, pre-tokenizer, model, added tokens,
  post-processor). `tokenizer_config.json` names the special tokens (strings or AddedToken dicts
  `{"content": ...}`) and may hold `chat_template` (a string, or a list of `{"name", "template"}`
  entries). A separate `chat_template.jinja` (what newer transformers saves) takes priority over
  the config's template, and `additional_chat_templates/<name>.jinja` adds named ones, exactly as
  `from_pretrained` does. `special_tokens_map.json` is legacy: like transformers we apply it (over
  the config's values) only when the config has no `added_tokens_decoder`, i.e. was written before
  that field existed. `generation_config.json` (else `config.json`, which is what transformers'
  `generate` falls back to) gives the ids that end a generation.
- `encode(text)` is `tokenizer(text)["input_ids"]`: the post-processor runs, so Llama 3 prepends
  `<|begin_of_text|>`; truncation and padding stored in tokenizer.json are switched off, as
  transformers does for a plain call.
- `render_chat` is `apply_chat_template(..., tokenize=False)`: same sandboxed jinja environment
  (trim_blocks, lstrip_blocks, loopcontrols, the `{% generation %}` tag, `tojson` without HTML
  escaping, `raise_exception`, `strftime_now`, the restricted `dict` and `namespace`), same
  variables (`messages`, `add_generation_prompt`, `tools`, `documents`, every named special token
  that is set, then caller kwargs), and the same message clean-up (None-valued keys dropped,
  reasoning aliased to `reasoning_content` / `thinking`). An unset special token is absent, not
  None, so `{{ bos_token }}` renders as "" rather than "None".
- `encode_chat` is `apply_chat_template(..., tokenize=True)`: the rendered text encoded with
  `add_special_tokens=False`, because templates write BOS themselves.
- `decode` is `decode(ids, skip_special_tokens=True)` after cutting at the first EOS and dropping
  padding (the `Tokenizer` contract). `clean_up_tokenization_spaces` is honoured only for non-BPE
  models, as transformers 5 does (for byte-level BPE it would corrupt text).

Special ids (chosen here, documented because transformers spreads them over three objects):

- `eos_ids`: the tokenizer's `eos_token` first, then generation_config's `eos_token_id` (int or
  list) in its order, deduplicated. `eos_id = eos_ids[0]` is therefore the token the chat template
  writes to close an assistant turn (`<|im_end|>` for Qwen2.5-Instruct, `<|eot_id|>` for Llama 3.1
  Instruct), which is what an SFT target should end with; the other ids (e.g. `<|endoftext|>`,
  `<|end_of_text|>`) also end a generation, as they do in `model.generate`. With no tokenizer EOS,
  generation_config's first id leads.
- `pad_id`: the tokenizer's `pad_token`, else generation_config's `pad_token_id`, else `eos_id`
  (Llama 3 has no pad token). Padding never reaches the loss (rows carry validity masks), so
  sharing an id with EOS is harmless.
- `bos_id`: the tokenizer's `bos_token` (transformers' `tokenizer.bos_token_id`), else None.
  Informational: BOS is added by the post-processor or the template, never by jaxrl.
  generation_config's `bos_token_id` is ignored: Qwen lists `<|endoftext|>` there, a token its
  prompts never start with.
- `vocab_size`: number of ids the tokenizer can produce, added tokens included (max id + 1 if the
  added ids leave gaps). A model's embedding may be larger (Qwen pads to a multiple of 128);
  the trainer checks model vocab >= tokenizer vocab.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jinja2
import tokenizers

from jaxrl.data.chat_template import (ChatTemplateError, RaisedByTemplate, clean_messages, plain,
                                      sandbox_environment)
from jaxrl.data.hf_files import (  # noqa: F401 (NAMED_SPECIAL_TOKENS re-exported)
    CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE,
    NAMED_SPECIAL_TOKENS, SPECIAL_TOKENS_MAP_FILE, TOKENIZER_FILE, HFTokenizerError, id_list,
    read_chat_templates, read_json, read_special_tokens)

# Content of the stand-in assistant turn `encode_observation` renders: it must survive templates
# untouched (no whitespace at the ends, no think tags) and never occur in real text.
_SENTINEL_USER = "jaxrl-user-turn-5a1f"
_SENTINEL_ASSISTANT = "jaxrl-assistant-turn-9c3e"


class HFTokenizer:
  """A Hugging Face tokenizer with its chat template; see the module docstring for the rules.

  Options (also accepted by `from_dir`):
    use_chat_template: whether `encode_prompt` / `encode_observation` go through the chat template.
      Default: True when the directory has one. True without a template is an error.
    system_prompt: a system message put before every prompt (and in `encode_observation`'s
      renderings). None: whatever the template does without one (Qwen2.5 adds its default).
    chat_template_kwargs: extra template variables for `encode_prompt` / `encode_observation`,
      e.g. `{"enable_thinking": False}` for Qwen3.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str],
               chat_templates: Mapping[str, str] | None = None,
               generation_config: Mapping[str, Any] | None = None,
               clean_up_tokenization_spaces: bool = False, source: str = "<in memory>",
               special_token_sources: Mapping[str, str] | None = None,
               chat_template_sources: Mapping[str, str] | None = None,
               generation_config_source: str = "generation config",
               use_chat_template: bool | None = None, system_prompt: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None):
    # The `tokenizers.Tokenizer` underneath (as transformers' `backend_tokenizer`): raw
    # encode/decode without this class's EOS, padding and chat handling.
    self.backend_tokenizer = tokenizer
    self._tok = tokenizer
    # A plain `tokenizer(text)` in transformers neither truncates nor pads; tokenizer.json may
    # carry settings for both (they are applied by the Rust side on every encode otherwise).
    self._tok.no_truncation()
    self._tok.no_padding()
    self.source = source
    self.special_tokens = dict(special_tokens)
    self.chat_templates = dict(chat_templates or {})
    self._template_sources = dict(chat_template_sources or {})
    self._clean_up = bool(clean_up_tokenization_spaces) and type(tokenizer.model).__name__ != "BPE"
    token_where = dict(special_token_sources or {})
    gen = dict(generation_config or {})

    def token_id(name: str) -> int | None:
      s = self.special_tokens.get(name)
      if s is None:
        return None
      i = self._tok.token_to_id(s)
      if i is None:
        raise HFTokenizerError(f"{token_where.get(name, source)}: {name} {s!r} is not in the "
                               f"vocabulary of {source}")
      return i

    added = self._tok.get_added_tokens_decoder()
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                          max(added, default=-1) + 1)
    gen_eos = id_list(gen.get("eos_token_id"), "eos_token_id", generation_config_source)
    for i in gen_eos:
      if i >= self.vocab_size:
        raise HFTokenizerError(f"{generation_config_source}: eos_token_id {i} is outside the "
                               f"tokenizer's {self.vocab_size} ids ({source})")
    eos_ids = [i for i in [token_id("eos_token")] + gen_eos if i is not None]
    self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
    if not self.eos_ids:
      raise HFTokenizerError(f"{source}: no EOS token: set eos_token in {CONFIG_FILE} or "
                             f"eos_token_id in {GENERATION_CONFIG_FILE}")
    self.eos_id: int = self.eos_ids[0]
    pad = token_id("pad_token")
    if pad is None:
      pad = (id_list(gen.get("pad_token_id"), "pad_token_id", generation_config_source)
             or [self.eos_id])[0]
    self.pad_id: int = pad
    self.bos_id: int | None = token_id("bos_token")
    self._eos_strings = sorted({self._tok.id_to_token(i) for i in self.eos_ids}, key=len,
                               reverse=True)

    self._env = sandbox_environment() if self.chat_templates else None
    self._compiled: dict[str, jinja2.Template] = {}  # by template source, so edits recompile
    if use_chat_template is None:
      use_chat_template = bool(self.chat_templates)
    if use_chat_template and not self.chat_templates:
      raise ChatTemplateError(f"{source} has no chat template (looked for {CHAT_TEMPLATE_FILE}, "
                              f"{CHAT_TEMPLATE_DIR}/ and 'chat_template' in {CONFIG_FILE}); "
                              f"set tokenizer.chat_template=false to encode prompts as plain "
                              f"text")
    if system_prompt is not None and not use_chat_template:
      raise ChatTemplateError(f"{source}: tokenizer.system_prompt needs a chat template "
                              f"(tokenizer.chat_template is false)")
    self.use_chat_template = bool(use_chat_template)
    self.system_prompt = system_prompt
    self.chat_template_kwargs = dict(chat_template_kwargs or {})

  @classmethod
  def from_dir(cls, path: str | os.PathLike, **options) -> HFTokenizer:
    """Loads `tokenizer.json` and its companions from a model directory (see module docstring)."""
    path = os.fspath(path)
    tok_file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tok_file):
      raise HFTokenizerError(f"{tok_file} not found: jaxrl reads Hugging Face fast tokenizers "
                             f"(tokenizer.json); save one with transformers' "
                             f"tokenizer.save_pretrained")
    try:
      tok = tokenizers.Tokenizer.from_file(tok_file)
    except Exception as e:  # the Rust side raises plain Exception subclasses
      raise HFTokenizerError(f"{tok_file}: cannot load: {e}") from e
    config_path = os.path.join(path, CONFIG_FILE)
    config = read_json(config_path) or {}
    map_path = os.path.join(path, SPECIAL_TOKENS_MAP_FILE)
    special, special_where = read_special_tokens(config, config_path, read_json(map_path), map_path)
    templates, template_where = read_chat_templates(path, config, config_path)
    gen_path = os.path.join(path, GENERATION_CONFIG_FILE)
    gen = read_json(gen_path)
    if gen is None:
      gen_path = os.path.join(path, MODEL_CONFIG_FILE)
      model_config = read_json(gen_path) or {}
      gen = {k: model_config[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id")
             if k in model_config}
    return cls(tok, special_tokens=special, chat_templates=templates, generation_config=gen,
               clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", False),
               source=path, special_token_sources=special_where,
               chat_template_sources=template_where, generation_config_source=gen_path, **options)

  def __repr__(self) -> str:
    return (f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, "
            f"pad_id={self.pad_id}, use_chat_template={self.use_chat_template})")

  # -- plain text ------------------------------------------------------------------------------

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer(text)["input_ids"]`: the post-processor adds BOS/EOS if the tokenizer says so."""
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of the ids, stopping at the first id in `eos_ids`; padding is dropped.

    The pad id may itself be an EOS (Qwen: `<|endoftext|>`; Llama 3: pad = eos_id), so pad ids
    before the first kept token are left padding and skipped; after it, an EOS stops decoding
    even if it is also the pad id. Ids the tokenizer does not know (a model's embedding may be
    larger than its vocabulary) are skipped by `tokenizers`.
    """
    eos, keep = set(self.eos_ids), []
    for i in ids:
      i = int(i)
      if i == self.pad_id and not keep:
        continue
      if i in eos:
        break
      if i != self.pad_id:
        keep.append(i)
    text = self._tok.decode(keep, skip_special_tokens=skip_special_tokens)
    return _clean_up_tokenization(text) if self._clean_up else text

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  # -- chat templates --------------------------------------------------------------------------

  @property
  def chat_template(self) -> str | None:
    """The default template (what `render_chat` uses without tools), or None."""
    return self.chat_templates.get("default", next(iter(self.chat_templates.values()), None))

  def _template(self, name: str | None, tools) -> tuple[jinja2.Template, str]:
    """transformers' `get_chat_template`: a named template, else "tool_use" when tools are given
    and it exists, else "default"; a single unnamed template is "default"."""
    if not self.chat_templates:
      raise ChatTemplateError(f"{self.source} has no chat template (looked for "
                              f"{CHAT_TEMPLATE_FILE}, {CHAT_TEMPLATE_DIR}/ and 'chat_template' in "
                              f"{CONFIG_FILE})")
    if name is None:
      if tools is not None and "tool_use" in self.chat_templates:
        name = "tool_use"
      elif "default" in self.chat_templates:
        name = "default"
      else:
        raise ChatTemplateError(f"{self.source}: several chat templates and none named 'default' "
                                f"(have {sorted(self.chat_templates)}); pass chat_template=<name>")
    if name not in self.chat_templates:
      raise ChatTemplateError(f"{self.source}: no chat template named {name!r} "
                              f"(have {sorted(self.chat_templates)})")
    where = self._template_sources.get(name, f"{self.source} chat template {name!r}")
    source = self.chat_templates[name]
    if source not in self._compiled:
      try:
        self._compiled[source] = self._env.from_string(source)
      except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template {where} does not parse: line {e.lineno}: "
                                f"{e.message}") from e
    return self._compiled[source], where

  def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                  *, tools: Sequence[Mapping] | None = None,
                  documents: Sequence[Mapping] | None = None, chat_template: str | None = None,
                  **kwargs) -> str:
    """`apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.

    kwargs become template variables (e.g. `enable_thinking=False`) and override the special-token
    strings of the same name. Tools must already be JSON schemas (transformers also accepts Python
    functions; we do not introspect code). Errors, including the template's own
    `raise_exception(...)`, are ChatTemplateError naming the template.
    """
    if not messages:
      raise ChatTemplateError("cannot render an empty conversation: give at least one message")
    if tools is not None:
      for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
          raise TypeError(f"tools[{i}] is a {type(t).__name__}; give tools as JSON-schema dicts")
    if documents is not None:
      for i, d in enumerate(documents):
        if not isinstance(d, Mapping):
          raise TypeError(f"documents[{i}] is a {type(d).__name__}; give documents as dicts")
    template, where = self._template(chat_template, tools)
    variables = {**self.special_tokens, **plain(kwargs)}
    try:
      return template.render(messages=clean_messages(messages), tools=plain(tools),
                             documents=plain(documents),
                             add_generation_prompt=bool(add_generation_prompt), **variables)
    except RaisedByTemplate as e:
      raise ChatTemplateError(f"chat template {where} raised an exception: {e.message}") from e
    except Exception as e:  # undefined attributes, sandbox refusals, type errors in the template
      raise ChatTemplateError(f"chat template {where} failed to render: "
                              f"{type(e).__name__}: {e}") from e

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                  **kwargs) -> list[int]:
    """`apply_chat_template(..., tokenize=True)["input_ids"]`: the template writes its own BOS, so
    the rendered text is encoded with add_special_tokens=False (no second BOS)."""
    return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs),
                       add_special_tokens=False)

  def _system(self) -> list[dict]:
    return [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]

  def encode_prompt(self, text: str) -> list[int]:
    """The prompt a task row becomes: with the chat template, one user turn (after the optional
    system prompt) and the opened assistant turn; without it, `encode(text)` (post-processor BOS
    included)."""
    if not self.use_chat_template:
      return self.encode(text)
    messages = self._system() + [{"role": "user", "content": text}]
    return self.encode_chat(messages, True, **self.chat_template_kwargs)

  def encode_observation(self, text: str, role: str = "user") -> list[int]:
    """Tokens appended after an assistant turn that ended with an EOS token: the environment's
    reply as a new `role` turn, then the opened next assistant turn.

    Rule (token-level delta of one rendering): render [system?, user U, assistant A, role: text]
    with add_generation_prompt=True, where A is a sentinel. Right after A the template must close
    the turn with an EOS token (one of `eos_ids`); the sampler already emitted that token, so the
    observation is everything the rendering's tokens hold after it. E.g. Qwen2.5 gives
    "\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n", Llama 3 gives
    "<|start_header_id|>user<|end_header_id|>\\n\\n{text}<|eot_id|><|start_header_id|>assistant..."

    With templates that render earlier assistant turns as they were generated (Qwen2.5, Llama 3),
    prompt + completion + EOS + observation + ... is exactly the token sequence of the whole
    conversation rendered by the template (the tests check this). Templates that rewrite history
    (Qwen3 drops the think block of earlier turns) still get the right observation tokens; the
    rollout then differs from a re-rendering of the conversation, as it does in any RL framework
    that trains on the sampled tokens. Note that the rendering does not take the prefix
    [U, A] rendered on its own, which for such templates is not a prefix of the longer one.

    Without a chat template: `encode(text, add_special_tokens=False)`.
    """
    if not self.use_chat_template:
      return self.encode(text, add_special_tokens=False)
    messages = self._system() + [{"role": "user", "content": _SENTINEL_USER},
                                 {"role": "assistant", "content": _SENTINEL_ASSISTANT},
                                 {"role": role, "content": text}]
    full = self.render_chat(messages, True, **self.chat_template_kwargs)
    _, where = self._template(None, None)
    if full.count(_SENTINEL_ASSISTANT) != 1:
      raise ChatTemplateError(f"chat template {where}: an assistant turn's content does not appear "
                              f"verbatim, once, in the rendering, so the tokens after it cannot "
                              f"be found")
    after = full.index(_SENTINEL_ASSISTANT) + len(_SENTINEL_ASSISTANT)
    eos = next((s for s in self._eos_strings if full.startswith(s, after)), None)
    if eos is None:
      raise ChatTemplateError(
        f"chat template {where}: assistant turns are followed by {full[after:after + 30]!r}, "
        f"not by an EOS token ({self._eos_strings}); a sampled turn ends at EOS, so an observation "
        f"cannot be appended after it")
    head = self.encode(full[:after + len(eos)], add_special_tokens=False)
    ids = self.encode(full, add_special_tokens=False)
    if ids[:len(head)] != head or not head or head[-1] not in self.eos_ids:
      raise ChatTemplateError(f"chat template {where}: the text after an assistant turn's EOS "
                              f"changes how the turn itself tokenizes")
    return ids[len(head):]


def _clean_up_tokenization(text: str) -> str:
  """transformers' `clean_up_tokenization` (WordPiece-era space fixes)."""
  for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
               (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
    text = text.replace(a, b)
  return text
