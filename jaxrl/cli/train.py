"""Entry point: `python -m jaxrl.train [--config path.py] [--config.key=value ...]`.

Without `--config` it runs the packaged `jaxrl/recipes/default.py`. The recipe file is loaded,
overrides are applied and the whole config is validated before anything is built, compiled or
written; every bad key is reported in one message.

Every error a user can cause and fix (`jaxrl.core.errors.UserError`: a bad key or recipe file, a
missing or malformed data or model file, a run directory that cannot be written or is in use;
and the operating system's file errors) ends as `jaxrl: <message>` on stderr with exit status 1
and no traceback: the message names what to change, and a traceback would bury it.
`--config.debug=true` or the environment variable `JAXRL_DEBUG=1` re-raises instead, for a bug
report. Anything else is a bug in jaxrl and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

from absl import app, flags, logging
from ml_collections import ConfigDict

from jaxrl import config as config_lib
from jaxrl.cli import common
from jaxrl.config import memory, out_of_memory
from jaxrl.core.errors import UserError

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "default.py")
STARTED = time.monotonic()  # "time to the first RL step" counts from here (the module's import)

# A plain string flag, loaded by `config_lib.load_recipe`: ml_collections' config-file flag loads
# its default recipe first and reloads a user's file into the same module, so a file without
# `get_config` silently ran the default recipe; and it reports a bad file as a traceback.
# Overrides are applied by `config_lib.parse_overrides`, which names every bad key at once.
_CONFIG = flags.DEFINE_string("config", None, "recipe file (configs/*.py) whose get_config() "
                              "returns the run config; default: jaxrl/recipes/default.py")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "print the resolved config and its plan "
                                  "(meshes, micro-batches, memory), then exit without running")
_DEBUG = flags.DEFINE_bool("debug", False, "show tracebacks instead of one-line `jaxrl:` errors "
                           "(as --config.debug=true or JAXRL_DEBUG=1)")
_OVERRIDES: list[str] = []
_HELP_FLAGS = ("-h", "--help", "-help", "--helpshort")

USAGE = """\
usage: python -m jaxrl.train [--config FILE] [--config.KEY=VALUE ...] [--print_config] [--debug]
       jaxrl-train [same arguments]

Trains a language model with RL (a supervised warm-up, then GRPO-family steps) as the recipe
says: jaxrl/recipes/default.py unless --config names another. Every key below can be set as
--config.KEY=VALUE; the whole config is checked before anything runs, and every error a user
can fix ends as one line `jaxrl: ...` with exit status 1.

flags:
  --config FILE      recipe file whose get_config() returns the run config (FILE:ARG passes
                     ARG to get_config)
  --print_config     print the resolved config and its plan (devices, meshes, micro-batches,
                     memory per device), then exit 0 without compiling or writing anything
  --debug            tracebacks instead of one-line errors (also JAXRL_DEBUG=1 or
                     --config.debug=true)
  -h, --help         this text
  --helpfull         every flag, absl's own included

config keys (--config.KEY=DEFAULT, then what it may hold and what it means; docs/config.md):"""


def help_text() -> str:
  """What `--help` prints: the usage, the flags and every config key (`jaxrl.config.reference`)."""
  from jaxrl.config import reference

  return f"{USAGE}\n{reference.text()}"

# File errors whose message (path and reason) tells the user what to change: a run directory or
# data file that is missing, a file where a directory belongs or the reverse, no permission, a
# full or read-only disk.
_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                   NotADirectoryError)
_USER_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _parse_flags(argv: list[str]) -> list[str]:
  if any(a in _HELP_FLAGS for a in argv[1:]):
    print(help_text())
    sys.exit(0)
  if "--helpfull" in argv[1:]:  # absl's every flag (its own handler exits 1)
    print(f"{help_text()}\n\nevery flag:\n{flags.FLAGS.get_help()}")
    sys.exit(0)
  _OVERRIDES[:] = [a for a in argv[1:] if a.startswith("--config.")]
  try:
    return flags.FLAGS([a for a in argv if not a.startswith("--config.")])
  except flags.Error as e:  # an unknown flag, --config without a file
    sys.exit(f"jaxrl: {e} (config keys are set as --config.key=value; --helpfull lists the "
             "flags)")


def _debug_requested(overrides: list[str], cfg: ConfigDict | None = None) -> bool:
  """`JAXRL_DEBUG` (anything but "", "0", "false"), the last `--config.debug=` override, or the
  recipe's `debug`; read from the raw arguments too, so a recipe that fails to load can be
  debugged."""
  if os.environ.get("JAXRL_DEBUG", "").strip().lower() not in ("", "0", "false"):
    return True
  if flags.FLAGS.is_parsed() and _DEBUG.value:
    return True
  for arg in reversed(overrides):
    if arg.startswith("--config.debug="):
      return arg.partition("=")[2].strip().lower() in ("true", "1")
  return cfg is not None and cfg.get("debug") is True


def user_message(e: BaseException) -> str | None:
  """The `jaxrl: ...` text for an error the user can fix; None for anything else (a bug)."""
  if isinstance(e, (config_lib.ConfigError, UserError, ModuleNotFoundError)):
    message = common.user_message(e)
    if message is not None:
      return message
  # A user error on the rollout thread (a bad row, too many rows skipped) reaches the trainer
  # as the pipeline's WorkerFailed, caused by it (imported here: a bad flag's message comes
  # before jax is imported).
  from jaxrl.pipeline.gate import WorkerFailed

  if isinstance(e, WorkerFailed) and isinstance(e.__cause__, UserError):
    return user_message(e.__cause__)
  if isinstance(e, _USER_OS_ERRORS) or (isinstance(e, OSError) and e.errno in _USER_ERRNOS):
    return f"jaxrl: {common.os_error_text(e)}"
  if isinstance(e, MemoryError):
    return ("jaxrl: out of host memory; a smaller rollout.num_prompts, rollout.group_size, "
            "rollout.max_new_tokens or val.batch_size needs less (--config.debug=true shows "
            "where it ran out)")
  return None


def _exit_if_user_error(e: BaseException, debug: bool) -> None:
  """Exits with the one-line message of a user error (the caller re-raises anything else)."""
  message = None if debug else user_message(e)
  if message is not None:
    sys.exit(message)


def _join(cfg: ConfigDict, settings: tuple[str, int, int, int], problems: list[str]) -> None:
  """Joins the processes; process 0 prints how.

  By the explicit `distributed.*` keys, else by what `distributed.auto` finds in the launcher's
  environment. A malformed launcher variable becomes a config problem (nothing is joined).
  """
  import jax

  from jaxrl import parallel

  # distributed_settings() has checked distributed.auto's type; a config without it is reported
  # as missing the key by validate(), so nothing is detected for it.
  section = cfg.get("distributed")
  auto = isinstance(section, ConfigDict) and section.get("auto") is True
  # distributed_settings() has checked it too (a bad value returns None before this point).
  peer_timeout_s = section.get("peer_timeout_s", 60) if isinstance(section, ConfigDict) else 60
  # Disaggregated across processes: a lost process must not end the JAX job by itself
  # (jaxrl.parallel.distributed.recover_lost_processes); validate() names a malformed value.
  mesh = cfg.get("mesh")
  rollout = mesh.get("rollout_processes", "") if isinstance(mesh, ConfigDict) else ""
  try:
    rollout_ids = config_lib.schema.process_list(rollout) if isinstance(rollout, str) else ()
  except ValueError:
    rollout_ids = ()
  recoverable = bool(rollout_ids)
  try:
    how = parallel.distributed.join(*settings, auto=auto, env=os.environ,
                                    peer_timeout_s=peer_timeout_s, recoverable=recoverable,
                                    rollout_processes=rollout_ids)
  except parallel.distributed.EnvError as e:
    problems.append(f"config.distributed.auto: {e}; --config.distributed.auto=false ignores the "
                    "launcher's variables")
    return
  if how is not None:
    # A lost or failing process ends every process, named (jaxrl.parallel.peers), except a
    # rollout process where process 0 (the coordination service) trains: the run goes on
    # without it (jaxrl.pipeline.remote.Receiver; Topology.failover).
    parallel.peers.watch(peer_timeout_s, droppable=() if 0 in rollout_ids else rollout_ids,
                         hold_exit=recoverable)
    if parallel.distributed.is_main():
      print(f"jaxrl | joined {jax.process_count()} processes ({jax.device_count()} devices) "
            f"through {how}", flush=True)


def _device_memory() -> int | None:
  """Bytes of memory this process's devices hold, for `config_lib.validate`'s size check: None
  on CPU (the devices' arrays are in host memory), 0 when the backend does not say."""
  import jax

  if jax.default_backend() == "cpu":
    return None
  try:
    return sum(int(d.memory_stats()["bytes_limit"]) for d in jax.local_devices())
  except Exception:  # no memory_stats on this backend, or no bytes_limit in it
    return 0


def _device_limit() -> int | None:
  """One device's memory (the smallest `bytes_limit` of this process's devices) for the memory
  plan, or `JAXRL_DEVICE_MEMORY_BYTES` when set; None on CPU or when the backend does not say."""
  import jax

  reported = None
  if jax.default_backend() != "cpu":
    try:
      reported = min(int(d.memory_stats()["bytes_limit"]) for d in jax.local_devices())
    except Exception:  # no memory_stats on this backend, or no bytes_limit in it
      reported = None
  return memory.device_limit(reported)


def _validate(cfg: ConfigDict, problems: list[str]) -> config_lib.MeshShape:
  """Joins the processes and validates `cfg` on the devices they have; raises ConfigError naming
  every problem, those in `problems` (bad overrides) first. A memory plan near the device's
  limit is a warning line on stderr."""
  import jax  # after flag parsing, so --help and bad flags never initialise a backend

  # Joining the processes comes first: it decides the device count the mesh is checked against.
  settings = config_lib.distributed_settings(cfg)
  if settings is not None:  # else validate() names the bad keys along with any others
    _join(cfg, settings, problems)
  notes: list[str] = []
  mesh = config_lib.validate(cfg, jax.device_count(), problems=problems,
                             num_processes=jax.process_count(), device_memory=_device_memory(),
                             device_limit=_device_limit(), backend=jax.default_backend(),
                             notes=notes)
  for note in notes:
    print(note, file=sys.stderr, flush=True)
  return mesh


def out_of_memory_message(e: BaseException, cfg: ConfigDict,
                          mesh_shape: config_lib.MeshShape | None) -> str | None:
  """The one `jaxrl: out of memory on <device>: ...` line for XLA's out-of-memory error (or an
  error it caused), with the memory plan's numbers and the keys that lower them; None for any
  other error."""
  if not out_of_memory.is_out_of_memory(e):
    return None
  import jax

  from jaxrl.config.schema import flatten

  try:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    name = device.platform if kind.lower() in ("", device.platform) else \
        f"{device.platform} ({kind})"
  except Exception:  # the backend itself is what failed
    name = "the device"
  good = flatten(cfg)
  plan = None
  if mesh_shape is not None:
    inputs = memory.inputs_from_config(good, mesh_shape, jax.default_backend(),
                                       jax.process_count())
    plan = None if inputs is None else memory.plan_memory(inputs)
  return out_of_memory.out_of_memory_message(e, plan, name, good)


def _leave(message: str | None, e: BaseException | None) -> None:
  """Ends a process of a multi-process run that failed, after telling the others
  (`jaxrl.parallel.peers`): its message (or, for a bug, its traceback) first, then every other
  process ends with a message naming this one, then this one exits 1. `os._exit`, not a normal
  exit: JAX's shutdown would wait at a barrier for processes that are gone."""
  import traceback

  from jaxrl.parallel import peers

  if message is None and e is not None:
    if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
      # A collective that failed because another process is gone: the watch names it.
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
      message = f"jaxrl: a collective failed in this process: {first}"
    else:
      traceback.print_exception(e)
      message = f"jaxrl: {type(e).__name__}: {e}"
  if message:
    print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  peers.WATCH.fail((message or "").removeprefix("jaxrl: ").splitlines()[0][:300])
  sys.stderr.flush()
  os._exit(1)


def _tune_process(cfg, problems: list[str]) -> None:
  """Process-wide settings from `cfg`, before `_validate` starts a backend (XLA reads its
  flags once, then): the CPU compile level and fusion emitters, and the host allocator. Nothing
  when the config already has problems (they are reported first)."""
  if problems:
    return
  from jaxrl.runtime import compile_cache, host_memory

  level = cfg.get("xla_cpu_opt_level")
  if type(level) is int and -1 <= level <= 3:
    compile_cache.set_cpu_opt_level(level)
  emitters = cfg.get("xla_cpu_fusion_emitters")
  if type(emitters) is bool:
    compile_cache.set_cpu_fusion_emitters(emitters)
  if cfg.get("host_malloc_tuning") is True and compile_cache.cpu_only():
    host_memory.keep_freed()  # the temporaries it is for live in host memory on a CPU only


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    sys.exit(f"jaxrl: unexpected arguments {argv[1:]}: a recipe is given as --config path.py and "
             "config keys as --config.key=value")
  if not flags.FLAGS["verbosity"].present:
    # JAX logs backend probing ("Unable to initialize backend 'tpu'") at INFO; keep the console
    # for the run's own output unless the user asks (--verbosity=0).
    logging.set_verbosity(logging.WARNING)
  debug = _debug_requested(_OVERRIDES)
  try:
    problems: list[str] = []
    cfg = config_lib.parse_overrides(config_lib.load_recipe(_CONFIG.value or DEFAULT_CONFIG),
                                     _OVERRIDES, problems)
    debug = _debug_requested(_OVERRIDES, cfg)
    config_lib.resolve_model_file(cfg, problems)  # a .gguf file: its converted directory
    _tune_process(cfg, problems)
    mesh_shape = _validate(cfg, problems)
  except Exception as e:
    _exit_if_user_error(e, debug)
    raise
  if _PRINT_CONFIG.value:  # the dry run: nothing compiled, created or written
    import jax

    from jaxrl.config import plan

    print(plan.dry_run_text(cfg, mesh_shape, jax.device_count(), jax.default_backend(),
                            jax.process_count()), flush=True)
    return

  from jaxrl.runtime import compile_cache

  from jaxrl.run import actor, driver
  from jaxrl.run.loop import TrainingHalted
  from jaxrl.run.signals import Stop
  from jaxrl.run.topology import Topology

  try:
    compile_cache.enable(cfg.compile_cache)  # before the first compilation
  except OSError as e:  # an explicit directory that could not be created
    sys.exit(f"jaxrl: config.compile_cache: {common.os_error_text(e)}")
  run_dir = cfg.run_dir or config_lib.default_run_dir(cfg.name, time.strftime("%Y%m%d-%H%M%S"))
  # SIGTERM (preemption) and SIGINT (Ctrl-C): checkpoint after the current step, exit 0.
  stop = Stop()
  signal.signal(signal.SIGTERM, stop.handler)
  signal.signal(signal.SIGINT, stop.handler)
  from jaxrl.parallel import peers

  try:
    # A rollout process of a run disaggregated across processes has an entry of its own.
    entry = actor.run if Topology.build(mesh_shape).generates_only else driver.run
    entry(cfg, run_dir, mesh_shape, stop=stop, started=STARTED)
  except BaseException as e:
    message = f"jaxrl: stopped: {e}" if isinstance(e, TrainingHalted) else \
        None if debug else user_message(e) or out_of_memory_message(e, cfg, mesh_shape)
    if peers.WATCH is not None and not isinstance(e, SystemExit):
      _leave(message, e)
    if message is not None:
      sys.exit(message)
    raise
  if peers.WATCH is not None:
    peers.WATCH.finish()  # the others no longer wait for this process


def run() -> None:
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
