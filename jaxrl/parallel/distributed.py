"""Several processes, one program: start-up and host copies of global arrays.

Every process runs the same `python -m jaxrl.train` with the same config except
`distributed.process_id`; `initialize` joins them (`jax.distributed.initialize`, gloo on CPU), after
which `jax.devices()` lists every process's devices and the mesh spans them all. Every process then
launches the same computations in the same order (the multi-controller rule), so anything that
decides what to compute (prompts, seeds, rewards, dynamic-sampling decisions) is computed
identically on every process from replicated inputs; only process 0 writes files and prints.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               timeout_s: int = 300) -> None:
  """Joins the processes of a run; a no-op for a single process."""
  if num_processes == 1:
    return
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=int(timeout_s))


def is_main() -> bool:
  """True on the process that writes files and prints (process 0)."""
  return jax.process_index() == 0


def fetch(tree):
  """Host (numpy) copies of a pytree of arrays, whole, on every process.

  Arrays this process can read entirely (fully addressable, or replicated on every device) are
  copied directly; anything else is all-gathered across processes, so every process must call
  this with the same arrays at the same point of the program.
  """

  def leaf(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(leaf, tree)
