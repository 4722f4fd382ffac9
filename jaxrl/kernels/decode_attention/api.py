"""One entry point for single-token decode attention against a KV cache; implementations share
a signature.

Layout (`jaxrl.models.model_config.KVCache`, one layer): queries `q [B, K, G, Dh]` (kv-head
major, G = H / K query heads per kv head), keys slot-minor `k_t [B, K, Dh, S]`, values
`v [B, K, S, Dh]`. Which slots a row attends: slot s of row b iff

    valid[b, s] and s < lengths[b]

`valid` `[B, S]` is the cache's per-slot flags (left-padded prompts leave early slots invalid);
`lengths` `[B]` bounds each row's filled slots (every valid slot lies below it), so the
blockwise implementations read only the key blocks below it. `lengths=None` means S (nothing
skipped).

A row that attends no slot: `reference` gives the uniform average of all S values
(`jaxrl.models.layers.decode_attention`'s behaviour), the others give 0. No caller reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core import names
from jaxrl.kernels.decode_attention import pallas_gpu, pallas_tpu, reference, xla

IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu", "pallas_gpu")
# `pallas_tpu` compiles on TPU, `pallas_gpu` on a CUDA GPU (Triton); both are interpreted on CPU
# and refused on the other accelerator. Their module docstrings give the block constraints.
_FUNCTIONS = {"reference": reference.decode_attention, "xla": xla.decode_attention,
              "pallas_tpu": pallas_tpu.decode_attention,
              "pallas_gpu": pallas_gpu.decode_attention}
names.check_registry("DECODE_ATTENTION_KERNELS", names.DECODE_ATTENTION_KERNELS, IMPLEMENTATIONS)
names.check_registry("DECODE_ATTENTION_KERNELS", names.DECODE_ATTENTION_KERNELS, _FUNCTIONS)


def default_impl() -> str:
  """`xla`: plain XLA on every backend, cache read in its dtype, blocks past every row skipped."""
  return "xla"


def _check_shapes(q, k_t, v, valid, lengths):
  if q.ndim != 4 or k_t.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected q [B, K, G, Dh], k_t [B, K, Dh, S], v [B, K, S, Dh]; got "
                     f"{q.shape}, {k_t.shape}, {v.shape}")
  b, kh, _, d = q.shape
  s = k_t.shape[3]
  if k_t.shape != (b, kh, d, s) or v.shape != (b, kh, s, d):
    raise ValueError(f"k_t {k_t.shape} and v {v.shape} do not fit q {q.shape}: want k_t "
                     f"{(b, kh, d, s)} and v {(b, kh, s, d)}")
  if tuple(valid.shape) != (b, s):
    raise ValueError(f"valid must be {[b, s]}; got {list(valid.shape)}")
  if lengths is not None and tuple(lengths.shape) != (b,):
    raise ValueError(f"lengths must be {[b]}; got {list(lengths.shape)}")


def decode_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, valid: jax.Array,
                     lengths: jax.Array | None = None, *, scale: float | None = None,
                     implementation: str | None = None, block_k: int | None = None,
                     out_dtype=None, interpret=None) -> jax.Array:
  """Softmax attention of one query token per row over its cache's filled slots.

  Args:
    q: `[B, K, G, Dh]` the step's queries, grouped by kv head.
    k_t: `[B, K, Dh, S]` keys, slot-minor; v: `[B, K, S, Dh]` values (the cache's dtype).
    valid: `[B, S]` bool, which slots hold real tokens.
    lengths: `[B]` int or None (= S): slots at or past `lengths[b]` are not attended, and the
      blockwise implementations do not read their blocks.
    scale: score scale; None = `Dh ** -0.5`.
    implementation: `reference` (dense, float32), `xla` (blockwise while loop, cache dtype),
      `pallas_tpu` or `pallas_gpu`; None = `default_impl()`.
    block_k: key slots per block (`xla`, `pallas_tpu`, `pallas_gpu`; None: each one's default).
    out_dtype: the result's dtype; None = q's.
    interpret: Pallas interpreter for the `pallas_*` implementations (None: on CPU only).

  Returns:
    `[B, K, G, Dh]`. Scores and softmax statistics in float32. Forward only (decode needs no
    gradient).
  """
  implementation = default_impl() if implementation is None else implementation
  if implementation not in _FUNCTIONS:
    raise ValueError(f"unknown decode attention implementation {implementation!r}; expected "
                     f"one of {IMPLEMENTATIONS}")
  _check_shapes(q, k_t, v, valid, lengths)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  s_len = k_t.shape[3]
  if lengths is None:
    lengths = jnp.full((q.shape[0],), s_len, jnp.int32)
  lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, s_len)
  out_dtype = q.dtype if out_dtype is None else out_dtype
  return _FUNCTIONS[implementation](q, k_t, v, jnp.asarray(valid).astype(bool), lengths,
                                    scale=scale, out_dtype=out_dtype, block_k=block_k,
                                    interpret=interpret)
