"""Masked attention over packed rows through cuDNN's fused flash attention on a CUDA GPU
(`jax.nn.dot_product_attention(..., implementation="cudnn")`).

What that API can express (jax 0.10.2, `jax/_src/nn/functions.py` and
`jax/_src/cudnn/fused_attention_stablehlo.py`): `is_causal` (by index, not by position),
`query_seq_lengths` / `key_value_seq_lengths` (one right-padded sequence per row),
`local_window_size`, and a `mask` (bool) or `bias` broadcastable to `[B, N, T, S]`. Its packed
layout (several segments per row, `q_offsets`) is not in the public function, needs Hopper, and
knows neither positions nor a prompt shared across segments. Packed rows, left padding and the
group layout (module docstring of `api`) therefore go in as a dense mask:
`reference.token_mask` as bool `[B, 1, T, S]`, shared by every head.

Memory: JAX turns the bool mask into an additive bias `[B, 1, T, S]` in q's dtype (0 or
-2^41), which cuDNN keeps for its backward pass, and the backward pass always returns the
bias's cotangent, another `[B, 1, T, S]` in q's dtype. So about `1 + 2 + 2 = 5` bytes per
(query, key) pair of each row in bf16, independent of the head count: 320 MiB at
B = 1, T = S = 8192. The scores and probabilities stay inside cuDNN's kernels (not in HBM).
Rows with one right-padded causal sequence could use `is_causal` and the seq lengths instead and
skip the mask; packed rows cannot.

cuDNN constraints: q, k, v in bfloat16 or float16 (float32 raises `ValueError` here), head dim
a multiple of 8 and at most 128 (256 on Hopper and later), and with a bias in training even T
and S: odd lengths are padded here by one query (sliced off) and one key (masked for every
query).

Fully masked query rows (padding, or a query with no earlier key): the bias makes cuDNN average
every key, including a padding key added for an odd S, and its q/k gradients would follow the
additive bias. The output of those rows is therefore replaced by the mean of the S values, as
`reference` gives them (`1 / S` of the row's cotangent to each value, nothing to q or k).

`sdpa_implementation="xla"` runs the same code through the XLA implementation of
`jax.nn.dot_product_attention`, which is how the CPU tests check this module against
`reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core import platform
from jaxrl.kernels.attention.reference import token_mask

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _check_cudnn(q, k, v):
  backend = platform.current()
  if backend != "gpu":
    raise ValueError(f"attention implementation 'cudnn' needs a CUDA GPU; the backend is "
                     f"{backend!r} (use 'xla', or 'pallas_tpu' on TPU)")
  if jnp.result_type(q, k, v) not in {jnp.dtype(d) for d in CUDNN_DTYPES}:
    raise ValueError(f"attention implementation 'cudnn' takes bfloat16 or float16 q, k, v; got "
                     f"{q.dtype}, {k.dtype}, {v.dtype} (cast them, or use 'xla')")
  if q.shape[-1] % 8:
    raise ValueError(f"attention implementation 'cudnn' needs a head dim multiple of 8; got "
                     f"{q.shape[-1]}")


def _pad_even(x, axis: int, fill):
  if x.shape[axis] % 2 == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, 1)
  return jnp.pad(x, widths, constant_values=fill)


def attention(q, k, v, q_segment, q_position, kv_segment, kv_position, kv_shared=None, *,
              scale: float, block_k=None, sdpa_implementation: str = "cudnn"):
  """Masked attention, `out [B, T, H, Dh]` in q's dtype; the same function as
  `reference.attention` (same arguments) up to float rounding.

  `block_k` is accepted for a uniform signature and ignored (cuDNN tiles itself).
  `sdpa_implementation`: `cudnn` (needs a CUDA GPU and bf16 / f16 inputs; `ValueError`
  otherwise) or `xla` (any backend and dtype: the tests' path to this module's mask and
  fully-masked-row handling).
  """
  del block_k
  if sdpa_implementation == "cudnn":
    _check_cudnn(q, k, v)
  elif sdpa_implementation != "xla":
    raise ValueError(f"sdpa_implementation must be 'cudnn' or 'xla'; got {sdpa_implementation!r}")
  t, h, kh = q.shape[1], q.shape[2], k.shape[2]
  dt = jnp.result_type(q, k, v)  # jax.nn.dot_product_attention wants one dtype
  mask = token_mask(q_segment, q_position, kv_segment, kv_position, kv_shared)  # [B, T, S]
  attends = jnp.any(mask, axis=-1)  # [B, T]: False on fully masked rows
  mask = _pad_even(_pad_even(mask, 1, False), 2, False)[:, None]  # [B, 1, Tp, Sp]
  out = jax.nn.dot_product_attention(
      *(_pad_even(x.astype(dt), 1, 0) for x in (q, k, v)), mask=mask, scale=scale,
      implementation=sdpa_implementation)[:, :t]
  # What `reference` gives a query that attends nothing: the mean of all S values of its kv
  # head (query head h reads kv head h // (H / Hkv)), with no gradient to q or k.
  mean_v = jnp.repeat(jnp.mean(v.astype(jnp.float32), axis=1), h // kh, axis=1)  # [B, H, Dh]
  out = jnp.where(attends[:, :, None, None], out, mean_v[:, None].astype(out.dtype))
  return out.astype(q.dtype)
