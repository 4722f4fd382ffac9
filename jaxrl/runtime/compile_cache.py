"""The persistent compilation cache: a second run of the same programs loads them from disk.

On by default (`compile_cache = "auto"`): `$JAX_COMPILATION_CACHE_DIR` when set, else
`$XDG_CACHE_HOME/jaxrl/xla` (`~/.cache/jaxrl/xla`). A path puts it there; `""` turns it off.
Every program is cached, however fast it compiled: a run compiles dozens of small programs
(sampling, the data plane, evaluation), and together they are most of its start-up. jaxrl's own
directory (a path, or `~/.cache/jaxrl/xla`) evicts its least recently used entries beyond
`MAX_BYTES`. `$JAX_COMPILATION_CACHE_DIR` is JAX's, shared with every JAX program that reads it,
so its size policy stays JAX's (`JAX_COMPILATION_CACHE_MAX_SIZE`, unbounded by default): JAX's
eviction reads a per-entry access-time file that a writer without eviction never makes, and would
fail every write beside one. XLA's cache key covers the program,
the devices, the backend and `XLA_FLAGS`, so runs on other device counts or instruction sets never
share an entry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

MAX_BYTES = 4 << 30


def cache_dir(setting: str, variable: str, name: str, env: Mapping[str, str] | None = None,
              empty_variable_is_off: bool = False) -> str | None:
  """The directory a cache setting means (None: no cache): `""` off; a path; `"auto"` = the
  environment `variable` when set (set and empty: off with `empty_variable_is_off`, else
  ignored), else `$XDG_CACHE_HOME/jaxrl/<name>` (`~/.cache/jaxrl/<name>`)."""
  env = os.environ if env is None else env
  setting = setting.strip()
  if not setting:
    return None
  if setting != "auto":
    return os.path.abspath(os.path.expanduser(setting))
  value = env.get(variable)
  if value is not None and (value.strip() or empty_variable_is_off):
    return os.path.abspath(os.path.expanduser(value.strip())) if value.strip() else None
  base = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxrl", name)


def resolve(setting: str, env: Mapping[str, str] | None = None) -> str | None:
  """The compilation cache directory `setting` means (None: no cache)."""
  return cache_dir(setting, "JAX_COMPILATION_CACHE_DIR", "xla", env)


def problem(setting: str, env: Mapping[str, str] | None = None) -> str | None:
  """Why an explicit cache directory cannot be used (None: fine, or "auto"/"" which never fail
  the run): it must be a directory this user can create and write."""
  if setting.strip() in ("", "auto"):
    return None
  path = resolve(setting, env)
  probe = path
  while not os.path.exists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      break
    probe = parent
  if not os.path.isdir(probe):
    return f"{probe} is not a directory"
  if not os.access(probe, os.W_OK | os.X_OK):
    return f"{probe} is not writable"
  return None


def enable(setting: str, env: Mapping[str, str] | None = None) -> str | None:
  """Points JAX's persistent cache at `resolve(setting)`; returns the directory, or None when off
  (or when "auto"'s directory cannot be created: a cache is never a reason to fail a run)."""
  import jax

  path = resolve(setting, env)
  if path is None:
    jax.config.update("jax_compilation_cache_dir", None)
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    if setting.strip() == "auto":
      return None
    raise
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if not from_environment(setting, env):
    _add_missing_access_times(path)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return path


def from_environment(setting: str, env: Mapping[str, str] | None = None) -> bool:
  """Whether `setting` means the directory `$JAX_COMPILATION_CACHE_DIR` names (JAX's, shared)."""
  env = os.environ if env is None else env
  return setting.strip() == "auto" and bool(env.get("JAX_COMPILATION_CACHE_DIR", "").strip())


def _add_missing_access_times(path: str) -> None:
  """Gives every entry without one the access-time file JAX's eviction reads (its mtime), so a
  directory a writer without eviction once filled (another JAX program, an older jaxrl) is not a
  reason for every later write to fail."""
  try:
    names = os.listdir(path)
  except OSError:
    return
  present = set(names)
  for name in names:
    if not name.endswith("-cache"):
      continue
    atime = name[: -len("-cache")] + "-atime"
    if atime in present:
      continue
    try:
      stamp = int(os.stat(os.path.join(path, name)).st_mtime * 1e9)
      with open(os.path.join(path, atime), "wb") as f:
        f.write(stamp.to_bytes(8, "little"))
    except OSError:
      pass


OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
_ACCELERATOR_MODULES = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin",
                        "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def cpu_only(env: Mapping[str, str] | None = None) -> bool:
  """Whether this process's JAX can only run on the CPU, decided without starting a backend:
  `JAX_PLATFORMS` names cpu first, or it is unset and no accelerator plugin (CUDA, ROCm) or
  libtpu is installed. In doubt, False."""
  import importlib.util

  env = os.environ if env is None else env
  platforms = env.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip().lower() == "cpu"
  for name in _ACCELERATOR_MODULES:
    try:
      if importlib.util.find_spec(name) is not None:
        return False
    except (ImportError, ValueError):
      return False
  return True


def xla_flags_with_opt_level(flags: str, level: int) -> str | None:
  """`flags` (an XLA_FLAGS value) with the CPU LLVM optimisation level `level` appended, or None
  when nothing should change: `level` is -1 (XLA's default) or `flags` already names one."""
  if level < 0 or OPT_LEVEL_FLAG in flags:
    return None
  return f"{flags} {OPT_LEVEL_FLAG}={level}".strip()


def set_cpu_opt_level(level: int) -> bool:
  """Puts `level` into `XLA_FLAGS` for a CPU-only process (`cpu_only`); XLA reads the flags when
  the first backend starts, so this must run before that. True when it changed `XLA_FLAGS`.
  XLA's own default is 3; level 1 compiles faster (issue 22's workload reached its first RL
  step 25-30% sooner cold) and ran it at the same speed with bit-identical metrics. It changes the compilation cache's
  key, so entries of one level are not reused by another."""
  if not cpu_only():
    return False
  new = xla_flags_with_opt_level(os.environ.get("XLA_FLAGS", ""), level)
  if new is None:
    return False
  os.environ["XLA_FLAGS"] = new
  return True


FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"


def xla_knows_flag(flag: str) -> bool:
  """Whether the installed jaxlib's XLA defines `flag` (e.g. "--xla_cpu_use_fusion_emitters"),
  read from its shared library without loading it: XLA aborts the process on an unknown flag in
  `XLA_FLAGS`, so a flag newer or older than the installed XLA must not be set. False when the
  library cannot be found or read."""
  import importlib.util
  import mmap

  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    return False
  # The flag table holds each name as a C string: the NUL keeps a longer flag that merely starts
  # with this name from counting.
  name = flag.lstrip("-").split("=")[0].encode() + b"\0"
  for base in spec.submodule_search_locations:
    path = os.path.join(base, "libjax_common.so")
    try:
      with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m.find(name) >= 0:
          return True
    except (OSError, ValueError):
      continue
  return False


def xla_flags_with_fusion_emitters(flags: str, enabled: bool) -> str | None:
  """`flags` (an XLA_FLAGS value) with XLA's CPU fusion emitters turned off, or None when nothing
  should change: `enabled` (XLA's default) or `flags` already names the flag."""
  if enabled or FUSION_EMITTERS_FLAG in flags:
    return None
  return f"{flags} {FUSION_EMITTERS_FLAG}=false".strip()


def set_cpu_fusion_emitters(enabled: bool) -> bool:
  """Puts `--xla_cpu_use_fusion_emitters=false` into `XLA_FLAGS` for a CPU-only process when
  `enabled` is False and the installed XLA knows the flag (`xla_knows_flag`); like
  `set_cpu_opt_level`, before the first backend starts. True when it changed `XLA_FLAGS`.

  Off, XLA generates its CPU loop fusions with its LLVM IR emitters instead of the MLIR-based
  fusion emitters. On issue 22's workload that took the cold run's peak RSS from ~910 to ~550 MiB
  (the MLIR emitters kept ~300 MiB for compiling the train step alone) and compiled faster; the
  train step ran slower (~10 ms of ~73 before the model's 2-D projections, ~6 after), and metrics
  agree to float rounding, not bit for bit (benchmarks/README.md)."""
  if not cpu_only():
    return False
  new = xla_flags_with_fusion_emitters(os.environ.get("XLA_FLAGS", ""), enabled)
  if new is None or not xla_knows_flag(FUSION_EMITTERS_FLAG):
    return False
  os.environ["XLA_FLAGS"] = new
  return True
