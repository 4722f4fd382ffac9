"""Entry point: `python -m jaxrl.train [--config path.py] [--config.key=value ...]`.

Without `--config` it runs the packaged `jaxrl/configs/default.py`. Overrides are applied and the
whole config is validated before anything is built or compiled; every bad key is reported in one
message.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from jaxrl import config as config_lib

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.py")

# `sys_argv=argv[:1]`: overrides are applied by `config_lib.parse_overrides`, which names every
# bad key at once instead of ml_collections' traceback for the first one.
_CONFIG = config_flags.DEFINE_config_file("config", default=DEFAULT_CONFIG, sys_argv=sys.argv[:1],
                                          help_string="recipe file (configs/*.py)")
_OVERRIDES: list[str] = []


def _parse_flags(argv: list[str]) -> list[str]:
  _OVERRIDES[:] = [a for a in argv[1:] if a.startswith("--config.")]
  return flags.FLAGS([a for a in argv if not a.startswith("--config.")])


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
  try:
    how = parallel.distributed.join(*settings, auto=auto, env=os.environ)
  except parallel.distributed.EnvError as e:
    problems.append(f"config.distributed.auto: {e}; --config.distributed.auto=false ignores the "
                    "launcher's variables")
    return
  if how is not None and parallel.distributed.is_main():
    print(f"jaxrl | joined {jax.process_count()} processes ({jax.device_count()} devices) "
          f"through {how}", flush=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # JAX logs backend probing ("Unable to initialize backend 'tpu'") at INFO; keep the console
    # for the run's own output unless the user asks (--verbosity=0).
    logging.set_verbosity(logging.WARNING)
  import jax  # after flag parsing, so --help and bad flags never initialise a backend

  from jaxrl import trainer

  try:
    problems: list[str] = []
    cfg = config_lib.parse_overrides(_CONFIG.value, _OVERRIDES, problems)
    # Joining the processes comes first: it decides the device count the mesh is checked against.
    settings = config_lib.distributed_settings(cfg)
    if settings is not None:  # else validate() names the bad keys along with any others
      _join(cfg, settings, problems)
    mesh_shape = config_lib.validate(cfg, jax.device_count(), problems=problems,
                                     num_processes=jax.process_count())
  except config_lib.ConfigError as e:
    sys.exit(f"jaxrl: invalid config\n{e}")
  run_dir = cfg.run_dir or os.path.join(
      "runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
  # SIGTERM (preemption) and SIGINT (Ctrl-C): checkpoint after the current step, exit 0.
  stop = trainer.Stop()
  signal.signal(signal.SIGTERM, stop.handler)
  signal.signal(signal.SIGINT, stop.handler)
  try:
    trainer.run(cfg, run_dir, mesh_shape, stop=stop)
  except config_lib.ConfigError as e:
    sys.exit(f"jaxrl: invalid config\n{e}")
  except trainer.TrainingHalted as e:
    sys.exit(f"jaxrl: stopped: {e}")


def run() -> None:
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
