"""The accelerators a plan is compiled for, by name: TPU slices (`v5e-N`, `v5p-N`, `v6e-N`, named as Cloud TPU names them) and NVIDIA GPU hosts (`h100-N`, `h200-N`, N GPUs a host,
`h100-8x2` for two hosts of 8).

Each target knows one chip's HBM, its dense bf16 peak and its memory bandwidth, with the page
they come from (`Target.source`), and how to get its devices on a machine without it:
libtpu's topology descriptions (`jax.experimental.topologies.get_topology_desc`) for a TPU, and
a GPU target description (a `GpuTargetConfigProto` text written here from the card's published
figures) for the CUDA plugin. Programs compiled for those devices are the real compiler's: their
`memory_analysis()` is XLA:TPU's or XLA:GPU's per-chip figure, not a measurement.

Cloud TPU names v5p slices by TensorCores (two per chip: `v5p-8` is 4 chips) and v5e and
v6e slices by chips (`v5e-4` is 4 chips); `parse_target` takes both as Cloud TPU does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

GIB = 1 << 30
GB = 10**9

# Per chip: HBM bytes, dense bf16 FLOP/s, HBM bytes/s, and where those figures are published.
_TPU_SPECS = {
    # generation: (HBM, bf16 peak, bandwidth, TensorCores named per chip, 2D or 3D torus, source)
    "v5e": (16 * GIB, 197e12, 819e9, 1, 2,
            "cloud.google.com/tpu/docs/v5e (16 GiB HBM2, 197 TFLOPs bf16, 819 GB/s)"),
    "v5p": (95 * GIB, 459e12, 2765e9, 2, 3,
            "cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 459 TFLOPs bf16, 2,765 GB/s)"),
    "v6e": (32 * GIB, 918e12, 1640e9, 1, 2,
            "cloud.google.com/tpu/docs/v6e (32 GiB HBM, 918 TFLOPs bf16, 1,640 GB/s)"),
}
# Not offered: v4. libtpu 0.0.42's v4 topology lists each chip's two TensorCores as separate
# devices (v4:2x2x1 has 8), not the megacore chip a v4 run uses, so its per-device figures would
# be half a chip's.
# Chips of a v5e / v6e slice -> its 2D shape (Cloud TPU's accelerator types).
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
              128: (8, 16), 256: (16, 16)}

# NVIDIA SXM cards: (HBM bytes, dense bf16 FLOP/s, bandwidth, SMs, clock GHz, L2, source).
_GPU_SPECS = {
    "h100": ("NVIDIA H100 80GB HBM3", 80 * GB, 989.4e12, 3.35e12, 132, 1.98, 50 * (1 << 20),
             "nvidia.com H100 datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOPs dense bf16)"),
    "h200": ("NVIDIA H200 141GB HBM3e", 141 * GB, 989.4e12, 4.8e12, 132, 1.98, 50 * (1 << 20),
             "nvidia.com H200 datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPs dense bf16)"),
}
# Of a GPU's HBM, what XLA's allocator may hand out (jax's XLA_PYTHON_CLIENT_MEM_FRACTION
# default, 0.75, is for the client; a run that sets it to 0.9 or preallocates may use more). The
# rest is the CUDA context, cuDNN/cuBLAS workspaces and NCCL buffers.
GPU_USABLE_FRACTION = 0.75
# Of a TPU chip's HBM, what the plan keeps back for the runtime (program binaries, infeed and
# collective buffers, fragmentation): XLA:TPU reports no reserve of its own.
TPU_RESERVE_FRACTION = 0.05

# What installs each compiler (pyproject's extras).
EXTRA = {"tpu": 'pip install -e ".[tpu]"', "gpu": 'pip install -e ".[cuda]"'}


class TargetError(ValueError):
  """A target name, mesh or compiler problem, in one line for `jaxrl: ...`."""


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # as the user wrote it, normalised ("v5p-8", "h100-8")
  platform: str  # "tpu" or "gpu"
  generation: str  # "v5p", "h100", ...
  chips: int  # devices in all
  hosts: int  # processes (GPU: hosts of `chips // hosts` cards; TPU: 4 chips a host)
  hbm_bytes: int  # one chip's
  peak_flops: float  # one chip's dense bf16 FLOP/s
  hbm_bandwidth: float  # one chip's bytes/s
  source: str
  topology: str  # libtpu's topology name ("2x2x1") or the GPU topology ("1x1x8")
  device_kind: str = ""

  @property
  def usable_bytes(self) -> int:
    """One chip's HBM less the stated runtime reserve (`GPU_USABLE_FRACTION`,
    `TPU_RESERVE_FRACTION`)."""
    keep = GPU_USABLE_FRACTION if self.platform == "gpu" else 1 - TPU_RESERVE_FRACTION
    return int(self.hbm_bytes * keep)

  @property
  def reserve_note(self) -> str:
    if self.platform == "gpu":
      return (f"{GPU_USABLE_FRACTION:.0%} of HBM usable (JAX's default client memory fraction; "
              "the rest: CUDA context, cuDNN/cuBLAS workspaces, NCCL)")
    return f"{TPU_RESERVE_FRACTION:.0%} of HBM kept back for the TPU runtime"


def known() -> list[str]:
  """Examples of every family of target name."""
  return ["v5e-4", "v5e-16", "v5p-8", "v5p-32", "v6e-4", "v6e-16", "h100-1",
          "h100-8", "h200-1", "h200-8", "h100-8x2 (2 hosts of 8)"]


def _tpu_topology(gen: str, chips: int) -> str:
  if _TPU_SPECS[gen][4] == 2:
    if chips not in _SHAPES_2D:
      raise TargetError(f"{gen} slices have {', '.join(map(str, _SHAPES_2D))} chips; got {chips}")
    return "x".join(map(str, _SHAPES_2D[chips]))
  # 3D tori: 2x2x1 (4 chips), 2x2x2, then the axes doubled in turn, the last first (Cloud TPU's
  # v5p-16 is 2x2x2, v5p-32 2x2x4, v5p-64 2x4x4, v5p-128 4x4x4).
  if chips < 4 or chips & (chips - 1):
    raise TargetError(f"{gen} slices have 4, 8, 16, ... chips (a power of two); got {chips}")
  if chips == 4:
    return "2x2x1"
  shape, axis = [2, 2, 2], 2
  while math.prod(shape) < chips:
    shape[axis] *= 2
    axis = (axis - 1) % 3
  return "x".join(map(str, shape))


def parse_target(name: str) -> Target:
  """The target a name like `v5p-32` or `h100-8` names; `TargetError` lists the known ones."""
  text = name.strip().lower()
  m = re.fullmatch(r"(v5e|v5p|v6e)-(\d+)", text) or \
      re.fullmatch(r"(h100|h200)-(\d+)(?:x(\d+))?", text)
  if m is None:
    raise TargetError(f"unknown target {name!r}; known: {', '.join(known())}")
  gen, n = m.group(1), int(m.group(2))
  if gen in _TPU_SPECS:
    hbm, peak, bw, per_chip, _, source = _TPU_SPECS[gen]
    if n < per_chip or n % per_chip:
      raise TargetError(f"{name}: Cloud TPU names {gen} slices by TensorCores ({per_chip} a "
                        f"chip): use a multiple of {per_chip}")
    chips = n // per_chip
    topology = _tpu_topology(gen, chips)
    return Target(text, "tpu", gen, chips, max(chips // 4, 1), hbm, peak, bw, source, topology)
  per_host, hosts = n, int(m.group(3) or 1)
  if per_host not in (1, 2, 4, 8) or hosts < 1:
    raise TargetError(f"{name}: {gen} hosts have 1, 2, 4 or 8 GPUs (h100-8x2: 2 hosts of 8)")
  kind, hbm, peak, bw, _, _, _, source = _GPU_SPECS[gen]
  return Target(text, "gpu", gen, per_host * hosts, hosts, hbm, peak, bw, source,
                f"1x{hosts}x{per_host}", kind)


def host_target(t: Target) -> Target:
  """One host of `t`: the slice a host's own programs are compiled for (a colocated run's
  sampler on several hosts runs on each host's chips alone). A TPU host holds 4 chips, a GPU
  host `chips // hosts` cards."""
  if t.hosts == 1:
    return t
  if t.platform == "tpu":
    per_chip = _TPU_SPECS[t.generation][3]
    return parse_target(f"{t.generation}-{4 * per_chip}")
  return parse_target(f"{t.generation}-{t.chips // t.hosts}")


def gpu_target_config(t: Target) -> str:
  """The `GpuTargetConfigProto` text of `t`'s card for the CUDA plugin's deviceless compile:
  the published SM count, clock, HBM size and bandwidth, L2, compute capability 9.0, and the
  CUDA limits every sm_90 card shares."""
  kind, hbm, _, bw, sms, clock, l2, _ = _GPU_SPECS[t.generation]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(bw)}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {hbm}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{kind}"
"""


def missing_compiler(platform: str) -> str | None:
  """Why `platform`'s compiler cannot run here (its package is not installed), or None."""
  if platform == "tpu":
    if importlib.util.find_spec("libtpu") is None:
      return f"compiling for a TPU needs libtpu: {EXTRA['tpu']}"
    return None
  if not any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
    return f"compiling for an NVIDIA GPU needs the CUDA plugin: {EXTRA['gpu']}"
  return None


def prepare_environment(platform: str, environ=os.environ) -> None:
  """What the compilers need to start on a machine without the accelerator, set before JAX
  starts its backends: libtpu skips the metadata server; the CUDA plugin skips its driver
  checks and sees no GPU."""
  if platform == "tpu":
    environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")  # silences libtpu's probing warning
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Several processes may compile at once (a test suite's workers): libtpu's lock file is for
    # processes that own a real TPU.
    environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  else:
    environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")


def devices(t: Target) -> list:
  """The devices of `t` (every chip of every host) for lowering and compiling, none of them
  usable for running."""
  from jax.experimental import topologies

  if t.platform == "tpu":
    topo = topologies.get_topology_desc(topology_name=f"{t.generation}:{t.topology}",
                                        platform="tpu")
  else:
    topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(t),
                                        topology=t.topology)
  devs = list(topo.devices)
  if len(devs) != t.chips:
    raise TargetError(f"{t.name}: the compiler's topology has {len(devs)} devices, expected "
                      f"{t.chips} chips")
  return devs
