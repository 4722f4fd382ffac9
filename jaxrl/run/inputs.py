"""What a run reads its prompts and text with, from its config alone: the task source and the
tokenizer. The run's parts and a distillation teacher's check both build them."""

from __future__ import annotations

from jaxrl import config as config_lib
from jaxrl.data.sources import MixedSource
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs import make_source


def task_source(cfg):
  """The task source of `task.name`: one registered task, or several joined by "+" mixed per
  row (a source drawn per training row with `task.weights`; evaluation covers every task)."""
  names = cfg.task.name.split("+")
  if len(names) == 1:
    return make_source(names[0], cfg)
  # One weight per task is checked by config.validate.
  weights = [float(w) for w in cfg.task.weights.split(",")] if cfg.task.weights else None
  return MixedSource([make_source(n, cfg) for n in names], weights, seed=cfg.seed)


def make_tokenizer(cfg, source):
  """The model's own tokenizer with `model.hf_path`, else a character tokenizer over the task's
  alphabet (the built-in tasks say which characters their text can hold)."""
  if cfg.model.hf_path:
    # The `hf` extra (tokenizers, jinja2): imported only for a run that reads a model directory.
    from jaxrl.data.hf_tokenizer import HFTokenizer, HFTokenizerError
    try:
      return HFTokenizer.from_dir(cfg.model.hf_path,
                                  use_chat_template=cfg.tokenizer.chat_template,
                                  system_prompt=cfg.tokenizer.system_prompt or None)
    except HFTokenizerError as e:  # names the file and the field
      raise config_lib.ConfigError([f"config.model.hf_path: {e}"]) from None
  return CharTokenizer(source.alphabet)
