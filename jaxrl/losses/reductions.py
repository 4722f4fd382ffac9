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
  """Reduces a per-token quantity to a `(sum, count)` pair by the reduction `name`.

  The loss is `sum / count` with the count of the *global* batch (`count(name, mask)` over every
  micro-batch and host), so micro-batch sums add exactly. See the module table.

  Args:
    name: one of `REDUCTIONS`: "token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
      "seq_mean_token_sum_norm".
    x: `[B, N]` per-token values (e.g. `PolicyLoss.loss`); positions where `mask` is False are
      ignored and may hold NaN.
    mask: `[B, N]` bool loss mask.
    norm_len: the constant divisor of "seq_mean_token_sum_norm"; None means N. Unused by the
      others.

  Returns:
    `(sum, count)`, two float32 scalars. `count` is this call's own (valid tokens for
    "token_mean", rows with a valid token otherwise); for an exact global loss divide the summed
    `sum` by the global `count` instead.

  Raises:
    ValueError: for an unknown reduction name.

  References:
    "token_mean": DAPO's token-level loss, Yu et al. 2025, DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale, arXiv:2503.14476. "seq_mean_token_mean": GRPO's
    per-sequence mean, Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
    "seq_mean_token_sum_norm": Dr. GRPO's constant normaliser, Liu et al. 2025, Understanding
    R1-Zero-Like Training: A Critical Perspective, arXiv:2503.20783.
  """
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
  """The count of `reduce(name, ., mask)`: what a global batch divides its summed loss by.

  Args:
    name: one of `REDUCTIONS`.
    mask: `[B, N]` bool loss mask (of the whole batch, for the global count).

  Returns:
    A float32 scalar: the number of valid tokens for "token_mean", else the number of rows with
    at least one valid token.

  Raises:
    ValueError: for an unknown reduction name.

  References:
    As for `reduce`.
  """
  mask = jnp.asarray(mask, bool)
  n = jnp.sum(mask, axis=-1)
  if name == "token_mean":
    return jnp.sum(n).astype(jnp.float32)
  if name in REDUCTIONS:
    return jnp.sum((n > 0).astype(jnp.float32))
  raise ValueError(f"unknown reduction {name!r}; expected one of {REDUCTIONS}")
