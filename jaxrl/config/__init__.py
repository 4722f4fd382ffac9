"""Run configs: what a run may be asked to do, checked before anything is built.

By job: `schema` (keys, types, ranges), `validation` (`validate`: every problem of a config at
once, `distributed_settings`), `mesh` (`MeshShape` and the device split), `microbatch`
(micro-batch planning), `preflight` (what the run touches outside the config: files, memory),
`loader` (`load_recipe`, `--config path.py`), `overrides` (`parse_overrides`,
`--config.a.b=value`) and `saved` (a run's config.json). The rest of jaxrl uses the names
re-exported here (`from jaxrl import config as config_lib`). No jax is imported.
"""

from jaxrl.config.mesh import MeshShape, mirror_folds
from jaxrl.config.microbatch import resolve_microbatches, run_microbatches, shared_prompts
from jaxrl.config.overrides import parse_overrides
from jaxrl.config.preflight import RUN_ROOT, default_run_dir, resolve_model_file
from jaxrl.config.loader import RecipeError, load_recipe
from jaxrl.config.saved import merge_saved, to_dict
from jaxrl.config.schema import PREFIX, ConfigError
from jaxrl.config.validation import distributed_settings, validate

__all__ = [
    "PREFIX", "RUN_ROOT", "ConfigError", "MeshShape", "RecipeError", "default_run_dir",
    "distributed_settings", "load_recipe", "merge_saved", "mirror_folds", "parse_overrides",
    "resolve_microbatches", "resolve_model_file", "run_microbatches", "shared_prompts", "to_dict", "validate",
]
