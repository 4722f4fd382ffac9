"""The platform a program is being built for: the seam that lets the run's own builders compile
for a TPU topology or a GPU target description on a CPU (`jaxrl.aot`).

Every choice that depends on the backend (an implementation's `"auto"`, whether a Pallas kernel
is interpreted or compiled, the KV cache's default dtype, the sampler's fused sampling step)
reads `current()` when the program is traced, never `jax.default_backend()` directly. A run
never sets it, so it is JAX's default backend there; `building_for(devices)` sets it to the
platform of the devices a program is lowered for, for the code inside the `with` block of this
thread (a `contextvars.ContextVar`: a rollout thread of a real run is not affected).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax

# What `jax.Device.platform` says of a device -> the name jaxrl's choices use (JAX's backend
# names: a CUDA or ROCm device is "gpu" to `jax.default_backend()`).
_PLATFORM_NAMES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxrl_target_platform",
                                                                     default=None)


def platform_of(devices: Sequence | str) -> str:
  """"cpu", "gpu" or "tpu": of a platform name, or of a list of devices (all of one platform)."""
  if isinstance(devices, str):
    name = devices
  else:
    names = {getattr(d, "platform", None) for d in devices}
    if len(names) != 1:
      raise ValueError(f"devices of several platforms: {sorted(map(str, names))}")
    name = names.pop()
  if name not in _PLATFORM_NAMES:
    raise ValueError(f"unknown platform {name!r}; expected one of {sorted(_PLATFORM_NAMES)}")
  return _PLATFORM_NAMES[name]


def current() -> str:
  """The platform the program being traced is built for: the innermost `building_for` of this
  thread, else JAX's default backend."""
  target = _TARGET.get()
  return jax.default_backend() if target is None else target


def is_target_set() -> bool:
  """Whether a `building_for` block is active in this thread (a program built for devices other
  than this process's backend)."""
  return _TARGET.get() is not None


@contextlib.contextmanager
def building_for(devices: Sequence | str) -> Iterator[str]:
  """Within the block, `current()` is the platform of `devices` (a device list or a platform
  name). Lower a program inside it: its choices are traced for that platform."""
  token = _TARGET.set(platform_of(devices))
  try:
    yield _TARGET.get()
  finally:
    _TARGET.reset(token)
