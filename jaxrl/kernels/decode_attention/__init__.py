"""Single-token decode attention against a KV cache that reads only each row's filled slots, in
the cache's dtype: `reference` (dense), `xla`, `pallas_tpu`, `pallas_gpu` behind one api."""

from jaxrl.kernels.decode_attention.api import IMPLEMENTATIONS, decode_attention, default_impl

__all__ = ["IMPLEMENTATIONS", "decode_attention", "default_impl"]
