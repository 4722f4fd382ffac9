"""Helpers for tests that start several processes: a free local port, and waiting for a group of
processes with every one killed if any outlives the timeout."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def communicate(procs: list[subprocess.Popen], timeout: float, check: bool = True) -> list[str]:
  """Each process's combined output; a timeout kills them all and re-raises. With `check`,
  asserts every process exited 0, showing the tail of a failed one's output."""
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  if check:
    for i, (p, out) in enumerate(zip(procs, outs)):
      assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
  return outs
