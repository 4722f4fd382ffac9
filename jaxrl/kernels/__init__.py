"""Fused kernels for the trainer's hot spots. Pure functions: jit, vmap, grad and shard_map work.

- `fused_logprob`: per-token log-prob (+ entropy, rollout KL) from hidden states and the
  unembedding without materialising the `[N, V]` logits (`xla`, `pallas`), with a dense
  `reference` they are tested against.
"""

from jaxrl.kernels.fused_logprob import (IMPLEMENTATIONS, FusedLogprob, default_impl,
                                         fused_logprob, pallas_unavailable)

__all__ = ["IMPLEMENTATIONS", "FusedLogprob", "default_impl", "fused_logprob", "pallas_unavailable"]
