"""Tiny Hugging Face tokenizer directories built offline, for tests.

Byte-level BPE tokenizers trained on a small corpus and saved with the real chat templates and
the special tokens, config and generation config of Qwen2.5 (ChatML, default system message,
tools branch), Llama 3 (BOS from the post-processor, header tokens, `<|eot_id|>`) and Qwen3
(think blocks, `enable_thinking`, template in `chat_template.jinja`).
"""

from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import (Regex, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

QWEN_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
              r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
                   "{% set content = '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
                   "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

CORPUS = [
  "The quick brown fox jumps over the lazy dog. What is 12 + 30? The answer is 42.",
  "You are a helpful assistant. Please reason step by step, and put the final answer last.",
  "Hello, world! Héllo, wörld — naïve café. 你好，世界。数学题：三加四等于七。",
  "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
  "Tabs\tand   spaces,\r\nnew lines\n\n\nand emoji 🙂🚀 too. It's, we're, they've, I'm.",
  "Countdown: use 3, 7, 25 and 50 to make 100. Observation: wrong, try again.",
]
TEXTS = [
  "What is 12 + 30?",
  "  leading and trailing spaces  ",
  "line one\nline two\n\n\tindented",
  "Héllo wörld 你好 🙂 — café",
  "special strings inside text: <|im_end|> and <|eot_id|> and <|endoftext|>",
  "",
  "It's 5 o'clock; they're late!!!",
]


def bpe(specials: list[str], pre_regex: str, normalize: bool) -> tokenizers.Tokenizer:
  """A byte-level BPE with ~400 ids trained on CORPUS; `specials` appended as special tokens."""
  tok = tokenizers.Tokenizer(models.BPE())
  if normalize:
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(pre_regex), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 3, trainer)
  tok.add_special_tokens(specials)
  return tok


def added_tokens_decoder(tok, specials):
  return {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": True}
          for s in specials}


def save(path, tok, config, generation_config=None, template_file=None):
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, ensure_ascii=False, indent=2)
  if generation_config is not None:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump(generation_config, f)
  if template_file is not None:
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
      f.write(template_file)
  return str(path)


def qwen_files(path, template=QWEN25_TEMPLATE, *, in_jinja_file=False, extra_tokens=()):
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok = bpe(specials, QWEN_REGEX, normalize=True)
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  if extra_tokens:
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                    for t in extra_tokens])
  config = {"add_prefix_space": False, "added_tokens_decoder": added_tokens_decoder(tok, specials),
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
            "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
  for t in extra_tokens:
    config["added_tokens_decoder"][str(tok.token_to_id(t))] = {
      "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
      "special": False}
  if not in_jinja_file:
    config["chat_template"] = template
  gen = {"bos_token_id": tok.token_to_id("<|endoftext|>"),
         "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
         "pad_token_id": tok.token_to_id("<|endoftext|>"), "do_sample": True}
  return save(path, tok, config, gen, template if in_jinja_file else None)


def llama_files(path, *, generation_config=True):
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eot_id|>"]
  tok = bpe(specials, LLAMA3_REGEX, normalize=False)
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.Sequence([
    processors.ByteLevel(trim_offsets=False),
    processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                  pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                  special_tokens=[("<|begin_of_text|>", bos)])])
  config = {"added_tokens_decoder": added_tokens_decoder(tok, specials),
            "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE,
            "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast"}
  gen = None
  if generation_config:
    gen = {"bos_token_id": bos, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
           "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
  return save(path, tok, config, gen)


def random_hf_model(config_cls: str, arch: str, seed: int, **config):
  """A tiny random `transformers` model in f32 (needs the parity extra). Default init leaves
  norms at 1 and biases at 0, which would hide a misplaced norm or bias, so both are perturbed."""
  import torch
  import transformers

  torch.manual_seed(seed)
  model = getattr(transformers, arch)(getattr(transformers, config_cls)(**config))
  model = model.to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model
