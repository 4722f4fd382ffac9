"""GGUF files (llama.cpp's format) in: a Hugging Face model directory made from one file.

A `.gguf` file holds the weights (often quantized), the architecture, the tokenizer (vocab,
merges, token types, special ids, pre-tokenizer name) and the chat template. `convert` writes
them as the Hugging Face directory that the rest of jaxrl reads (`config.json` with
`architectures` set, `model.safetensors` in float32, `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`, `generation_config.json`); `model_dir` does it once per file content into
a cache and returns the directory, which is how `model.hf_path=<file>.gguf` is read.

Why a directory and not a second loader: every reader of a model (the run, its copy of the
model's metadata in `hf_base/`, `jaxrl.export`, `jaxrl.evaluate`, a teacher, the server, and
`transformers` or TRL given the same weights) then reads one format, so a GGUF model behaves
exactly like the Hugging Face model it was made from.

- Weights are dequantized with the `gguf` package (the `gguf` extra; no torch): F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_*, and the K-quants, to float32. A quantized model's float32 values are
  exactly what llama.cpp computes from the blocks; nothing is re-rounded.
- llama.cpp's converter permutes the rows of a Llama model's q and k projections into the
  interleaved RoPE layout; they are permuted back to the "rotate half" layout (Qwen models are
  stored unpermuted).
- The tokenizer is byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer
  llama.cpp names in `tokenizer.ggml.pre`; CONTROL and USER_DEFINED tokens are added tokens
  (CONTROL ones special). SentencePiece vocabularies (`llama`) are refused by name.
- Anything the model cannot represent (another architecture, a vocabulary type or pre-tokenizer
  not listed here, a tensor with no Hugging Face counterpart) is one line naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

import numpy as np

from jaxrl.core.errors import UserError

# general.architecture -> the Hugging Face architecture it is written as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# Architectures whose q/k rows llama.cpp's converter permutes into the interleaved RoPE layout.
_PERMUTED_QK = ("llama",)

# tokenizer.ggml.pre -> the regular expressions llama.cpp splits text with, in order (each
# split keeps its matches as pieces), before byte-level BPE.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
           r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
  "gpt2": (_GPT2,), "default": (_GPT2,),
  # StarCoder's group in llama.cpp: every digit its own piece first.
  "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
  "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,),
  "qwen2": (_QWEN2,), "qwen35": (_QWEN2,),
}

# GGUF tensor name (per layer after "blk.{i}.") -> Hugging Face name.
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
  "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
  "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp's token types (gguf.TokenType): CONTROL and USER_DEFINED become added tokens.
_CONTROL, _USER_DEFINED = 3, 4
# Bump when the directory written for the same file changes, so old cache entries are not used.
FORMAT_VERSION = 1


class GGUFError(UserError, ValueError):
  """A GGUF file that cannot be read as a model jaxrl supports (the line names what)."""


def _reader(path: str):
  try:
    import gguf  # the gguf extra
  except ImportError:
    raise GGUFError(f"{path}: reading a GGUF file needs the gguf package: "
                    "pip install -e \".[gguf]\"") from None
  if not os.path.isfile(path):
    raise GGUFError(f"no file {path!r}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError/struct errors for damaged files
    raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def _need(reader, path: str, key: str):
  value = _field(reader, key)
  if value is None:
    raise GGUFError(f"{path}: metadata key {key!r} is missing")
  return value


def hf_config(reader, path: str) -> dict:
  """The Hugging Face `config.json` of the file's model (see the module docstring)."""
  arch = _field(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{path}: general.architecture={arch!r} is not supported; expected one of "
                    f"{sorted(ARCHITECTURES)}")
  a = lambda key: _need(reader, path, f"{arch}.{key}")  # noqa: E731
  d_model, heads = int(a("embedding_length")), int(a("attention.head_count"))
  head_dim = int(_field(reader, f"{arch}.attention.key_length") or d_model // heads)
  rope_dims = _field(reader, f"{arch}.rope.dimension_count")
  if rope_dims is not None and int(rope_dims) != head_dim:
    raise GGUFError(f"{path}: {arch}.rope.dimension_count={rope_dims} is partial rotary "
                    f"(head dim {head_dim}), which the model cannot represent")
  scaling = _field(reader, f"{arch}.rope.scaling.type")
  if scaling not in (None, "none"):
    raise GGUFError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported")
  if _field(reader, f"{arch}.attention.sliding_window") is not None:
    raise GGUFError(f"{path}: {arch}.attention.sliding_window is not supported")
  names = {t.name for t in reader.tensors}
  tokens = _need(reader, path, "tokenizer.ggml.tokens")
  config = {
    "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
    "hidden_size": d_model, "intermediate_size": int(a("feed_forward_length")),
    "num_hidden_layers": int(a("block_count")), "num_attention_heads": heads,
    "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
    "head_dim": head_dim, "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon")),
    "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
    "max_position_embeddings": int(_field(reader, f"{arch}.context_length") or 2048),
    "vocab_size": int(_field(reader, f"{arch}.vocab_size") or len(tokens)),
    "tie_word_embeddings": "output.weight" not in names, "torch_dtype": "float32",
    "attention_bias": False, "mlp_bias": False,
  }
  for key in ("bos", "eos", "padding"):
    value = _field(reader, f"tokenizer.ggml.{key}_token_id")
    if value is not None:
      config[f"{'pad' if key == 'padding' else key}_token_id"] = int(value)
  return config


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of llama.cpp's q/k row permutation: per head, rows (pair, half) -> (half,
  pair), i.e. interleaved RoPE rows back to the "rotate half" order."""
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, path: str) -> str:
  if name in _GLOBAL:
    return _GLOBAL[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
    return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
  raise GGUFError(f"{path}: tensor {name!r} has no counterpart in the model (not one of the "
                  "embedding, norm, attention and MLP tensors of a dense decoder)")


def tensors(reader, path: str, config: dict) -> dict[str, np.ndarray]:
  """Every tensor, dequantized to float32 under its Hugging Face name and `[out, in]` shape."""
  from gguf import quants

  arch = config["model_type"]
  out = {}
  for t in reader.tensors:
    hf = _hf_name(t.name, path)
    try:
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError:
      raise GGUFError(f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which the "
                      "gguf package cannot dequantize") from None
    # GGUF lists dimensions innermost first; the array is stored outermost first.
    w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
    if arch in _PERMUTED_QK and hf.endswith(("q_proj.weight", "k_proj.weight")):
      heads = config["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
      w = _unpermute(w, heads)
    out[hf] = np.ascontiguousarray(w)
  return out


def _text(value) -> str:
  return value if isinstance(value, str) else bytes(value).decode("utf-8")


def tokenizer(reader, path: str):
  """A `tokenizers.Tokenizer` from the file's vocabulary (see the module docstring)."""
  import tokenizers
  from tokenizers import decoders, pre_tokenizers, processors

  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only byte-level "
                    "BPE, 'gpt2')")
  pre = _field(reader, "tokenizer.ggml.pre") or "default"
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"{path}: tokenizer.ggml.pre={pre!r} is not a known pre-tokenizer; expected "
                    f"one of {sorted(PRE_TOKENIZERS)}")
  tokens = [_text(t) for t in _need(reader, path, "tokenizer.ggml.tokens")]
  types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [tuple(_text(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
  vocab = {tok: i for i, tok in enumerate(tokens)}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, fuse_unk=False,
                                                   byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  added = [tokenizers.AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
           for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)]
  tok.add_tokens(added)
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  if _field(reader, "tokenizer.ggml.add_bos_token") and bos is not None:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tokens[int(bos)]} $A", pair=f"{tokens[int(bos)]} $A $B",
        special_tokens=[(tokens[int(bos)], int(bos))])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok, tokens


def _tokenizer_config(reader, tokens: list[str], config: dict) -> dict:
  out = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
         "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token") or False),
         "model_max_length": config["max_position_embeddings"]}
  for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"),
                    ("unknown", "unk_token")):
    value = _field(reader, f"tokenizer.ggml.{key}_token_id")
    if value is not None and 0 <= int(value) < len(tokens):
      out[name] = tokens[int(value)]
  return out


def convert(path: str, out_dir: str, progress: Callable[[str], None] | None = None) -> None:
  """Writes the Hugging Face directory of GGUF file `path` into `out_dir` (created; files in it
  are replaced). Raises `GGUFError` naming what cannot be represented, before writing."""
  from safetensors.numpy import save_file

  reader = _reader(path)
  config = hf_config(reader, path)
  tok, tokens = tokenizer(reader, path)
  for t in reader.tensors:  # every name is checked before anything is dequantized or written
    _hf_name(t.name, path)
  if progress:
    progress(f"{len(reader.tensors)} tensors to float32")
  weights = tensors(reader, path, config)
  os.makedirs(out_dir, exist_ok=True)
  save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  files = {"config.json": config, "tokenizer_config.json": _tokenizer_config(reader, tokens, config),
           "generation_config.json": {k: config[k] for k in ("bos_token_id", "eos_token_id",
                                                             "pad_token_id") if k in config}}
  for name, value in files.items():
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(value, f, indent=2)
  template = _field(reader, "tokenizer.chat_template")
  if template:
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
      f.write(_text(template))


def content_key(path: str) -> str:
  """A digest of the file's bytes and the converter's format: the cache entry's name."""
  h = hashlib.sha256(f"jaxrl-gguf-{FORMAT_VERSION}".encode())
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()[:16]


def check(path: str) -> dict:
  """The file's Hugging Face config, after the checks `convert` makes that need no
  dequantization (architecture, tokenizer, tensor names); raises `GGUFError`."""
  reader = _reader(path)
  config = hf_config(reader, path)
  tokenizer(reader, path)
  for t in reader.tensors:
    _hf_name(t.name, path)
  return config


def model_dir(path: str, cache_root: str,
              progress: Callable[[str], None] | None = None) -> str:
  """The cached Hugging Face directory of GGUF file `path` under `cache_root`, written first
  if absent (into a temporary directory renamed into place, so a killed conversion leaves no
  half directory that a later run would take as made)."""
  stem = os.path.splitext(os.path.basename(path))[0]
  if not os.path.isfile(path):
    raise GGUFError(f"no file {path!r}")
  out = os.path.join(cache_root, f"{stem}-{content_key(path)}")
  if os.path.isfile(os.path.join(out, "config.json")):
    return out
  os.makedirs(cache_root, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_root)
  try:
    if progress:
      progress(f"converting {path} to a Hugging Face directory in {out}")
    convert(path, tmp, progress)
    try:
      os.rename(tmp, out)
    except OSError:  # another process finished the same conversion first
      if not os.path.isfile(os.path.join(out, "config.json")):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out
