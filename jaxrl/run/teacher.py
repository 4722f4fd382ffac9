"""The teacher of on-policy distillation (`distill.teacher`): a frozen model on the train mesh.

Two sources, told apart by the directory's `config.json`:
  * a jaxrl run directory: its model as its own config describes it (built-in or Hugging Face
    architecture), with the policy of its newest usable checkpoint;
  * a Hugging Face model directory (`config.json` + safetensors), as `model.hf_path` loads one.

The teacher must read the student's tokens: the same vocabulary size, and (for a jaxrl teacher,
whose tokenizer is built from its own config) the same token ids for the same text. A mismatch
is a `ConfigError` naming both sides, raised before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from ml_collections import ConfigDict

from jaxrl.runtime import checkpoint
from jaxrl import config as config_lib
from jaxrl import parallel
from jaxrl.models import ModelConfig, abstract_model
from jaxrl.models import hf_checkpoint as hf_lib
from jaxrl.recipes import default as default_config
from jaxrl.run.inputs import make_tokenizer, task_source

KEY = f"{config_lib.PREFIX}distill.teacher"


@dataclasses.dataclass(frozen=True)
class Teacher:
  """A loaded teacher: its graph, its params (on the train mesh) and where they came from."""
  graphdef: object
  params: object
  model_cfg: ModelConfig
  source: str  # "<dir> (jaxrl run, checkpoint <step>)" or "<dir> (Hugging Face)"


def is_run_dir(path: str) -> bool:
  """A jaxrl run directory (its config.json is a run config), not a model directory."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(saved, dict) and "model" in saved and "rollout" in saved


def load(cfg: ConfigDict, student_tok, student_vocab: int, mesh) -> Teacher:
  """The teacher `cfg.distill.teacher` names, placed on `mesh`; `ConfigError` when its
  vocabulary or tokenizer differs from the student's (`student_tok`, whose model has
  `student_vocab` embedding rows)."""
  path = cfg.distill.teacher
  if not is_run_dir(path):
    model_cfg, _, params = _hf(path, cfg, mesh)
    if model_cfg.vocab_size != student_vocab:
      raise config_lib.ConfigError([
          f"{KEY}: the teacher's vocabulary ({model_cfg.vocab_size}, "
          f"{os.path.join(path, 'config.json')} vocab_size) differs from the student's "
          f"({student_vocab}); distillation needs the same tokenizer"])
    graphdef, _ = abstract_model(model_cfg)
    return Teacher(graphdef, params, model_cfg, f"{path} (Hugging Face)")

  with open(os.path.join(path, "config.json")) as f:
    saved = ConfigDict(config_lib.merge_saved(default_config.get_config().to_dict(),
                                                json.load(f)))
  tok = make_tokenizer(saved, task_source(saved))
  if tok.vocab_size != student_tok.vocab_size or _pieces(tok) != _pieces(student_tok):
    raise config_lib.ConfigError([
        f"{KEY}: the teacher run's tokenizer ({tok.vocab_size} tokens, from its task "
        f"{saved.task.name!r}"
        + (f" and {saved.model.hf_path}" if saved.model.hf_path else "")
        + f") differs from the student's ({student_tok.vocab_size} tokens, task "
        f"{cfg.task.name!r}); distillation needs the same tokenizer"])
  if saved.model.hf_path:
    model_cfg, _, params = _hf(saved.model.hf_path, saved, mesh)
  else:
    model_cfg = ModelConfig.from_config(saved.model, tok.vocab_size)
    _, params = abstract_model(model_cfg)  # shapes only: the checkpoint fills them
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                          params, parallel.param_shardings(params, mesh))
  if model_cfg.vocab_size != student_vocab:
    raise config_lib.ConfigError([
        f"{KEY}: the teacher's vocabulary ({model_cfg.vocab_size}) differs from the student's "
        f"({student_vocab}); distillation needs the same tokenizer"])
  graphdef, _ = abstract_model(model_cfg)
  directory = checkpoint.checkpoint_dir(path)
  if not os.path.isdir(directory) or not checkpoint.complete_steps(directory):
    raise config_lib.ConfigError([f"{KEY}: no checkpoint in {directory}"])
  step, _ = checkpoint.choose_step(directory, None, say=lambda s: None)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        params)
  reader = checkpoint.Checkpointer(directory, read_only=True)
  try:
    _, params = reader.restore_params(step, target)
  finally:
    reader.close()
  return Teacher(graphdef, params, model_cfg, f"{path} (jaxrl run, checkpoint {step})")


def _pieces(tok) -> list[str]:
  """What each id means: its text (the same ids decoding to the same text is the same
  tokenizer, whether built-in characters or a tokenizer.json)."""
  piece = getattr(tok, "id_to_token", None)
  return [piece(i) if piece is not None else tok.decode([i]) for i in range(tok.vocab_size)]


def _hf(path: str, cfg: ConfigDict, mesh):
  try:
    model_cfg, tensors, params = hf_lib.load_hf(path, mesh=mesh,
                                                param_dtype=cfg.model.param_dtype,
                                                scan_layers=cfg.model.scan_layers)
  except (hf_lib.HFCheckpointError, ValueError, NotImplementedError) as e:
    raise config_lib.ConfigError([f"{KEY}: {e}"]) from None
  return (dataclasses.replace(model_cfg, dtype=cfg.model.dtype, attention=cfg.model.attention),
          tensors, params)
