"""Train/sampler mismatch metrics: how far the trainer's recompute `lp_old` is from the sampler's
`lp_gen` on the tokens actually trained. Logged every step; all constants (no gradient).

With `err_t = |lp_gen_t - lp_old_t|`, `Delta_t = lp_old_t - lp_gen_t` (clamped to +-20),
`rho_t = exp(Delta_t)`, valid rows = rows with at least one masked-in token:

| metric                                  | definition                                          |
| --------------------------------------- | --------------------------------------------------- |
| `mismatch/token_mult_prob_error`        | token mean of `exp(err)` (1 = identical; > 1.05 is   |
|                                         | suspicious)                                         |
| `mismatch/seq_mult_prob_error/{mean,    | over valid rows of `E_i = mean_t exp(err_t)`         |
| min,max}`                               |                                                     |
| `mismatch/gen_kl`                       | token mean of k3 KL(P_gen || P_train):              |
|                                         | `exp(Delta) - 1 - Delta`                            |
| `mismatch/abs_diff/{mean,max}`          | of `err`                                            |
| `mismatch/is_ratio/{mean,min,max}`      | of `rho`                                            |
| `mismatch/num_masked_seqs`              | rows with `E_i > threshold` (only with a threshold) |

With `seq_threshold`, rows whose `E_i` exceeds it are returned as `keep_rows = False` so the
caller drops them from the loss; NaN/inf at masked positions never enter any metric.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses import stats as st

_CLAMP = 20.0


def mismatch_metrics(lp_old: jax.Array, lp_gen: jax.Array, mask: jax.Array,
                     seq_threshold: float | None = None) -> tuple[st.Stats, jax.Array]:
  """Train/sampler mismatch metrics, and the rows kept under a sequence-error threshold.

  Args:
    lp_old: `[B, N]` the trainer's recompute of the sampled tokens' log-probs.
    lp_gen: `[B, N]` the sampler's log-probs of the same tokens.
    mask: `[B, N]` bool loss mask; masked positions may hold NaN/inf.
    seq_threshold: rows whose `E_i = mean_t exp(|lp_gen - lp_old|)` exceeds it are dropped;
      None keeps every row.

  Returns:
    `(stats, keep_rows)`: a `Stats` partial with the `mismatch/*` metrics of the module table
    (means as `(sum, count)` pairs, extrema, and with a threshold the `mismatch/num_masked_seqs`
    sum), and `keep_rows`, `[B]` bool, False for the rows to drop from the loss.

  References:
    `mismatch/gen_kl` is the k3 estimator of Schulman 2020, Approximating KL Divergence (blog),
    http://joschu.net/blog/kl-approx.html; the other metrics cite no paper.
  """
  mask = jnp.asarray(mask, bool)
  lp_old = jax.lax.stop_gradient(jnp.asarray(lp_old, jnp.float32))
  lp_gen = jnp.asarray(lp_gen, jnp.float32)
  delta = jnp.where(mask, jnp.clip(lp_old - lp_gen, -_CLAMP, _CLAMP), 0.0)
  err = jnp.abs(delta)
  mult = jnp.where(mask, jnp.exp(err), 0.0)
  rho = jnp.exp(delta)
  n = jnp.sum(mask, axis=-1).astype(jnp.float32)
  rows = n > 0
  seq_err = jnp.sum(mult, axis=-1) / jnp.maximum(n, 1.0)
  gen_kl = jnp.where(mask, jnp.exp(delta) - 1.0 - delta, 0.0)
  keep_rows = jnp.ones(rows.shape, bool)
  sums = {}
  if seq_threshold is not None:
    keep_rows = ~(rows & (seq_err > seq_threshold))
    sums["mismatch/num_masked_seqs"] = jnp.sum((~keep_rows).astype(jnp.float32))
  out = st.Stats(
      means={
          "mismatch/token_mult_prob_error": st.masked_mean(mult, mask),
          "mismatch/seq_mult_prob_error/mean": st.masked_mean(seq_err, rows),
          "mismatch/gen_kl": st.masked_mean(gen_kl, mask),
          "mismatch/abs_diff/mean": st.masked_mean(err, mask),
          "mismatch/is_ratio/mean": st.masked_mean(rho, mask),
      },
      sums=sums,
      maxes={
          "mismatch/seq_mult_prob_error/max": st.masked_max(seq_err, rows),
          "mismatch/abs_diff/max": st.masked_max(err, mask),
          "mismatch/is_ratio/max": st.masked_max(rho, mask),
      },
      mins={
          "mismatch/seq_mult_prob_error/min": st.masked_min(seq_err, rows),
          "mismatch/is_ratio/min": st.masked_min(rho, mask),
      },
  )
  return out, keep_rows
