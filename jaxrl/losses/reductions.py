"""Reductions of a per-token quantity `x [B, N]` under a loss mask `m [B, N]` to `(sum, count)`.

The loss is `sum / count` with the count taken over the *global* batch: micro-batches (and
hosts) each return their partial `(sum, count)`, the partial sums add, and one division by the
global count gives the full-batch value and gradient exactly. A row with no valid token (a
padding row) adds 0 to both. `n_i = sum_t m_it`; `x` must already be 0 wherever it should not
count (corrections zero masked tokens without changing `m`).

| name                      | sum                                   | count                     |
| ------------------------- | ------------------------------------- | ------------------------- |
| `token_mean`              | `sum_it m x`                          | `sum_it m`                |
| `seq_mean_token_mean`     | `sum_i (sum_t m x) / n_i`             | rows with `n_i > 0`       |
| `seq_mean_token_sum`      | `sum_it m x`                          | rows with `n_i > 0`       |
| `seq_mean_token_sum_norm` | `sum_it m x / norm_len` (a constant,  | rows with `n_i > 0`       |
|                           | default N; Dr. GRPO)                  |                           |

References: `token_mean` is DAPO's token-level loss (Yu et al. 2025,
https://arxiv.org/abs/2503.14476); `seq_mean_token_mean` is GRPO's original per-sequence mean
(Shao et al. 2024, https://arxiv.org/abs/2402.03300); `seq_mean_token_sum_norm` is Dr. GRPO's
constant normaliser (Liu et al. 2025, https://arxiv.org/abs/2503.20783).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core.names import REDUCTIONS


def reduce(name: str, x: jax.Array, mask: jax.Array, norm_len: int | None = None
           ) -> tuple[jax.Array, jax.Array]:
  """`(sum, count)` of `x` by the reduction `name` (see the module table), in float32."""
  mask = jnp.asarray(mask, bool)
  x = jnp.where(mask, jnp.asarray(x).astype(jnp.float32), 0.0)
  n = jnp.sum(mask, axis=-1).astype(jnp.float32)
  rows = jnp.sum((n > 0).astype(jnp.float32))
  if name == "token_mean":
    return jnp.sum(x), jnp.sum(n)
  if name == "seq_mean_token_mean":
    return jnp.sum(jnp.sum(x, axis=-1) / jnp.maximum(n, 1.0)), rows
  if name == "seq_mean_token_sum":
    return jnp.sum(x), rows
  if name == "seq_mean_token_sum_norm":
    norm = x.shape[-1] if norm_len is None else norm_len
    return jnp.sum(x) / norm, rows
  raise ValueError(f"unknown reduction {name!r}; expected one of {REDUCTIONS}")


def count(name: str, mask: jax.Array) -> jax.Array:
  """The count of `reduce(name, ., mask)`: what a global batch divides by."""
  mask = jnp.asarray(mask, bool)
  n = jnp.sum(mask, axis=-1)
  if name == "token_mean":
    return jnp.sum(n).astype(jnp.float32)
  if name in REDUCTIONS:
    return jnp.sum((n > 0).astype(jnp.float32))
  raise ValueError(f"unknown reduction {name!r}; expected one of {REDUCTIONS}")
