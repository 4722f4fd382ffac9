"""Tiny models for the OpenAI-server and agent tests, saved and loaded in the real file formats
(tokenizer.json + tokenizer_config.json with Qwen2.5's chat template, config.json +
model.safetensors).

`scripted_params` turns a model into a bigram table: token x is followed by `successor[x]` with
probability ~1 (every other token `fallback`), so a test knows what the server will generate,
tool calls included, even when it samples.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hf_fixtures import qwen_files
from jaxrl.data.hf_tokenizer import HFTokenizer
from jaxrl.models import ModelConfig, init_model
from jaxrl.models.hf_checkpoint import load_hf, save_hf

TOOL_TOKENS = ("<tool_call>", "</tool_call>")
# One added token holding a whole call's JSON, so a bigram machine can write it (the JSON's own
# characters repeat, which a bigram table cannot follow).
CALL_JSON = '{"name": "calc", "arguments": {"expr": "2+3"}}'


def qwen_model(path, *, d_model: int = 32, seed: int = 0, tie: bool = True, params_fn=None,
               extra_tokens=TOOL_TOKENS):
  """A Qwen2-style tokenizer and random model under `path` -> (tokenizer, graphdef, params) as
  `load_hf` reads them back. `params_fn(cfg, params, tok)` may rewrite the params first."""
  path = qwen_files(path, extra_tokens=extra_tokens)
  tok = HFTokenizer.from_dir(path)
  cfg = ModelConfig(vocab_size=tok.vocab_size + 13, d_model=d_model, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True, tie_embeddings=tie)
  params = init_model(cfg, seed=seed)[1]
  if params_fn is not None:
    params = params_fn(cfg, params, tok)
  save_hf(path, cfg, params, architecture="Qwen2ForCausalLM")
  _, graphdef, params = load_hf(path)
  return tok, graphdef, params


def scripted_params(cfg: ModelConfig, params, successor: dict[int, int], fallback: int,
                    margin: float = 20.0):
  """Params of a bigram machine (module docstring): attention and MLP outputs zeroed, so the
  last hidden state is the token's own embedding, a one-hot row (needs d_model >= vocab); the
  unembedding maps it to its successor's logit `margin` x sqrt(d_model) above every other."""
  V, D = cfg.vocab_size, cfg.d_model
  assert D >= V and not cfg.tie_embeddings
  table = np.full(V, fallback)
  for x, y in successor.items():
    table[x] = y
  head = np.zeros((D, V), np.float32)
  head[np.arange(V), table] = margin
  p = params
  p["embed"][...] = jnp.eye(V, D, dtype=jnp.float32)
  p["lm_head"][...] = jnp.asarray(head)
  p["wo"][...] = jnp.zeros_like(p["wo"][...])
  p["w_down"][...] = jnp.zeros_like(p["w_down"][...])
  p["final_norm"][...] = jnp.ones_like(p["final_norm"][...])
  return p


def chain(tokens: list[int]) -> dict[int, int]:
  """successor table that writes `tokens[1:]` after `tokens[0]` (each token followed by one)."""
  out = {}
  for a, b in zip(tokens, tokens[1:]):
    assert out.get(a, b) == b, f"token {a} has two successors in the script"
    out[a] = b
  return out
