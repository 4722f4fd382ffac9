"""Hugging Face tokenizers and chat templates (jaxrl.data.hf_tokenizer), built offline.

Three tiny byte-level BPE tokenizers are trained in the test on a small corpus and saved as model
directories laid out like the real ones: Qwen2.5 (ChatML, default system message, tools branch),
Llama 3 (BOS from the post-processor, header tokens, `<|eot_id|>`) and Qwen3 (think blocks,
`enable_thinking`, template in `chat_template.jinja`). The templates are the real ones.

Tests marked `parity` compare against transformers (the `parity` extra) and skip without it; the
rest need only `tokenizers` and `jinja2`.
"""

from __future__ import annotations

import json
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

# tests/ is on sys.path (rootdir-less test modules)
from hf_fixtures import CORPUS, QWEN3_TEMPLATE, TEXTS, llama_files, qwen_files  # noqa: E402
from jaxrl.data import CharTokenizer  # noqa: E402
from jaxrl.data.hf_tokenizer import (ChatTemplateError, HFTokenizer,  # noqa: E402
                                     HFTokenizerError)

parity = pytest.mark.parity


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_tokenizers")
  return {"qwen25": qwen_files(root / "qwen25"),
          "llama3": llama_files(root / "llama3"),
          "qwen3": qwen_files(root / "qwen3", QWEN3_TEMPLATE, in_jinja_file=True,
                               extra_tokens=("<think>", "</think>"))}


def _raw(tok, ids):
  """All the text of `ids`, special tokens included (decode() stops at the first EOS)."""
  return tok.backend_tokenizer.decode(ids, skip_special_tokens=False)


CONVERSATIONS = {
  "single": [{"role": "user", "content": "What is 12 + 30?"}],
  "system": [{"role": "system", "content": "Answer tersely."},
             {"role": "user", "content": "Héllo 你好 🙂"}],
  "multi": [{"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": "The answer is 42."},
            {"role": "user", "content": "  And 3 + 4?\n"},
            {"role": "assistant", "content": "7"}],
  "multi_system": [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello, world!"},
                   {"role": "user", "content": "Observation: wrong, try again."}],
}


# --------------------------------------------------------------------------------------------
# Special ids, encode, decode


def test_special_ids(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  im_end, eot = q.token_to_id("<|im_end|>"), q.token_to_id("<|endoftext|>")
  assert q.eos_ids == (im_end, eot) and q.eos_id == im_end
  # No bos_token: generation_config's bos_token_id (<|endoftext|> in Qwen's) is not a BOS.
  assert q.pad_id == eot and q.bos_id is None
  assert q.vocab_size == 403 and q.special_tokens == {"eos_token": "<|im_end|>",
                                                      "pad_token": "<|endoftext|>"}

  ll = HFTokenizer.from_dir(dirs["llama3"])
  eot_id, end_text, bot = (ll.token_to_id(s) for s in
                           ("<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>"))
  # The tokenizer's EOS leads; generation_config's ids follow in their order, deduplicated.
  assert ll.eos_ids == (eot_id, end_text) and ll.eos_id == eot_id
  assert ll.pad_id == eot_id  # no pad token anywhere -> eos_id
  assert ll.bos_id == bot


def test_pad_and_eos_fallbacks(tmp_path, dirs):
  path = llama_files(tmp_path / "nogen", generation_config=False)
  tok = HFTokenizer.from_dir(path)
  assert tok.eos_ids == (tok.token_to_id("<|eot_id|>"),) and tok.pad_id == tok.eos_id
  # No generation_config.json: config.json's ids are used, as generate() does.
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"eos_token_id": tok.token_to_id("<|end_of_text|>"), "pad_token_id": 7}, f)
  tok = HFTokenizer.from_dir(path)
  assert tok.eos_ids == (tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>"))
  assert tok.pad_id == 7
  # No EOS token in tokenizer_config: generation_config's first id leads.
  with open(os.path.join(path, "tokenizer_config.json")) as f:
    config = json.load(f)
  del config["eos_token"]
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  assert HFTokenizer.from_dir(path).eos_ids == (tok.token_to_id("<|end_of_text|>"),)


def test_added_token_dicts_and_special_tokens_map(tmp_path, dirs):
  path = llama_files(tmp_path / "legacy")
  with open(os.path.join(path, "tokenizer_config.json")) as f:
    config = json.load(f)
  config["bos_token"] = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False}
  del config["added_tokens_decoder"]  # a legacy config: special_tokens_map.json applies
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
    json.dump({"eos_token": {"content": "<|end_of_text|>", "lstrip": False},
               "pad_token": "<|end_header_id|>"}, f)
  tok = HFTokenizer.from_dir(path)
  assert tok.special_tokens["bos_token"] == "<|begin_of_text|>"
  assert tok.eos_id == tok.token_to_id("<|end_of_text|>")
  assert tok.pad_id == tok.token_to_id("<|end_header_id|>")


def test_encode_decode(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  for text in TEXTS:
    expected = text.split("<|im_end|>")[0]  # decode stops at the first EOS
    assert q.decode(q.encode(text)) == expected
  im_start = q.token_to_id("<|im_start|>")
  assert q.encode("a<|im_start|>b")[1] == im_start  # special strings in text are special tokens
  hello = q.encode("Hello", add_special_tokens=False)
  # Stops at the first EOS of any kind; drops padding (here <|endoftext|>, also an EOS: only
  # leading padding is skipped); skips other special tokens.
  assert q.pad_id in q.eos_ids
  assert q.decode([q.pad_id, q.pad_id] + hello + [q.pad_id] + hello) == "Hello"
  assert q.decode([q.pad_id] + hello + [q.eos_ids[0]] + hello) == "Hello"
  assert q.decode([im_start] + hello + [q.eos_id] + hello) == "Hello"
  assert q.decode([im_start] + hello, skip_special_tokens=False) == "<|im_start|>Hello"

  ll = HFTokenizer.from_dir(dirs["llama3"])
  assert ll.encode("Hi")[0] == ll.bos_id  # from the TemplateProcessing post-processor
  assert ll.bos_id not in ll.encode("Hi", add_special_tokens=False)
  assert ll.decode(ll.encode("It's 5 o'clock .")) == "It's 5 o'clock ."  # no clean-up for BPE


def test_char_tokenizer_eos_ids():
  assert CharTokenizer("ab").eos_ids == (CharTokenizer.eos_id,)


# --------------------------------------------------------------------------------------------
# Chat templates


def test_render_chat_qwen25(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  assert q.render_chat(CONVERSATIONS["single"]) == (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
  tools = [{"type": "function", "function": {"name": "add", "description": "Adds <a> & 'b'",
                                             "parameters": {"a": "é"}}}]
  text = q.render_chat(CONVERSATIONS["single"], tools=tools)
  # tojson: ensure_ascii=False and no HTML escaping (jinja's own filter would write \u003c).
  assert json.dumps(tools[0], ensure_ascii=False) in text and "<a> & 'b'" in text


def test_render_chat_llama3_bos_and_missing_tokens(dirs):
  ll = HFTokenizer.from_dir(dirs["llama3"])
  assert ll.render_chat(CONVERSATIONS["single"], add_generation_prompt=False) == (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 12 + 30?<|eot_id|>")
  ids = ll.encode_chat(CONVERSATIONS["single"])
  assert ids.count(ll.bos_id) == 1 and ids[0] == ll.bos_id  # the template's BOS only
  q = HFTokenizer.from_dir(dirs["qwen25"])
  # An unset special token is undefined (renders ""), not None; kwargs override token strings.
  q.chat_templates["default"] = "[{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ x }}]"
  assert q.render_chat(CONVERSATIONS["single"]) == "[|<|im_end|>|None|]"
  assert q.render_chat(CONVERSATIONS["single"], eos_token="E", x=1) == "[|E|None|1]"


def test_template_environment(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  q.chat_templates["default"] = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index0 > 5 %}{% break %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }} "
    "{{ dict(a=1) | tojson }} {{ {'b': [1, 2]} | tojson(indent=1) }} "
    "{% generation %}{{ messages[-1]['content'] }}{% endgeneration %}\n"
    "{{ messages[-1].thinking }}/{{ messages[-1].reasoning_content }}/"
    "{{ 'tool_calls' in messages[-1] }}")
  msgs = [{"role": "user", "content": "q"},
          {"role": "assistant", "content": "a", "reasoning": "r", "tool_calls": None}]
  # trim_blocks eats the newline after {% endgeneration %}, as in transformers.
  assert q.render_chat(msgs) == '2 {"a": 1} {\n "b": [\n  1,\n  2\n ]\n} ar/r/False'
  q.chat_templates["default"] = "{% set ns = namespace() %}{% set ns._x = 1 %}"
  with pytest.raises(ChatTemplateError, match="underscore"):
    q.render_chat(msgs)
  q.chat_templates["default"] = "{{ strftime_now('%Y') }}"
  assert q.render_chat(msgs).isdigit()


def test_raise_exception_names_template(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  q.chat_templates["default"] = ("{% if messages[0]['role'] != 'user' %}"
                                 "{{ raise_exception('Conversation roles must alternate') }}"
                                 "{% endif %}ok")
  assert q.render_chat(CONVERSATIONS["single"]) == "ok"
  with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json.*raised an exception: "
                                              r"Conversation roles must alternate"):
    q.render_chat([{"role": "assistant", "content": "x"}])
  q.chat_templates["default"] = "{% if %}"
  with pytest.raises(ChatTemplateError, match="does not parse"):
    q.render_chat(CONVERSATIONS["single"])


def test_template_sources(tmp_path, dirs):
  # chat_template.jinja wins over tokenizer_config.json (what transformers' from_pretrained does).
  path = qwen_files(tmp_path / "both", template="config {{ messages | length }}")
  with open(os.path.join(path, "chat_template.jinja"), "w") as f:
    f.write("file {{ messages | length }}")
  assert HFTokenizer.from_dir(path).render_chat(CONVERSATIONS["single"]) == "file 1"
  # A list of named templates: "default", or "tool_use" when tools are given.
  path = qwen_files(tmp_path / "named", template=[
    {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"},
    {"name": "rag", "template": "R"}])
  tok = HFTokenizer.from_dir(path)
  assert tok.render_chat(CONVERSATIONS["single"]) == "D"
  assert tok.render_chat(CONVERSATIONS["single"], tools=[{"name": "f"}]) == "T"
  assert tok.render_chat(CONVERSATIONS["single"], chat_template="rag") == "R"
  with pytest.raises(ChatTemplateError, match="no chat template named 'nope'"):
    tok.render_chat(CONVERSATIONS["single"], chat_template="nope")


# --------------------------------------------------------------------------------------------
# Prompts and multi-turn observations


def test_encode_prompt(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  assert q.use_chat_template
  assert q.encode_prompt("What is 12 + 30?") == q.encode_chat(CONVERSATIONS["single"])
  qs = HFTokenizer.from_dir(dirs["qwen25"], system_prompt="Answer tersely.")
  assert _raw(qs, qs.encode_prompt("Héllo 你好 🙂")) == (
    q.render_chat(CONVERSATIONS["system"]))
  plain = HFTokenizer.from_dir(dirs["llama3"], use_chat_template=False)
  assert plain.encode_prompt("Hi") == plain.encode("Hi") and plain.encode("Hi")[0] == plain.bos_id
  assert plain.encode_observation("Hi") == plain.encode("Hi", add_special_tokens=False)
  with pytest.raises(ChatTemplateError, match="system_prompt needs a chat template"):
    HFTokenizer.from_dir(dirs["llama3"], use_chat_template=False, system_prompt="s")


@pytest.mark.parametrize("family", ["qwen25", "llama3"])
@pytest.mark.parametrize("system", [None, "You are a helpful assistant."])
def test_encode_observation_rebuilds_conversation(dirs, family, system):
  """prompt + completion + EOS + observation (+ completion + EOS) is exactly the template's
  rendering of the whole conversation."""
  tok = HFTokenizer.from_dir(dirs[family], system_prompt=system)
  head = [] if system is None else [{"role": "system", "content": system}]
  question, answer1, observation, answer2 = ("What is 12 + 30?", "The answer is 42.",
                                             "Observation: wrong, try again.\n", "It's 42!")
  seq = tok.encode_prompt(question)
  seq += tok.encode(answer1, add_special_tokens=False) + [tok.eos_id]
  seq += tok.encode_observation(observation)
  convo = head + [{"role": "user", "content": question},
                  {"role": "assistant", "content": answer1},
                  {"role": "user", "content": observation}]
  assert seq == tok.encode_chat(convo, add_generation_prompt=True)
  seq += tok.encode(answer2, add_special_tokens=False) + [tok.eos_id]
  full = tok.encode_chat(convo + [{"role": "assistant", "content": answer2}],
                         add_generation_prompt=False)
  # Qwen's template writes "\n" after the final <|im_end|>; the sampler stops at the EOS.
  assert full[:len(seq)] == seq and _raw(tok, full[len(seq):]) in ("", "\n")


def test_encode_observation_text(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  obs = q.encode_observation("wrong")
  assert _raw(q, obs) == "\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n"
  assert obs[0] == q.encode("\n", add_special_tokens=False)[0]  # after the sampled <|im_end|>
  ll = HFTokenizer.from_dir(dirs["llama3"])
  obs = ll.encode_observation("wrong")
  assert obs[0] == ll.token_to_id("<|start_header_id|>")
  assert _raw(ll, obs) == (
    "<|start_header_id|>user<|end_header_id|>\n\nwrong<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_encode_observation_qwen3(dirs):
  """Qwen3 rewrites earlier assistant turns (drops their think block), so [U, A] rendered alone is
  not a prefix of [U, A, obs]; the observation tokens are still what follows the turn's EOS."""
  q3 = HFTokenizer.from_dir(dirs["qwen3"])
  assert q3.chat_template == QWEN3_TEMPLATE  # read from chat_template.jinja
  two = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
  assert not q3.render_chat(two + [{"role": "user", "content": "o"}]).startswith(
    q3.render_chat(two, add_generation_prompt=False))
  assert _raw(q3, q3.encode_observation("o")) == (
    "\n<|im_start|>user\no<|im_end|>\n<|im_start|>assistant\n")
  off = HFTokenizer.from_dir(dirs["qwen3"], chat_template_kwargs={"enable_thinking": False})
  assert _raw(off, off.encode_observation("o")) == (
    "\n<|im_start|>user\no<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert _raw(off, off.encode_prompt("q")).endswith(
    "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  think = q3.token_to_id("<think>")
  assert think in off.encode_prompt("q")  # added (non-special) tokens are matched in text


def test_encode_observation_needs_eos_after_assistant(dirs):
  q = HFTokenizer.from_dir(dirs["qwen25"])
  q.chat_templates["default"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                 "\n<|im_end|>{% endfor %}")
  with pytest.raises(ChatTemplateError, match=r"followed by '\\n<\|im_end\|>.*not by an EOS"):
    q.encode_observation("o")


# --------------------------------------------------------------------------------------------
# Broken directories


def test_missing_files_and_fields(tmp_path, dirs):
  with pytest.raises(HFTokenizerError, match=str(tmp_path / "empty" / "tokenizer.json")):
    os.makedirs(tmp_path / "empty")
    HFTokenizer.from_dir(tmp_path / "empty")

  path = llama_files(tmp_path / "badeos")
  cfg_path = os.path.join(path, "tokenizer_config.json")
  with open(cfg_path) as f:
    config = json.load(f)
  with open(cfg_path, "w") as f:
    json.dump({**config, "eos_token": "</s>"}, f)
  with pytest.raises(HFTokenizerError, match=rf"{cfg_path}: eos_token '</s>' is not in the voc"):
    HFTokenizer.from_dir(path)

  with open(cfg_path, "w") as f:
    json.dump({k: v for k, v in config.items() if k != "chat_template"}, f)
  assert not HFTokenizer.from_dir(path).use_chat_template
  with pytest.raises(ChatTemplateError, match=rf"{path} has no chat template"):
    HFTokenizer.from_dir(path, use_chat_template=True)
  with pytest.raises(ChatTemplateError, match=rf"{path} has no chat template"):
    HFTokenizer.from_dir(path).render_chat(CONVERSATIONS["single"])

  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [1, 10**6]}, f)
  with pytest.raises(HFTokenizerError, match=r"generation_config\.json: eos_token_id 1000000"):
    HFTokenizer.from_dir(path)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(HFTokenizerError, match=r"generation_config\.json: cannot read JSON"):
    HFTokenizer.from_dir(path)


# --------------------------------------------------------------------------------------------
# Parity with transformers (the `parity` extra)


def _hf(path):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(path)


def _ids(out):
  """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5, ids in 4."""
  return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@parity
@pytest.mark.parametrize("family", ["qwen25", "llama3", "qwen3"])
def test_parity_encode_decode(dirs, family):
  ref, tok = _hf(dirs[family]), HFTokenizer.from_dir(dirs[family])
  assert tok.vocab_size == len(ref)
  assert tok.eos_id == ref.eos_token_id and tok.bos_id == ref.bos_token_id
  assert tok.pad_id == (tok.eos_id if ref.pad_token_id is None else ref.pad_token_id)
  for text in TEXTS + CORPUS:
    ids = tok.encode(text)
    assert ids == ref(text)["input_ids"], text
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    cut = next((n for n, i in enumerate(ids) if i in tok.eos_ids), len(ids))
    kept = [i for i in ids[:cut] if i != tok.pad_id]
    assert tok.decode(ids) == ref.decode(kept, skip_special_tokens=True), text
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(kept, skip_special_tokens=False)


@parity
@pytest.mark.parametrize("family", ["qwen25", "llama3", "qwen3"])
@pytest.mark.parametrize("convo", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_parity_chat_template(dirs, family, convo, gen):
  ref, tok = _hf(dirs[family]), HFTokenizer.from_dir(dirs[family])
  messages = CONVERSATIONS[convo]
  text = tok.render_chat(messages, add_generation_prompt=gen)
  assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
  assert tok.encode_chat(messages, add_generation_prompt=gen) == _ids(
    ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen))


@parity
def test_parity_template_kwargs_and_tools(dirs):
  tools = [{"type": "function", "function": {"name": "add", "description": "Adds <a> & b",
                                             "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number", "description": "é"}}}}}]
  calls = [{"role": "user", "content": "add 1"},
           {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
           {"role": "tool", "content": "2"},
           {"role": "assistant", "content": "<think>\nsum\n</think>\n\nIt is 2."}]
  for family in ("qwen25", "qwen3"):
    ref, tok = _hf(dirs[family]), HFTokenizer.from_dir(dirs[family])
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
      for gen in (True, False):
        assert tok.render_chat(calls, gen, tools=tools, **kw) == ref.apply_chat_template(
          calls, tools=tools, tokenize=False, add_generation_prompt=gen, **kw)
        assert tok.render_chat(calls[:1], gen, **kw) == ref.apply_chat_template(
          calls[:1], tokenize=False, add_generation_prompt=gen, **kw)
