"""Test setup: 8 simulated CPU devices, set before anything initialises a JAX backend."""

import os

# The CPU platform, so an install with a GPU or TPU plugin still sees the 8 CPU devices below
# (JAX_PLATFORMS=cuda, say, set by the caller, runs the suite on that backend instead).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags = os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
# XLA's LLVM optimisation level 1, what a run sets on a CPU by default (`xla_cpu_opt_level`;
# `jaxrl.runtime.compile_cache`), for the programs the tests compile in this process too: the
# suite is mostly compilation, and level 1 compiles faster than XLA's default 3.
if "--xla_backend_optimization_level" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=1"

# Runs in tests warm up for real unless a test names an `sft.cache` directory (the default "auto"
# reads this variable; set and empty means off), so no test depends on another's warm-up.
os.environ.setdefault("JAXRL_WARMUP_CACHE_DIR", "")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

from jaxrl.models import ModelConfig  # noqa: E402
from jaxrl.runtime import compile_cache  # noqa: E402

# The persistent compilation cache a run uses ("auto": $JAX_COMPILATION_CACHE_DIR, else
# ~/.cache/jaxrl/xla), for every test of this process from the start: the same program compiled
# by another test, or by the other xdist worker, loads from disk instead of compiling again.
compile_cache.enable("auto")


def tiny_model_config(**overrides) -> ModelConfig:
  """A 2-layer model small enough to compile in about a second."""
  kw = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            mlp_dim=64)
  kw.update(overrides)
  return ModelConfig(**kw)


@pytest.fixture(scope="session")
def devices():
  assert jax.device_count() == 8, "conftest must set 8 host devices before JAX starts"
  return jax.devices()
