"""jaxrl's side of `benchmarks/vs_trl.py`: issue 22's GRPO workload as a recipe file.

Registers task `partial_add` (the 512 prompts `"{a}+{b}="` of `vs_trl.make_prompts`, graded by
`vs_trl.partial`, the same code the TRL side calls) the way README "Your own task" shows, and maps
every GRPO setting of the TRL run onto jaxrl's keys. The model directory comes from the command
line (`--config.model.hf_path=<dir>`, written by `vs_trl.py make-model`):

  python -m jaxrl.train --config benchmarks/vs_trl_recipe.py --config.model.hf_path=<dir>

What has no jaxrl key, or differs, is listed in `vs_trl.DIFFERENCES`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vs_trl import GRPO, MAX_PROMPT_TOKENS, make_prompts, partial  # noqa: E402

from jaxrl.recipes.default import get_config as default_config  # noqa: E402
from jaxrl.data.sources import SplitSource  # noqa: E402
from jaxrl.envs import Task, register, single_turn_result  # noqa: E402


class PartialAddSource(SplitSource):
  """The 512 rows, all in `train`; `val` is the same rows (validation is off in this recipe, but
  a source has both splits)."""
  name, alphabet = "partial_add", "0123456789+="

  def __init__(self):
    rows = [Task("partial_add", prompt, {"answer": answer}, f"partial_add/{i}")
            for i, (prompt, answer) in enumerate(make_prompts())]
    self._splits = {"train": rows, "val": rows}


@register("partial_add", source=lambda cfg: PartialAddSource())
class PartialAddEnvironment:
  """`partial(response, answer)` for every row, truncated ones included (TRL rewards them too:
  `mask_truncated_completions=False`); `env/metadata/chars` is the response's length in
  characters, the completion length both sides report."""
  max_turns = 1

  def step(self, turns):
    rewards = [partial(t.response, t.task.data["answer"]) for t in turns]
    return single_turn_result(rewards, metadata=[{"chars": len(t.response)} for t in turns])


def get_config():
  cfg = default_config()
  cfg.name = cfg.task.name = "partial_add"
  cfg.tokenizer.chat_template = False  # plain "<bos>12+34=": the tokenizer has no template
  cfg.sft.enabled = False  # no warm-up: RL from the saved initialisation, as TRL starts
  cfg.rollout.num_prompts = GRPO["prompts"]
  cfg.rollout.group_size = GRPO["group_size"]
  cfg.rollout.max_prompt_len = MAX_PROMPT_TOKENS
  cfg.rollout.max_new_tokens = GRPO["max_new_tokens"]
  cfg.rollout.temperature = GRPO["temperature"]
  cfg.rollout.top_k, cfg.rollout.top_p = 0, 1.0
  cfg.train.steps = 100
  cfg.train.learning_rate = GRPO["lr"]
  cfg.train.warmup_steps = 0
  cfg.train.lr_schedule = "constant"
  cfg.train.b1, cfg.train.b2 = GRPO["betas"]
  cfg.train.adam_eps = GRPO["adam_eps"]
  cfg.train.weight_decay = 0.0
  cfg.train.grad_clip = GRPO["grad_clip"]
  cfg.train.num_microbatches = 1  # the whole batch in one pass, as TRL's one accumulation step
  cfg.model.remat = "none"  # no gradient checkpointing
  cfg.model.param_dtype = cfg.model.dtype = "float32"
  cfg.advantage.estimator = "grpo"  # TRL scale_rewards="group"
  cfg.advantage.std_ddof = 1  # TRL's group std is the sample std
  cfg.advantage.eps = GRPO["adv_eps"]
  cfg.loss.policy = "ppo"
  cfg.loss.eps_low = cfg.loss.eps_high = GRPO["epsilon"]
  cfg.loss.reduction = "token_mean"  # TRL loss_type="dapo"
  cfg.ref_kl.coef = 0.0  # TRL beta=0
  cfg.rollout_kl.coef = 0.0
  cfg.loss.entropy_coef = 0.0
  # Validation off: no pass before, during or after RL.
  cfg.val.at_start = cfg.val.at_end = False
  cfg.val.every = 10**9
  # Checkpoints cannot be turned off: every=0 leaves the one save at the end.
  cfg.checkpoint.every = 0
  cfg.checkpoint.keep = 1
  cfg.resume = "none"
  cfg.overwrite = True
  return cfg
