"""One entry point for masked attention over packed rows; implementations share a signature.

No dense `[T, S]` mask is passed in: each token carries a segment and a position, and each
implementation builds the mask it needs (`reference` all at once, `xla` one key block at a
time). Query i attends key j iff

    q_segment[i] >= 0 and kv_segment[j] >= 0          (-1: padding, left or right)
    and kv_position[j] <= q_position[i]                 (causal, by position, not by index)
    and (kv_segment[j] == q_segment[i]
         or kv_shared[j] and kv_segment[j] >> 16 == q_segment[i] >> 16)

Packed rows: several sequences in one row, each its own segment id, positions counted from 0 in
each. Left padding: segment -1 (its positions are never compared with a real token's).

Group layout (a group's prompt attended by each of its continuations, as in
`jaxrl.models.Transformer.grouped_forward`): one row holds the left-padded prompt [Lp], then its
G continuations [T] each. Give the prompt's tokens segment 0 and `kv_shared = True`, continuation
g's tokens segment g + 1, padding tokens segment -1, and positions as that method does (the
prompt's `left_positions`, the continuations' `continuation_positions`, which start after the
prompt's last position). Then the prompt attends itself causally, and each continuation attends
every real prompt key (their positions are all earlier) and itself causally, never another
continuation. `kv_shared` makes a key visible across the segments of its unit (the segment's high bits,
`segment >> 16`, `reference.UNIT_SHIFT`): with unit 0 for every segment below 65,536, a row holds
one group; give group u's segments `u << 16 | member` and a row holds many (the train step's
token-budget packing, `jaxrl.learner.packing`);
a padding query attends nothing (`grouped_forward` lets a continuation's padding see the prompt;
no real token reads either output).

A query that attends nothing (padding, or no earlier key) gets the uniform average of all S
values, as `jaxrl.models.layers.attention` gives it: no gradient to q or k, and `1 / S` of its
output cotangent to each value (zero when the loss masks that row, as it does padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core import names
from jaxrl.kernels.attention import cudnn, pallas_tpu, reference, xla

IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu", "cudnn")
# `pallas_tpu` compiles on TPU (interpreted on CPU, refused on GPU); `cudnn` runs on a CUDA GPU
# in bf16 / f16 only (ValueError elsewhere). Their module docstrings give the constraints.
_FUNCTIONS = {"reference": reference.attention, "xla": xla.attention,
              "pallas_tpu": pallas_tpu.attention, "cudnn": cudnn.attention}
names.check_registry("ATTENTION_KERNELS", names.ATTENTION_KERNELS, IMPLEMENTATIONS)
names.check_registry("ATTENTION_KERNELS", names.ATTENTION_KERNELS, _FUNCTIONS)


def default_impl() -> str:
  """`xla`: blockwise, memory linear in the sequence, on every backend (plain XLA)."""
  return "xla"


def _check_shapes(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"expected q [B, T, H, Dh] and k, v [B, S, Hkv, Dh]; got {q.shape}, "
                     f"{k.shape}, {v.shape}")
  (b, t, h, d), (_, s, kh, _) = q.shape, k.shape
  if k.shape[0] != b or k.shape[3] != d or h % kh:
    raise ValueError(f"k, v {k.shape} do not fit q {q.shape}: same B and Dh, and H a multiple "
                     "of Hkv")
  for name, x, want in (("q_segment", q_segment, (b, t)), ("q_position", q_position, (b, t)),
                        ("kv_segment", kv_segment, (b, s)), ("kv_position", kv_position, (b, s)),
                        ("kv_shared", kv_shared, (b, s))):
    if x is not None and tuple(x.shape) != want:
      raise ValueError(f"{name} must be {list(want)}; got {list(x.shape)}")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment: jax.Array,
              q_position: jax.Array, kv_segment: jax.Array, kv_position: jax.Array,
              kv_shared: jax.Array | None = None, *, scale: float | None = None,
              implementation: str | None = None, block_k: int | None = None) -> jax.Array:
  """Masked softmax attention over packed rows, without a dense mask argument.

  Args:
    q: `[B, T, H, Dh]` queries.
    k, v: `[B, S, Hkv, Dh]` keys and values; H a multiple of Hkv (grouped-query: query head h
      reads kv head `h // (H / Hkv)`).
    q_segment, q_position: `[B, T]` int per query token; segment -1 is padding.
    kv_segment, kv_position: `[B, S]` int per key token; segment -1 is padding.
    kv_shared: `[B, S]` bool or None (none shared): the row's group prompt (module docstring).
    scale: score scale; None = `Dh ** -0.5`.
    implementation: `reference` (dense `[B, H, T, S]`), `xla` (blockwise), `pallas_tpu`
      (flash-attention kernels for TPU) or `cudnn` (cuDNN flash attention, CUDA GPU, bf16 /
      f16, a dense `[B, 1, T, S]` mask); None = `default_impl()`.
    block_k: `xla`'s key block width (None: `xla.DEFAULT_BLOCK_K`); `pallas_tpu`'s query and
      key block width (None: its defaults; a multiple of 128 on TPU unless it covers the whole
      sequence); `reference` and `cudnn` ignore it.

  Returns:
    `[B, T, H, Dh]` in q's dtype. Scores and softmax in float32. Differentiable w.r.t. q, k, v.
  """
  implementation = default_impl() if implementation is None else implementation
  if implementation not in _FUNCTIONS:
    raise ValueError(f"unknown attention implementation {implementation!r}; expected one of "
                     f"{IMPLEMENTATIONS}")
  _check_shapes(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  as_int = lambda x: jnp.asarray(x).astype(jnp.int32)
  shared = None if kv_shared is None else jnp.asarray(kv_shared).astype(bool)
  return _FUNCTIONS[implementation](q, k, v, as_int(q_segment), as_int(q_position),
                                    as_int(kv_segment), as_int(kv_position), shared,
                                    scale=scale, block_k=block_k)
