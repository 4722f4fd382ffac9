"""Fused log-prob + rollout-KL kernel: `reference`, `xla` and `pallas` behind `fused_logprob`.

The Pallas kernels come in two layouts, `pallas_tpu` and `pallas_gpu` (sharing `pallas_common`);
`api.pallas_fused_logprob` picks one."""

from jaxrl.kernels.fused_logprob.api import (IMPLEMENTATIONS, FusedLogprob, default_impl,
                                             fused_logprob, pallas_unavailable)

__all__ = ["IMPLEMENTATIONS", "FusedLogprob", "default_impl", "fused_logprob", "pallas_unavailable"]
