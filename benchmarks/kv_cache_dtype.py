"""The sampler's KV cache dtypes (`rollout.kv_cache_dtype`) against a float32 cache, on CPU:
cache bytes per position and row, greedy tokens agreement and log-prob error.

A small random model (the tests' tiny shape with a wide init, so logits are peaked: `--quick`,
the default) or `--layers/--d-model/...`; `--rows` prompts of random lengths, `--new` greedy
tokens each through the static sampler (`make_sampler`), once per cache dtype, same keys.
Reported per dtype: `bytes_per_position_row` (layers x 2 x kv heads x head_dim x itemsize, read
off the sampler's prefill cache), `token_agreement` (fraction of all generated tokens equal to
the float32 cache's), `rows_identical`, and `max_abs_logprob_error` / `mean_abs_logprob_error`
over each row's tokens before its first difference (after one, the contexts differ). Nothing
here is timed: on CPU the 8-bit caches are converted in software.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np

from jaxrl.models import ModelConfig, init_model
from jaxrl.rollout.static_sampler import make_sampler

DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="the default small shape (CPU seconds)")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=64)
  ap.add_argument("--kv-heads", type=int, default=2)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--init-std", type=float, default=0.3)
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--new", type=int, default=32)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  heads = 2 * a.kv_heads
  shape = dict(vocab_size=a.vocab, d_model=a.d_model, num_layers=a.layers, num_heads=heads,
               num_kv_heads=a.kv_heads, head_dim=a.d_model // heads, mlp_dim=2 * a.d_model,
               init_std=a.init_std)
  rng = np.random.default_rng(a.seed)
  lens = rng.integers(1, a.prompt_len + 1, a.rows)
  prompts = np.zeros((a.rows, a.prompt_len), np.int32)
  for i, n in enumerate(lens):
    prompts[i, a.prompt_len - n:] = rng.integers(2, a.vocab, n)
  valid = prompts > 0
  _, params = init_model(ModelConfig(**shape), a.seed)
  outs, report = {}, {"backend": jax.default_backend(), "jax": jax.__version__, "model": shape,
                      "rows": a.rows, "prompt_len": a.prompt_len, "new_tokens": a.new,
                      "sampling": "greedy", "dtypes": {}}
  for dt in DTYPES:
    graphdef, _ = init_model(ModelConfig(**shape, kv_cache_dtype=dt), a.seed)
    # eos outside the vocabulary: every row generates every token.
    gen = make_sampler(graphdef, num_samples=1, max_new_tokens=a.new, eos_id=a.vocab,
                       pad_id=0)
    cache = gen.prefill(params, prompts, valid)[0]
    out = gen(params, prompts, valid, jax.random.key(a.seed), np.arange(a.rows), 0.0)
    outs[dt] = out
    ref = outs["float32"]
    t, r = np.asarray(out.tokens), np.asarray(ref.tokens)
    prefix = np.cumprod(t == r, axis=1).astype(bool)
    err = np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs))[prefix]
    report["dtypes"][dt] = {
        "cache_dtype": str(cache.k.dtype),
        "bytes_per_position_row": int((cache.k.nbytes + cache.v.nbytes) // cache.valid.size),
        "token_agreement": round(float((t == r).mean()), 4),
        "rows_identical": int((t == r).all(axis=1).sum()),
        "max_abs_logprob_error": float(err.max()),
        "mean_abs_logprob_error": float(err.mean()),
    }
    print(f"{dt}: {report['dtypes'][dt]}", file=sys.stderr)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
