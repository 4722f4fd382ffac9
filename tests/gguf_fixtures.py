"""Tiny GGUF files in llama.cpp's layout, written with the `gguf` package, and the Hugging Face
tensors they were made from.

`write_llama(path)` writes a 2-layer Llama-shaped model (d 32, 4 query and 2 kv heads of 8, MLP 64) and a
byte-level BPE vocabulary trained on `hf_fixtures.CORPUS` with `<|im_start|>` / `<|im_end|>` as
CONTROL tokens and the SmolLM2 chat template. q and k rows are permuted into the interleaved RoPE
layout as llama.cpp's converter does, and tensors are stored F32, F16 and Q8_0 as `qtypes` says,
so a reader must undo both. Returns the Hugging Face-named float32 tensors the file decodes to
(the quantized ones as the `gguf` package dequantizes them), the ground truth for a reader.
"""

from __future__ import annotations

import json

import gguf
import numpy as np

import hf_fixtures  # noqa: E402  (tests/ is on sys.path)

SMOLLM_TEMPLATE = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
  "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The split the vocabulary is trained with (GPT-2's); only the vocabulary depends on it.
TRAIN_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SHAPE = dict(d_model=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)  # rows a multiple of Q8_0's 32-value block


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's q/k row permutation ("rotate half" rows -> interleaved pairs), per head."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def tokenizer_parts():
  """(tokens, token types, merges) of a small byte-level BPE with SPECIALS as CONTROL tokens."""
  tok = hf_fixtures.bpe(SPECIALS, TRAIN_REGEX, normalize=False)
  model = json.loads(tok.to_str())["model"]
  vocab = dict(model["vocab"])
  for s in SPECIALS:
    vocab.setdefault(s, tok.token_to_id(s))
  tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  types = [3 if t in SPECIALS else 1 for t in tokens]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, types, merges


def write_llama(path: str, seed: int = 0, qtypes: dict[str, str] | None = None,
                arch: str = "llama", pre: str = "smollm", tied: bool = False) -> dict:
  """Writes the model of the module docstring to `path`; returns its HF-named tensors."""
  qtypes = qtypes or {"mlp": "Q8_0", "attn_q": "F16"}
  tokens, types, merges = tokenizer_parts()
  s, rng = SHAPE, np.random.default_rng(seed)
  d, hd, v = s["d_model"], s["head_dim"], len(tokens)
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(s["layers"])
  w.add_context_length(256)
  w.add_embedding_length(d)
  w.add_feed_forward_length(s["mlp"])
  w.add_head_count(s["heads"])
  w.add_head_count_kv(s["kv_heads"])
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(hd)
  w.add_vocab_size(v)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(tokens.index("<|im_start|>"))
  w.add_eos_token_id(tokens.index("<|im_end|>"))
  w.add_pad_token_id(tokens.index("<|endoftext|>"))
  w.add_add_bos_token(False)
  w.add_chat_template(SMOLLM_TEMPLATE)
  hf = {}

  def put(gguf_name, hf_name, shape, kind="F32", heads=None):
    x = (rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.1)).astype(np.float32)
    if len(shape) == 1:
      x += 1.0
    stored = _permute(x, heads) if heads else x
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = stored if kind == "F32" else stored.astype(np.float16) if kind == "F16" else \
        gguf.quants.quantize(stored, qtype)
    w.add_tensor(gguf_name, data, raw_dtype=qtype if kind not in ("F32", "F16") else None)
    back = np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(stored.shape) \
        if kind != "F32" else stored
    if heads:  # the ground truth is the un-permuted rows of what the file decodes to
      back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(
          back.shape)
    hf[hf_name] = back

  put("token_embd.weight", "model.embed_tokens.weight", (v, d))
  put("output_norm.weight", "model.norm.weight", (d,))
  if not tied:
    put("output.weight", "lm_head.weight", (v, d))
  for i in range(s["layers"]):
    b, m = f"blk.{i}.", f"model.layers.{i}."
    put(b + "attn_norm.weight", m + "input_layernorm.weight", (d,))
    put(b + "ffn_norm.weight", m + "post_attention_layernorm.weight", (d,))
    put(b + "attn_q.weight", m + "self_attn.q_proj.weight", (s["heads"] * hd, d),
        qtypes.get("attn_q", "F32"), heads=s["heads"] if arch == "llama" else None)
    put(b + "attn_k.weight", m + "self_attn.k_proj.weight", (s["kv_heads"] * hd, d),
        heads=s["kv_heads"] if arch == "llama" else None)
    put(b + "attn_v.weight", m + "self_attn.v_proj.weight", (s["kv_heads"] * hd, d))
    put(b + "attn_output.weight", m + "self_attn.o_proj.weight", (d, s["heads"] * hd))
    for g, h, shape in (("ffn_gate", "gate_proj", (s["mlp"], d)),
                        ("ffn_up", "up_proj", (s["mlp"], d)),
                        ("ffn_down", "down_proj", (d, s["mlp"]))):
      put(f"{b}{g}.weight", f"{m}mlp.{h}.weight", shape, qtypes.get("mlp", "F32"))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return hf
