"""The names of jaxrl's registries, each spelled once, importable without jax.

The loss library (`jaxrl.losses`), the train step's schedules and the model's remat policies
dispatch on these names, and config validation (`jaxrl.config`, which must not import jax) checks
a run's keys against them. A registry whose implementations do not cover exactly its names fails
at import (`check_registry`), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable

# jaxrl.losses.advantages: group-relative advantage estimators.
ADVANTAGE_ESTIMATORS = ("grpo", "grpo_batch_std", "dr_grpo", "rloo")
# jaxrl.losses.policy: per-token policy-gradient losses.
POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo", "reinforce")
# jaxrl.losses.reductions: how per-token values become one loss.
REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
              "seq_mean_token_sum_norm")
# jaxrl.losses.kl: per-token KL estimators, and how KL terms are reduced (objective).
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
# "policy": the policy term's own reduction (`loss.reduction`), e.g. Dr. GRPO's constant normaliser.
KL_REDUCTIONS = ("token_mean", "seq_mean", "policy")
# jaxrl.losses.corrections: off-policy corrections (joined by "+" in configs); the weighting ones
# set an importance weight, and two of those would double count.
CORRECTIONS = ("token_tis", "seq_tis", "icepop", "seq_mask_tis", "geo_mask", "product_mask",
               "outlier_mask", "dppo_tv")
WEIGHTING = ("token_tis", "seq_tis", "icepop", "seq_mask_tis")
# The corrections' thresholds, each a `loss.<name>` key and the `CorrectionParams` field of the
# same name: the caps of the truncated importance weights, then the bands the masks keep ratios
# in, a `<band>_low` and a `<band>_high` each (schema, validation and step config read these).
CORRECTION_CAPS = ("token_tis_cap", "seq_tis_cap")
CORRECTION_BANDS = ("icepop", "seq_mask", "geo_mask", "product_mask", "outlier", "dppo_delta")
CORRECTION_BAND_KEYS = tuple(f"{b}_{side}" for b in CORRECTION_BANDS for side in ("low", "high"))
CORRECTION_KEYS = CORRECTION_CAPS + CORRECTION_BAND_KEYS
# dppo_delta's pair bounds a probability drop and a rise (two deltas, not one interval), so only
# the other bands need low < high.
INTERVAL_BANDS = tuple(b for b in CORRECTION_BANDS if b != "dppo_delta")
# jaxrl.learner.step: learning-rate schedules.
LR_SCHEDULES = ("constant", "cosine", "linear")
# jaxrl.models.model_config: rematerialisation policies of a training forward pass.
REMAT_POLICIES = ("none", "full", "dots")
# jaxrl.models.model_config: the attention of a forward pass without a KV cache
# (`model.attention`); "auto" picks one per backend when the forward is traced.
ATTENTION_IMPLS = ("auto", "dense", "xla", "cudnn", "pallas_tpu")
# `model.decode_attention`: single-token decode over the KV cache (`jaxrl.kernels.decode_attention`).
DECODE_ATTENTION_IMPLS = ("auto", "dense", "xla", "pallas_tpu", "pallas_gpu")
# `model.moe_dispatch`: a mixture-of-experts layer's grouped matmul (`jaxrl.models.moe`).
MOE_DISPATCHES = ("auto", "ragged_dot", "blocked")
# jaxrl.kernels.attention: the implementations of its masked attention over packed rows.
ATTENTION_KERNELS = ("reference", "xla", "pallas_tpu", "cudnn")
# jaxrl.kernels.decode_attention: one query token per row against a KV cache.
DECODE_ATTENTION_KERNELS = ("reference", "xla", "pallas_tpu", "pallas_gpu")
# Per-row reward tags the rollout producer records (dynamic sampling filters on one of them).
REWARD_FIELDS = ("reward",)
DTYPES = ("float32", "bfloat16", "float16")
# `rollout.kv_cache_dtype`: the sampler's KV cache storage ("auto": bfloat16 on a GPU or TPU, the
# sampler's compute dtype on CPU); the float8 ones store keys and values in 8 bits, unscaled.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")

# Projections LoRA adapts (`model.lora.targets`), by their Hugging Face names minus "_proj".
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def check_registry(kind: str, names: tuple[str, ...], implemented: Iterable[str]) -> None:
  """Raises if the implementations of registry `kind` are not exactly `names`, in order."""
  got = tuple(implemented)
  if got != names:
    raise AssertionError(f"jaxrl.core.names.{kind} is {names}, but the implementations are {got}")

# `rollout.lag`: an int >= 0, or this word: the lag tunes itself within `rollout.max_lag`
# (`jaxrl.pipeline.tuner`).
AUTO_LAG = "auto"


def lag_bound(rollout) -> int:
  """The largest lag a run's `rollout` section can put in force: `rollout.lag`, or
  `rollout.max_lag` when the lag is `"auto"`. What sizes the ring (its `L + 1` slots), the
  memory plan and every choice made once per run that differs between lag 0 and lag > 0."""
  lag = rollout["lag"] if isinstance(rollout, dict) else rollout.lag
  if lag == AUTO_LAG:
    return rollout["max_lag"] if isinstance(rollout, dict) else rollout.max_lag
  return lag
