"""Masked attention over packed rows (segments, positions, a shared group prompt): `reference`
(dense) and `xla` (blockwise, memory linear in the sequence) behind `attention`."""

from jaxrl.kernels.attention.api import IMPLEMENTATIONS, attention, default_impl

__all__ = ["IMPLEMENTATIONS", "attention", "default_impl"]
