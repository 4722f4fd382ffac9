"""Fused log-prob + rollout-KL kernel: `reference`, `xla` and `pallas` behind `fused_logprob`."""

from jaxrl.kernels.fused_logprob.api import (IMPLEMENTATIONS, FusedLogprob, default_impl,
                                             fused_logprob, pallas_unavailable)

__all__ = ["IMPLEMENTATIONS", "FusedLogprob", "default_impl", "fused_logprob", "pallas_unavailable"]
