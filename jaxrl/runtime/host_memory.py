"""The host allocator's settings for a training process (glibc's malloc; elsewhere nothing).

XLA's CPU runtime allocates every execution's temporary buffer afresh. glibc serves an allocation
above its mmap threshold (at most 32 MiB however it adapts) with a new mapping and unmaps it on
free, so a program with a larger temporary buffer page-faults through all of it again on every
call: issue 22's train step (41 MB of temporaries) spent ~30% of its time there. `keep_freed`
raises the mmap and trim thresholds, so such buffers come from the heap and stay mapped between
calls. The cost is resident memory: freed memory is kept for reuse rather than returned to the
system (issue 22's workload: peak RSS 450 -> ~510 MiB with a warm compilation cache).

`python -m jaxrl.train` applies it at start on a CPU-only install (`host_malloc_tuning`, default
on; on an accelerator XLA's temporaries are device memory) unless the
environment already tunes malloc (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
`MALLOC_TOP_PAD_`, or `glibc.malloc` in `GLIBC_TUNABLES`): the user's settings win.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations below this come from the heap; freed memory at a heap's top is returned to the
# system only beyond this much. 512 MiB: every temporary buffer of the CPU programs jaxrl
# trains with, with room.
THRESHOLD_BYTES = 512 << 20
ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_tuned(env: Mapping[str, str] | None = None) -> bool:
  """Whether the environment already sets glibc's malloc thresholds."""
  env = os.environ if env is None else env
  return any(env.get(k, "").strip() for k in ENV_KEYS) or \
      "glibc.malloc" in env.get("GLIBC_TUNABLES", "")


def keep_freed(threshold: int = THRESHOLD_BYTES, env: Mapping[str, str] | None = None) -> bool:
  """Sets glibc's mmap and trim thresholds to `threshold` bytes for this process. True when
  set; False on another C library or platform, or when the environment tunes malloc itself
  (`user_tuned`). Safe to call at any time; it affects allocations made after it."""
  if not sys.platform.startswith("linux") or user_tuned(env):
    return False
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  value = min(int(threshold), 2**31 - 1)
  return bool(mallopt(M_MMAP_THRESHOLD, value)) and bool(mallopt(M_TRIM_THRESHOLD, value))
