"""What each key of a run config may hold, checked one key at a time.

The schema is `jaxrl.recipes.default`: a key it lacks is unknown (with a suggestion), a key it
has must be there with the default's type. `RULES` then bounds the values of well-typed keys
(ranges, choices). `jaxrl.config.validate` runs these first and adds the checks that span
several keys (mesh, batch divisibility, losses, tasks); `jaxrl.config.overrides` uses the same key
table and suggestions for `--config.` arguments. No jax is imported here.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ml_collections import ConfigDict

from jaxrl.core.errors import UserError
from jaxrl.core.names import (ADVANTAGE_ESTIMATORS, AUTO_LAG, ATTENTION_IMPLS, CORRECTION_BAND_KEYS,
                              DECODE_ATTENTION_IMPLS,
                              CORRECTION_CAPS, DTYPES, KL_ESTIMATORS, KL_REDUCTIONS,
                              KV_CACHE_DTYPES, LORA_TARGETS,
                              LR_SCHEDULES, MOE_DISPATCHES, POLICY_LOSSES, REDUCTIONS, REMAT_POLICIES,
                              REWARD_FIELDS)

MESH_AXES = ("data", "fsdp", "tensor")
PREFIX = "config."

# (predicate, requirement): the requirement completes "must be ..." in a problem line.
Rule = tuple[Callable[[Any], bool], str]


class ConfigError(UserError, ValueError):
  """All problems found in a config; one line each, starting with the full `config.` key. One
  problem is its line alone; several follow a header line that counts them."""

  def __init__(self, problems: list[str]):
    self.problems = list(problems)
    n = len(self.problems)
    if n == 1:
      super().__init__(self.problems[0])
    else:
      super().__init__("\n".join([f"{n} problems found in config:", *self.problems]))


def _gt(lo):
  return lambda v: v > lo, f"> {lo}"


def _ge(lo):
  return lambda v: v >= lo, f">= {lo}"


def _in(lo, hi, lo_open=False, hi_open=False):
  pred = lambda v: (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
  return pred, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _one_of(choices):
  return lambda v: v in choices, f"one of {sorted(choices)}"


def _floats_ok(text: str) -> bool:
  try:
    w = [float(x) for x in text.split(",")]
  except ValueError:
    return False
  return all(x >= 0 and x == x and x != float("inf") for x in w) and sum(w) > 0


def _json_object_ok(text: str) -> bool:
  try:
    return isinstance(json.loads(text), dict)
  except (ValueError, RecursionError):  # RecursionError: nested past the parser's stack
    return False


def parse_profile_steps(text: str) -> tuple[int, int] | None:
  """`profile.steps` as `(first, last)` RL steps, None for "" (off); ValueError when malformed
  (it must be "A:B" with integers 1 <= A <= B)."""
  if text == "":
    return None
  first, sep, last = text.partition(":")
  try:
    a, b = int(first), int(last)
  except ValueError:
    a = b = 0
  if not sep or a < 1 or b < a:
    raise ValueError(f"profile.steps must be '' (off) or 'A:B' with whole numbers 1 <= A <= B "
                     f"(RL steps A to B), got {text!r}")
  return a, b


def process_list(text: str) -> tuple[int, ...]:
  """`mesh.rollout_processes` as process indices ('' -> ()); ValueError when malformed."""
  if not text.strip():
    return ()
  ids = tuple(int(t) for t in text.split(","))
  if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
    raise ValueError(text)
  return ids


def _process_list_ok(text: str) -> bool:
  try:
    process_list(text)
  except ValueError:
    return False
  return True


def _profile_steps_ok(text: str) -> bool:
  try:
    parse_profile_steps(text)
  except ValueError:
    return False
  return True


SEED_MAX = 2**32 - 1

# Log-probs are float32 `log_softmax(logits / T)`: once |logits / T| passes ~2**31, float32's
# spacing there (256) makes `exp(z - logsumexp(z))` overflow in the fused log-prob kernel and
# every update is skipped as non-finite (measured: first non-finite T = max|logit| / 2.7e9, e.g.
# 5.6e-6 for logits up to 1.5e4, 5.6e-8 up to 150), and well before that the rounding of z
# swamps the log-probs (spacing 1 at 2**24). 1e-4 keeps logits up to 1e3 (far above a trained
# LM's) within 1e7 and is already greedy in effect.
MIN_TEMPERATURE = 1e-4
_TINY_T = ("below it float32 log-probs of logits / T lose their precision and then overflow, "
           "skipping every update")

# (key, rule); checked only when the key exists with the right type.
DISTRIBUTED_RULES: list[tuple[str, Rule]] = [
    ("distributed.auto", (lambda v: True, "a bool")),
    ("distributed.coordinator_address", (lambda v: True, "a string")),
    ("distributed.num_processes", _ge(1)),
    ("distributed.process_id", _ge(0)),
    ("distributed.init_timeout_s", _gt(0)),
    ("distributed.peer_timeout_s", _ge(5)),
]

RULES: list[tuple[str, Rule]] = [
    # The largest seed every consumer takes whole: numpy's generators take any int, but a JAX
    # key (64-bit ints off) keeps 32 bits, so seed 2**32 would sample exactly like 0, and past
    # 2**63 - 1 JAX and the model's initialiser raise OverflowError.
    ("seed", _ge(0)),
    ("seed", (lambda v: v <= SEED_MAX, f"<= {SEED_MAX} (2**32 - 1: a JAX key holds 32 bits of "
              "it)")),
    ("log_every", _ge(1)),
    ("xla_cpu_opt_level", _in(-1, 3)),
    *((f"model.{k}", _ge(1)) for k in
      ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")),
    ("model.vocab_size", _ge(0)),
    ("model.num_experts", _ge(0)),
    ("model.num_experts_per_tok", _ge(1)),
    ("model.moe_intermediate_size", _ge(1)),
    ("model.moe_dispatch", _one_of(MOE_DISPATCHES)),
    ("moe.routing_replay", _one_of(("none", "rollout"))),
    ("model.moe_capacity_factor", _ge(0)),
    ("model.head_dim", (lambda v: v % 2 == 0, "even (RoPE rotates pairs of dims)")),
    ("model.rope_theta", _gt(0)),
    ("model.rms_eps", _gt(0)),
    ("model.param_dtype", _one_of(DTYPES)),
    ("model.dtype", _one_of(DTYPES)),
    ("model.remat", _one_of(set(REMAT_POLICIES))),
    ("model.attention", _one_of(ATTENTION_IMPLS)),
    ("model.decode_attention", _one_of(DECODE_ATTENTION_IMPLS)),
    ("model.init_std", _gt(0)),
    ("model.lora.rank", _ge(0)),
    ("model.lora.alpha", _gt(0)),
    ("model.lora.dropout", _in(0, 1, hi_open=True)),
    ("model.lora.targets", (lambda v: bool(v.strip()) and all(
        t.strip() in LORA_TARGETS for t in v.split(",")),
        f"a comma-separated list of {', '.join(LORA_TARGETS)}")),
    ("model.lora.learning_rate", _ge(0)),
    ("model.lora.rollout", _one_of(("apply", "merge"))),
    ("rollout.dtype", _one_of(("auto", "float32", "bfloat16"))),
    ("rollout.kv_cache_dtype", _one_of(KV_CACHE_DTYPES)),
    ("rollout.engine", _one_of(("static", "continuous"))),
    ("rollout.sync", _one_of(("full", "delta"))),
    ("rollout.engine_slots", _ge(0)),
    ("rollout.engine_steps", _ge(1)),
    ("task.num_digits", (lambda v: 1 <= v <= 4, "in [1, 4] (task 'add' permutes all 10^(2n) "
                         "operand pairs once: 5 digits would need 80 GB)")),
    ("task.max_operand", _ge(0)),
    ("task.dev_size", _ge(1)),
    ("task.val_size", _ge(1)),
    ("sft.learning_rate", _gt(0)),
    ("sft.batch_size", _ge(1)),
    ("sft.stop_accuracy", _in(0, 1)),
    ("sft.eval_every", _ge(1)),
    ("sft.max_steps", _ge(0)),
    ("rollout.num_prompts", _ge(1)),
    ("rollout.group_size", (lambda v: v >= 2, ">= 2 (group-normalised advantages need 2)")),
    ("rollout.max_prompt_len", _ge(1)),
    ("rollout.max_new_tokens", _ge(1)),
    # Greedy decoding (temperature 0, or top-k 1) gives every sample of a prompt the same tokens
    # and so the same reward: every group-normalised advantage would be 0 and nothing learned.
    ("rollout.temperature", (lambda v: v >= MIN_TEMPERATURE, f">= {MIN_TEMPERATURE} (0 is greedy: "
                             "the samples of one prompt would be identical, so every advantage "
                             f"would be 0; {_TINY_T})")),
    ("rollout.top_k", (lambda v: v == 0 or v >= 2, "0 (off) or >= 2 (top-1 sampling is greedy: "
                       "the samples of one prompt would be identical, every advantage 0)")),
    ("rollout.top_p", _in(0, 1, lo_open=True)),
    ("rollout.lag", (lambda v: v == AUTO_LAG or v >= 0, f">= 0 or {AUTO_LAG!r}")),
    ("rollout.max_lag", _ge(0)),
    ("rollout.lag_every", _ge(1)),
    ("rollout.sampler_first", _one_of(("auto", "on", "off"))),
    ("rollout.max_regenerations", _ge(0)),
    # Below a second the watchdog fires while a healthy batch is still being generated.
    ("rollout.stall_timeout_s", (lambda v: v >= 1.0, ">= 1.0 (seconds: the watchdog must outlast "
                                 "the generation of one batch)")),
    ("task.weights", (lambda v: v == "" or _floats_ok(v),
                      "'' (equal) or comma-separated numbers >= 0, not all 0")),
    ("task.rg_config", (lambda v: v == "" or _json_object_ok(v),
                        "'' or a JSON object keyed by reasoning-gym dataset name, e.g. "
                        "'{\"basic_arithmetic\": {\"max_terms\": 3}}'")),
    ("resume", (lambda v: v in ("auto", "none") or os.path.isdir(v),
                "'auto', 'none' or an existing directory (a run directory or its "
                "checkpoints/)")),
    ("data.on_bad_row", _one_of({"skip", "raise"})),
    ("data.max_skipped_frac", _in(0, 1)),
    ("checkpoint.every", _ge(0)),
    ("checkpoint.keep", _ge(1)),
    ("logging.wandb.mode", _one_of({"", "online", "offline", "disabled"})),
    ("train.max_skipped_updates", _ge(0)),
    ("dynamic_sampling.tol", _ge(0)),
    ("dynamic_sampling.max_gen_batches", _ge(1)),
    ("dynamic_sampling.reward_field", _one_of(set(REWARD_FIELDS))),
    ("train.steps", (lambda v: v >= 1, ">= 1 (0 would run no RL step)")),
    # The count of skipped updates in a row that stops the run; 0 is "never".
    ("train.max_consecutive_skipped", _ge(0)),
    ("train.learning_rate", _gt(0)),
    ("train.warmup_steps", _ge(0)),
    ("train.lr_schedule", _one_of(set(LR_SCHEDULES))),
    ("train.final_lr_frac", _in(0, 1)),
    ("train.b1", _in(0, 1, hi_open=True)),
    ("train.b2", _in(0, 1, hi_open=True)),
    ("train.adam_eps", _gt(0)),
    ("train.weight_decay", _ge(0)),
    ("train.grad_clip", _gt(0)),
    ("train.num_microbatches", _ge(0)),
    ("train.microbatch_tokens", _ge(1)),
    ("train.length_buckets", _ge(0)),
    ("advantage.estimator", _one_of(set(ADVANTAGE_ESTIMATORS))),
    ("advantage.eps", _ge(0)),
    ("advantage.clip", _ge(0)),
    ("advantage.std_ddof", _one_of({0, 1})),
    ("loss.policy", _one_of(set(POLICY_LOSSES))),
    ("loss.eps_low", _in(0, 1)),
    ("loss.eps_high", _ge(0)),
    ("loss.ratio_base", _one_of({"auto", "trainer", "rollout"})),
    ("loss.dual_clip", (lambda v: v == 0 or v > 1, "0 (off) or > 1")),
    ("loss.sapo_tau_pos", _gt(0)),
    ("loss.sapo_tau_neg", _gt(0)),
    ("loss.reduction", _one_of(set(REDUCTIONS))),
    ("loss.norm_len", _ge(0)),
    ("loss.entropy_coef", _ge(0)),
    ("loss.moe_aux_coef", _ge(0)),
    *((f"loss.{k}", _gt(0)) for k in CORRECTION_CAPS),
    *((f"loss.{k}", _ge(0)) for k in CORRECTION_BAND_KEYS),
    ("loss.seq_logprob_error_threshold",
     (lambda v: v == 0 or v >= 1, "0 (off) or >= 1 (it bounds a mean of exp(|error|) >= 1)")),
    ("loss.logprob_impl", _one_of({"auto", "reference", "xla", "pallas"})),
    ("rollout_kl.coef", _ge(0)),
    ("rollout_kl.estimator", _one_of(set(KL_ESTIMATORS))),
    ("rollout_kl.reduction", _one_of(set(KL_REDUCTIONS))),
    ("ref_kl.coef", _ge(0)),
    ("distill.coef", _ge(0)),
    ("distill.reward_weight", _ge(0)),
    ("ref_kl.estimator", _one_of(set(KL_ESTIMATORS))),
    ("ref_kl.reduction", _one_of(set(KL_REDUCTIONS))),
    ("val.every", _ge(1)),
    ("val.batch_size", _ge(1)),
    ("val.samples_per_prompt", _ge(1)),
    ("val.temperature", (lambda v: v == 0 or v >= MIN_TEMPERATURE,
                         f"0 (greedy) or >= {MIN_TEMPERATURE} ({_TINY_T})")),
    ("val.max_wait_s", _gt(0)),
    ("env.timeout_s", (lambda v: v >= 0.1, ">= 0.1 (seconds: a shorter limit fails the calls of "
                       "any real environment)")),
    ("agent.max_concurrency", _ge(0)),
    ("agent.timeout_s", _gt(0)),
    ("profile.steps", (_profile_steps_ok, "'' (off) or 'A:B' with whole numbers 1 <= A <= B "
                       "(RL steps A to B)")),
    ("profile.peak_flops", _ge(0)),
    ("rollout.max_turns", _ge(1)),
    ("rollout.max_total_tokens", _ge(0)),
    *((f"mesh.{a}", (lambda v: v >= 1 or v == -1, ">= 1 or -1")) for a in MESH_AXES),
    *((f"mesh.{k}", (lambda v: v == 0 or 0 < v < 1 or (v >= 1 and float(v).is_integer()),
                     "0, a fraction in (0, 1) or a whole number of devices"))
      for k in ("rollout", "train")),
    ("mesh.rollout_tensor", _ge(1)),
    ("mesh.rollout_processes", (_process_list_ok, "'' (none) or distinct process indices >= 0 "
                                "separated by commas, e.g. '0'")),
    *DISTRIBUTED_RULES,
]


def is_section(v: Any) -> bool:
  """A config section (a nested `ConfigDict` or mapping), as opposed to a leaf value."""
  return isinstance(v, (ConfigDict, Mapping))


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
  """Dotted path -> value, for sections and leaves alike."""
  out = {}
  for k, v in cfg.items():
    out[prefix + k] = v
    if is_section(v):
      out.update(flatten(v, f"{prefix}{k}."))
  return out


# Int keys that may also hold one word instead of a number.
WORDS = {"rollout.lag": AUTO_LAG}


def type_ok(value: Any, ref: Any) -> bool:
  """Whether `value` may stand where the default holds `ref` (an int is a valid float)."""
  # bool is a subclass of int in Python, so it is excluded explicitly both ways.
  if isinstance(ref, bool):
    return isinstance(value, bool)
  if isinstance(ref, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(ref, float):
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  return isinstance(value, type(ref))


def describe(value: Any) -> str:
  """A value as a problem line names it: its type and repr, or "a section"."""
  return "a section" if is_section(value) else f"{type(value).__name__} {value!r}"


def unknown_key(path: str, known: Collection[str]) -> str:
  """The problem line for an unknown key `path` of the `known` ones.

  Suggests a sibling first (by spelling or initials: `lr` -> `learning_rate`), then any key.
  """
  msg = f"{PREFIX}{path}: unknown key"
  parent, _, leaf = path.rpartition(".")
  siblings = {k.rpartition(".")[2]: k for k in known
              if k.rpartition(".")[0] == parent and k != parent}
  initials = {"".join(w[0] for w in name.split("_") if w): full for name, full in siblings.items()}
  close = difflib.get_close_matches(leaf, list(siblings), n=1)
  if leaf in initials and "_" in initials[leaf]:
    best = initials[leaf]
  elif close:
    best = siblings[close[0]]
  else:
    best = next(iter(difflib.get_close_matches(path, list(known), n=1)), None)
  return msg + (f"; did you mean {PREFIX}{best}?" if best else "")


def check_schema(cfg: Any, ref: Any, known: Collection[str], prefix: str,
                 problems: list[str], good: dict[str, Any]) -> None:
  """Compares keys and types recursively; correctly typed leaves are collected in `good`."""
  for k, v in cfg.items():
    path = prefix + k
    if k not in ref:
      problems.append(unknown_key(path, known))
    elif is_section(ref[k]) != is_section(v):
      want = "a section" if is_section(ref[k]) else type(ref[k]).__name__
      problems.append(f"{PREFIX}{path}: expected {want}, got {describe(v)}")
    elif is_section(v):
      check_schema(v, ref[k], known, path + ".", problems, good)
    elif not type_ok(v, ref[k]) and not (path in WORDS and v == WORDS[path]):
      problems.append(
          f"{PREFIX}{path}: expected {type(ref[k]).__name__}, got {describe(v)}")
    elif isinstance(v, float) and not math.isfinite(v):
      problems.append(f"{PREFIX}{path}: must be finite, got {v!r}")
    else:
      good[path] = v
  for k in ref.keys():
    if k not in cfg:
      problems.append(f"{PREFIX}{prefix}{k}: missing key")
