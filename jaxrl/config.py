"""Validation of run configs against the schema in `jaxrl.configs.default`.

`validate` runs before anything is compiled and reports every problem at once: schema (unknown
and missing keys), types, value ranges, the device mesh, cross-key divisibility, incompatible
loss combinations and what the chosen tasks need (prompt and answer lengths, split sizes, a data
file, demonstrations for the warm-up). It never imports jax; the caller passes the device count.

`parse_overrides` applies `--config.a.b=value` command-line overrides. It exists because
`ml_collections.config_flags` reports an unknown override key as a bare traceback naming only
the leaf (`AttributeError: "'nonexistent'"`) and stops at the first bad override.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ml_collections import ConfigDict

from jaxrl.configs import default as default_config

# Names of the loss library's registries. Spelled out because `jaxrl.losses` imports jax and this
# module must not (tests/test_config.py checks both that and that these match the library).
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "reinforce")
REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
              "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
KL_REDUCTIONS = ("token_mean", "seq_mean")
LR_SCHEDULES = ("constant", "cosine", "linear")  # jaxrl.train_step.LR_SCHEDULES
CORRECTIONS = ("token_tis", "seq_tis", "icepop", "seq_mask_tis", "geo_mask", "product_mask",
               "outlier_mask", "dppo_tv")
WEIGHTING = ("token_tis", "seq_tis", "icepop", "seq_mask_tis")

# The built-in tasks (jaxrl.trainer builds them; spelled out here because this module must not
# import jax). Their requirements are checked whenever `task.name` names only these.
TASK_NAMES = ("add", "countdown", "guess", "math")

# Per-row reward tags the rollout worker records (dynamic sampling filters on one of them).
REWARD_FIELDS = ("reward",)

DTYPES = ("float32", "bfloat16", "float16")
_MESH_AXES = ("data", "fsdp", "tensor")
_PREFIX = "config."


class ConfigError(ValueError):
  """All problems found in a config; one line each, starting with the full `config.` key."""

  def __init__(self, problems: list[str]):
    self.problems = list(problems)
    n = len(self.problems)
    head = f"{n} problem{'s' if n != 1 else ''} found in config:"
    super().__init__("\n".join([head, *self.problems]))


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """The resolved train mesh, and the rollout mesh's devices when disaggregated.

  `rollout_devices == 0`: colocated, rollouts are generated on the train mesh. Otherwise the
  first `train_devices` devices hold the train mesh (its first `size` of them) and the next
  `rollout_devices` a rollout mesh of shape (rollout_devices / rollout_tensor, 1,
  rollout_tensor).
  """
  data: int
  fsdp: int
  tensor: int
  train_devices: int = 0
  rollout_devices: int = 0
  rollout_tensor: int = 1

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def disaggregated(self) -> bool:
    return self.rollout_devices > 0

  @property
  def rollout_shape(self) -> tuple[int, int, int]:
    return (self.rollout_devices // self.rollout_tensor, 1, self.rollout_tensor)


def _gt(lo):
  return lambda v: v > lo, f"> {lo}"


def _ge(lo):
  return lambda v: v >= lo, f">= {lo}"


def _in(lo, hi, lo_open=False, hi_open=False):
  pred = lambda v: (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
  return pred, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _one_of(choices):
  return lambda v: v in choices, f"one of {sorted(choices)}"


# (key, (predicate, requirement)); checked only when the key exists with the right type.
def _floats_ok(text: str) -> bool:
  try:
    w = [float(x) for x in text.split(",")]
  except ValueError:
    return False
  return all(x >= 0 and x == x and x != float("inf") for x in w) and sum(w) > 0


_DISTRIBUTED_RULES: list[tuple[str, tuple[Callable[[Any], bool], str]]] = [
    ("distributed.auto", (lambda v: True, "a bool")),
    ("distributed.coordinator_address", (lambda v: True, "a string")),
    ("distributed.num_processes", _ge(1)),
    ("distributed.process_id", _ge(0)),
    ("distributed.init_timeout_s", _gt(0)),
]

_RULES: list[tuple[str, tuple[Callable[[Any], bool], str]]] = [
    ("seed", _ge(0)),
    ("log_every", _ge(1)),
    *((f"model.{k}", _ge(1)) for k in
      ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")),
    ("model.vocab_size", _ge(0)),
    ("model.head_dim", (lambda v: v % 2 == 0, "even (RoPE rotates pairs of dims)")),
    ("model.rope_theta", _gt(0)),
    ("model.rms_eps", _gt(0)),
    ("model.param_dtype", _one_of(DTYPES)),
    ("model.dtype", _one_of(DTYPES)),
    ("model.remat", _one_of({"none", "full", "dots"})),  # models.transformer.REMAT_POLICIES
    ("model.init_std", _gt(0)),
    ("rollout.engine", _one_of(("static", "continuous"))),
    ("rollout.engine_slots", _ge(0)),
    ("rollout.engine_steps", _ge(1)),
    ("task.num_digits", (lambda v: 1 <= v <= 4, "in [1, 4] (task 'add' permutes all 10^(2n) "
                         "operand pairs once: 5 digits would need 80 GB)")),
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
    ("rollout.temperature", (lambda v: v > 0, "> 0 (greedy samples of one prompt are identical, "
                             "so every advantage would be 0)")),
    ("rollout.top_k", (lambda v: v == 0 or v >= 2, "0 (off) or >= 2 (top-1 sampling is greedy: "
                       "the samples of one prompt would be identical, every advantage 0)")),
    ("rollout.top_p", _in(0, 1, lo_open=True)),
    ("rollout.lag", _ge(0)),
    ("rollout.max_regenerations", _ge(0)),
    ("rollout.stall_timeout_s", _gt(0)),
    ("task.weights", (lambda v: v == "" or _floats_ok(v),
                      "'' (equal) or comma-separated numbers >= 0, not all 0")),
    ("resume", (lambda v: v in ("auto", "none") or os.path.isdir(v),
                "'auto', 'none' or an existing directory (a run directory or its "
                "checkpoints/)")),
    ("data.on_bad_row", _one_of({"skip", "raise"})),
    ("checkpoint.every", _ge(0)),
    ("checkpoint.keep", _ge(1)),
    ("train.max_skipped_updates", _ge(0)),
    ("dynamic_sampling.tol", _ge(0)),
    ("dynamic_sampling.max_gen_batches", _ge(1)),
    ("dynamic_sampling.reward_field", _one_of(set(REWARD_FIELDS))),
    ("train.steps", _ge(0)),
    ("train.learning_rate", _gt(0)),
    ("train.warmup_steps", _ge(0)),
    ("train.lr_schedule", _one_of(set(LR_SCHEDULES))),
    ("train.final_lr_frac", _in(0, 1)),
    ("train.b1", _in(0, 1, hi_open=True)),
    ("train.b2", _in(0, 1, hi_open=True)),
    ("train.weight_decay", _ge(0)),
    ("train.grad_clip", _gt(0)),
    ("train.num_microbatches", _ge(0)),
    ("train.microbatch_tokens", _ge(1)),
    ("advantage.estimator", _one_of(set(ADVANTAGE_ESTIMATORS))),
    ("advantage.eps", _ge(0)),
    ("advantage.clip", _ge(0)),
    ("loss.policy", _one_of(set(POLICY_LOSSES))),
    ("loss.eps_low", _in(0, 1)),
    ("loss.eps_high", _ge(0)),
    ("loss.ratio_base", _one_of({"auto", "trainer", "rollout"})),
    ("loss.dual_clip", (lambda v: v == 0 or v > 1, "0 (off) or > 1")),
    ("loss.reduction", _one_of(set(REDUCTIONS))),
    ("loss.norm_len", _ge(0)),
    ("loss.token_tis_cap", _gt(0)),
    ("loss.seq_tis_cap", _gt(0)),
    *((f"loss.{k}", _ge(0)) for k in
      ("icepop_low", "icepop_high", "seq_mask_low", "seq_mask_high", "geo_mask_low",
       "geo_mask_high", "product_mask_low", "product_mask_high", "outlier_low", "outlier_high",
       "dppo_delta_low", "dppo_delta_high")),
    ("loss.seq_logprob_error_threshold",
     (lambda v: v == 0 or v >= 1, "0 (off) or >= 1 (it bounds a mean of exp(|error|) >= 1)")),
    ("loss.logprob_impl", _one_of({"auto", "reference", "xla", "pallas"})),
    ("rollout_kl.coef", _ge(0)),
    ("rollout_kl.estimator", _one_of(set(KL_ESTIMATORS))),
    ("rollout_kl.reduction", _one_of(set(KL_REDUCTIONS))),
    ("ref_kl.coef", _ge(0)),
    ("ref_kl.estimator", _one_of(set(KL_ESTIMATORS))),
    ("ref_kl.reduction", _one_of(set(KL_REDUCTIONS))),
    ("val.every", _ge(1)),
    ("val.batch_size", _ge(1)),
    ("val.samples_per_prompt", _ge(1)),
    ("val.temperature", (lambda v: v >= 0, ">= 0 (0 = greedy)")),
    ("val.max_wait_s", _gt(0)),
    ("env.timeout_s", _gt(0)),
    ("rollout.max_turns", _ge(1)),
    ("rollout.max_total_tokens", _ge(0)),
    *((f"mesh.{a}", (lambda v: v >= 1 or v == -1, ">= 1 or -1")) for a in _MESH_AXES),
    *((f"mesh.{k}", (lambda v: v == 0 or 0 < v < 1 or (v >= 1 and float(v).is_integer()),
                     "0, a fraction in (0, 1) or a whole number of devices"))
      for k in ("rollout", "train")),
    ("mesh.rollout_tensor", _ge(1)),
    *_DISTRIBUTED_RULES,
]


def _is_section(v: Any) -> bool:
  return isinstance(v, (ConfigDict, Mapping))


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
  """Dotted path -> value, for sections and leaves alike."""
  out = {}
  for k, v in cfg.items():
    out[prefix + k] = v
    if _is_section(v):
      out.update(_flatten(v, f"{prefix}{k}."))
  return out


def _type_ok(value: Any, ref: Any) -> bool:
  # bool is a subclass of int in Python, so it is excluded explicitly both ways.
  if isinstance(ref, bool):
    return isinstance(value, bool)
  if isinstance(ref, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(ref, float):
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  return isinstance(value, type(ref))


def _describe(value: Any) -> str:
  return "a section" if _is_section(value) else f"{type(value).__name__} {value!r}"


def _unknown(path: str, known: Collection[str]) -> str:
  """Suggests a sibling first (by spelling or initials: `lr` -> `learning_rate`), then any key."""
  msg = f"{_PREFIX}{path}: unknown key"
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
  return msg + (f"; did you mean {_PREFIX}{best}?" if best else "")


def _check_schema(cfg: Any, ref: Any, known: Collection[str], prefix: str,
                  problems: list[str], good: dict[str, Any]) -> None:
  """Compares keys and types recursively; correctly typed leaves are collected in `good`."""
  for k, v in cfg.items():
    path = prefix + k
    if k not in ref:
      problems.append(_unknown(path, known))
    elif _is_section(ref[k]) != _is_section(v):
      want = "a section" if _is_section(ref[k]) else type(ref[k]).__name__
      problems.append(f"{_PREFIX}{path}: expected {want}, got {_describe(v)}")
    elif _is_section(v):
      _check_schema(v, ref[k], known, path + ".", problems, good)
    elif not _type_ok(v, ref[k]):
      problems.append(
          f"{_PREFIX}{path}: expected {type(ref[k]).__name__}, got {_describe(v)}")
    elif isinstance(v, float) and not math.isfinite(v):
      problems.append(f"{_PREFIX}{path}: must be finite, got {v!r}")
    else:
      good[path] = v
  for k in ref.keys():
    if k not in cfg:
      problems.append(f"{_PREFIX}{prefix}{k}: missing key")


def _device_count(key: str, value: float, num_devices: int, problems: list[str]) -> int | None:
  """`mesh.rollout` / `mesh.train` as a device count (a fraction is of all devices)."""
  n = int(round(value * num_devices)) if value < 1 else int(value)
  if n < 1:
    problems.append(f"{_PREFIX}{key}: {value!r} of {num_devices} devices is no device")
    return None
  return n


def _resolve_split(good: dict[str, Any], num_devices: int,
                   problems: list[str]) -> tuple[int, int] | None:
  """(train devices, rollout devices); rollout 0 = colocated. None when the split is bad."""
  rollout, train, rt = good["mesh.rollout"], good["mesh.train"], good["mesh.rollout_tensor"]
  if rollout == 0:
    if train:
      problems.append(f"{_PREFIX}mesh.train: only with {_PREFIX}mesh.rollout > 0 (disaggregated "
                      f"rollout and train devices), got {train!r}")
      return None
    if rt != 1:
      problems.append(f"{_PREFIX}mesh.rollout_tensor: only with {_PREFIX}mesh.rollout > 0; "
                      f"colocated rollouts use the train mesh, got {rt}")
      return None
    return num_devices, 0
  n_r = _device_count("mesh.rollout", rollout, num_devices, problems)
  n_t = num_devices - (n_r or 0) if train == 0 else \
      _device_count("mesh.train", train, num_devices, problems)
  if n_r is None or n_t is None:
    return None
  if n_t < 1 or n_r + n_t > num_devices:
    problems.append(
        f"{_PREFIX}mesh.rollout: {n_r} rollout + {n_t} train devices need {n_r + n_t} disjoint "
        f"devices, but {num_devices} are available")
    return None
  if n_r % rt:
    problems.append(f"{_PREFIX}mesh.rollout_tensor: must divide the {n_r} rollout devices, got "
                    f"{rt}")
    return None
  return n_t, n_r


def _resolve_mesh(axes: dict[str, int], num_devices: int, problems: list[str],
                  what: str = "") -> MeshShape | None:
  wild = [a for a in _MESH_AXES if axes[a] == -1]
  shape = ", ".join(f"{a}={axes[a]}" for a in _MESH_AXES)
  if len(wild) > 1:
    problems.append(f"{_PREFIX}mesh: at most one axis may be -1, got ({shape})")
    return None
  if wild:
    rest = math.prod(axes[a] for a in _MESH_AXES if a != wild[0])
    if num_devices % rest:
      problems.append(
          f"{_PREFIX}mesh.{wild[0]}: -1 cannot be resolved: {num_devices}{what} devices are not "
          f"divisible by the product of the other axes ({shape}, product {rest})")
      return None
    axes = {**axes, wild[0]: num_devices // rest}
  mesh = MeshShape(**axes)
  if num_devices % mesh.size:
    problems.append(
        f"{_PREFIX}mesh: shape (data={mesh.data}, fsdp={mesh.fsdp}, tensor={mesh.tensor}) "
        f"uses {mesh.size} devices, which does not divide the {num_devices}"
        f"{what + ' devices' if what else ''} available")
    return None
  return mesh


_BANDS = ("icepop", "seq_mask", "geo_mask", "product_mask", "outlier", "dppo_delta")


def _check_loss(good: dict[str, Any], problems: list[str]) -> None:
  """Names inside `loss.correction` and combinations of loss keys that cannot work together."""
  p = _PREFIX
  names: tuple[str, ...] = ()
  if "loss.correction" in good:
    text = good["loss.correction"]
    names = () if text in ("", "none") else tuple(x.strip() for x in text.split("+"))
    bad = [n for n in names if n not in CORRECTIONS]
    if bad:
      problems.append(f"{p}loss.correction: unknown correction(s) {bad} in {text!r}; expected "
                      f"'none' or names from {list(CORRECTIONS)} joined by '+'")
      names = ()
    elif len(set(names)) != len(names):
      problems.append(f"{p}loss.correction: a correction is listed twice in {text!r}")
    weighting = [n for n in names if n in WEIGHTING]
    if len(weighting) > 1:
      problems.append(f"{p}loss.correction: at most one importance weighting of {list(WEIGHTING)}"
                      f" (two would double count), got {weighting}")
  for band in _BANDS:
    lo, hi = f"loss.{band}_low", f"loss.{band}_high"
    if band != "dppo_delta" and lo in good and hi in good and good[lo] >= good[hi]:
      problems.append(f"{p}{lo}: must be < {p}{hi}, got {good[lo]} and {good[hi]}")

  def on(key, off=0):
    return key in good and good[key] != off

  policy = good.get("loss.policy")
  if policy == "cispo" and on("loss.dual_clip"):
    problems.append(f"{p}loss.dual_clip: cispo does not take a dual clip (it clips a detached "
                    f"weight); set it to 0 or choose another {p}loss.policy")
  if policy == "gspo":
    if "seq_mask_tis" in names:
      problems.append(f"{p}loss.correction: seq_mask_tis cannot be combined with the sequence-"
                      f"level ratio of {p}loss.policy='gspo'")
    if good.get("loss.reduction", "seq_mean_token_mean") != "seq_mean_token_mean":
      problems.append(f"{p}loss.reduction: {p}loss.policy='gspo' needs 'seq_mean_token_mean' "
                      f"(one ratio per sequence), got {good['loss.reduction']!r}")
  if good.get("loss.ratio_base") == "rollout" or (
      good.get("loss.ratio_base") == "auto" and good.get("rollout.lag", 0) > 0):
    weighting = [n for n in names if n in WEIGHTING]
    if weighting:
      problems.append(f"{p}loss.correction: {weighting[0]} re-weights by the sampler ratio, which "
                      f"the PPO ratio already includes when {p}loss.ratio_base is 'rollout' (or "
                      f"'auto' with {p}rollout.lag > 0); use a mask correction or "
                      f"{p}loss.ratio_base='trainer'")
  if good.get("rollout.logprobs") is False:
    needs = [k for k, used in (("loss.correction", bool(names)),
                               ("loss.ratio_base", good.get("loss.ratio_base") == "rollout" or (
                                   good.get("loss.ratio_base") == "auto"
                                   and good.get("rollout.lag", 0) > 0)),
                               ("rollout_kl.coef", on("rollout_kl.coef")),
                               ("loss.seq_logprob_error_threshold",
                                on("loss.seq_logprob_error_threshold"))) if used]
    for k in needs:
      problems.append(f"{p}{k}: needs the sampler's log-probs, but {p}rollout.logprobs is "
                      "false")


def _check_distributed(good: dict[str, Any], problems: list[str],
                       num_processes: int | None = None) -> None:
  """The `distributed.*` keys, and what several processes need of the rest of the config.

  `num_processes` is the count actually joined (explicit keys or `distributed.auto`); the
  multi-process checks use it when the explicit keys ask for a single process.
  """
  p = _PREFIX
  n, pid = good.get("distributed.num_processes"), good.get("distributed.process_id")
  if n is not None and pid is not None and pid >= n:
    problems.append(f"{p}distributed.process_id: must be < {p}distributed.num_processes = {n}, "
                    f"got {pid}")
  if n is not None and n > 1:
    addr = good.get("distributed.coordinator_address")
    if addr is not None and (":" not in addr or not addr.rsplit(":", 1)[1].isdigit()):
      problems.append(f"{p}distributed.coordinator_address: {p}distributed.num_processes = {n} "
                      f"needs process 0's 'host:port', got {addr!r}")
    several = f"{p}distributed.num_processes > 1"
  elif num_processes is not None and num_processes > 1:
    several = f"{num_processes} processes joined by {p}distributed.auto"
  else:
    return
  # A lag is fine: several processes produce rollouts inline, in one order (`InlineWorker`).
  if good.get("rollout.engine") == "continuous":
    problems.append(
        f"{p}rollout.engine: must be 'static' with {several}: the continuous engine's host "
        "driver reads every slot's state, which several processes do not each hold")


def resolve_microbatches(num_microbatches: int, rows: int, seq_len: int, shards: int,
                         token_budget: int) -> int:
  """`train.num_microbatches` as the train step runs it.

  `>= 1` is itself. `0` (auto) is the fewest micro-batches `m` that divide the rows each batch
  shard holds (`rows / shards`) and keep one device's micro-batch, `rows / shards / m` rows of
  `seq_len` tokens, within `token_budget` (`train.microbatch_tokens`); one row per shard when a
  single row is over it. The gradient is the whole batch's for any `m`; what `m` changes is the
  activation memory and, on CPU, speed: XLA's scratch for a large step is mapped and page-faulted
  in afresh on every call, a small one stays in the heap and in cache (the default's 1,024 rows
  of 10 tokens run ~2x faster as 8 micro-batches; benchmarks/README.md).

  >>> resolve_microbatches(0, rows=1024, seq_len=10, shards=1, token_budget=2048)
  8
  >>> resolve_microbatches(0, rows=16, seq_len=10, shards=1, token_budget=2048)
  1
  """
  if num_microbatches > 0:
    return num_microbatches
  per_shard = max(rows // max(shards, 1), 1)
  for m in range(1, per_shard + 1):
    if per_shard % m == 0 and (per_shard // m) * seq_len <= token_budget:
      return m
  return per_shard


def run_microbatches(cfg, shards: int) -> int:
  """`resolve_microbatches` for a run config whose RL batch is split over `shards` devices."""
  r, t = cfg.rollout, cfg.train
  return resolve_microbatches(t.num_microbatches, r.num_prompts * r.group_size,
                              r.max_prompt_len + (r.max_total_tokens or r.max_new_tokens),
                              shards, t.microbatch_tokens)


def add_lengths(num_digits: int) -> tuple[int, int, int]:
  """Task 'add' with n-digit operands: (prompt tokens, answer tokens, number of problems).

  Spelled out from `jaxrl.envs.arithmetic` (prompt "07+35=", answer up to n + 1 digits then
  EOS, every operand pair one problem) because building the task permutes all of its problems;
  tests/test_config_invalid.py checks these against the task itself.
  """
  return 2 * num_digits + 2, num_digits + 2, 100 ** num_digits


def _check_task(good: dict[str, Any], problems: list[str], tasks_known: bool) -> None:
  """What the tasks of `task.name` need from the rest of the config.

  Without these a run fails only once it builds its task, after joining the processes (a bare
  traceback for a missing data file or splits that leave no training problems), or goes wrong
  silently: weights given for a single task are ignored, and in a mix 'add' answers longer than
  a turn are never rewarded.
  """
  p = _PREFIX
  if "task.name" not in good:
    return
  name = good["task.name"]
  names = name.split("+")
  weights = good.get("task.weights", "")
  if weights and len(weights.split(",")) != len(names):
    problems.append(f"{p}task.weights: {len(weights.split(','))} weights for the {len(names)} "
                    f"task(s) of {p}task.name = {name!r}; give one per task")
  if not tasks_known:  # the checks below know what the built-in tasks are
    return
  if good.get("sft.enabled") and good.get("sft.max_steps", 0) > 0 and names != ["add"]:
    problems.append(f"{p}sft.enabled: task {name!r} has no demonstrations for the supervised "
                    f"warm-up (only 'add' alone has); set it to false or {p}sft.max_steps to 0")
  if "math" in names and "task.path" in good:
    path = good["task.path"]
    if not path:
      problems.append(f"{p}task.path: task 'math' needs a JSONL file of {{\"question\", "
                      "\"answer\"} rows, got ''")
    elif not os.path.isfile(path):
      problems.append(f"{p}task.path: no file {path!r} (task 'math' reads its rows from it)")
  if "math" in names and good.get("task.val_path") and not os.path.isfile(good["task.val_path"]):
    problems.append(f"{p}task.val_path: no file {good['task.val_path']!r} (task 'math' reads its "
                    "validation rows from it)")
  if "add" in names and "task.num_digits" in good:
    n = good["task.num_digits"]
    prompt_len, answer_len, total = add_lengths(n)
    if "rollout.max_prompt_len" in good and good["rollout.max_prompt_len"] < prompt_len:
      problems.append(f"{p}rollout.max_prompt_len: task 'add' prompts have {prompt_len} tokens "
                      f"with {p}task.num_digits = {n}, got {good['rollout.max_prompt_len']}")
    if "rollout.max_new_tokens" in good and good["rollout.max_new_tokens"] < answer_len:
      problems.append(f"{p}rollout.max_new_tokens: task 'add' answers need up to {answer_len} "
                      f"tokens (with EOS) with {p}task.num_digits = {n}, got "
                      f"{good['rollout.max_new_tokens']}")
    if "task.dev_size" in good and "task.val_size" in good and \
        good["task.dev_size"] + good["task.val_size"] >= total:
      problems.append(f"{p}task.dev_size: {p}task.dev_size + {p}task.val_size = "
                      f"{good['task.dev_size']} + {good['task.val_size']} leaves no training "
                      f"problems: task 'add' has {total} with {p}task.num_digits = {n}")


# The keys a Hugging Face model directory decides (model.hf_path).
HF_ARCHITECTURE_KEYS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                        "head_dim", "mlp_dim", "rope_theta", "rms_eps", "qkv_bias", "qk_norm",
                        "tie_embeddings", "init_std")


def _check_hf(good: dict[str, Any], ref: dict[str, Any], problems: list[str]) -> None:
  """A Hugging Face model directory: present, complete enough to start, and not contradicted.

  The architecture comes from the directory's config.json, so an architecture key changed in the
  run config would be silently ignored; it is named instead. The warm-up's demonstrations are
  character-tokenizer ids, which a Hugging Face tokenizer cannot train on.
  """
  p = _PREFIX
  path = good.get("model.hf_path", "")
  if not path:
    return
  if not os.path.isdir(path):
    problems.append(f"{p}model.hf_path: no directory {path!r}")
    return
  for name in ("config.json", "tokenizer.json"):
    if not os.path.isfile(os.path.join(path, name)):
      problems.append(f"{p}model.hf_path: {os.path.join(path, name)} is missing (a Hugging Face "
                      "model directory holds config.json, the *.safetensors weights, "
                      "tokenizer.json and tokenizer_config.json)")
  for key in HF_ARCHITECTURE_KEYS:
    k = f"model.{key}"
    if k in good and good[k] != ref[k]:
      problems.append(f"{p}{k}: is read from {path}/config.json with {p}model.hf_path set; "
                      f"leave it at its default {ref[k]!r}, got {good[k]!r}")
  # (Other tasks have no demonstrations at all, which _check_task reports.)
  if good.get("sft.enabled") and good.get("sft.max_steps", 0) > 0 and \
      good.get("task.name") == "add":
    problems.append(f"{p}sft.enabled: the supervised warm-up's demonstrations are "
                    f"character-tokenizer ids, not available with {p}model.hf_path; set it to "
                    f"false or {p}sft.max_steps to 0")


def distributed_settings(cfg: ConfigDict) -> tuple[str, int, int, int] | None:
  """`(coordinator_address, num_processes, process_id, init_timeout_s)`, checked on their own.

  Runs before JAX starts: joining the processes decides the device count that `validate` needs.
  Returns None when these keys (or `distributed.auto`) are bad; `validate` then reports them
  with every other problem. Only the explicit settings: with `num_processes == 1`, the caller
  may still join what `distributed.auto` detects (`jaxrl.parallel.distributed.join`).
  """
  problems: list[str] = []
  ref, flat = _flatten(default_config.get_config()), _flatten(cfg)
  good: dict[str, Any] = {}
  for key, (pred, requirement) in _DISTRIBUTED_RULES:
    value = flat.get(key, ref[key])
    if not _type_ok(value, ref[key]):
      problems.append(f"{_PREFIX}{key}: must be {type(ref[key]).__name__}, got {_describe(value)}")
    elif not pred(value):
      problems.append(f"{_PREFIX}{key}: must be {requirement}, got {value!r}")
    else:
      good[key] = value
  _check_distributed(good, problems)
  if problems:
    return None
  return tuple(good[f"distributed.{k}"] for k in  # type: ignore[return-value]
               ("coordinator_address", "num_processes", "process_id", "init_timeout_s"))


def validate(cfg: ConfigDict, num_devices: int,
             task_names: Collection[str] | None = None,
             problems: Collection[str] = (), *,
             num_processes: int | None = None) -> MeshShape:
  """Checks `cfg` completely and returns the resolved mesh shape.

  A config file must start from `jaxrl.configs.default.get_config()` and change values: keys
  absent from the default are rejected as unknown, and keys of the default absent from `cfg`
  are reported as missing rather than filled in, so a run's saved config is always complete.

  Args:
    cfg: the config to check.
    num_devices: number of devices the run will use (`jax.device_count()` in the caller).
    task_names: known task names. When None, `task.name` itself is not checked; what its tasks
      need (lengths, split sizes, data file, warm-up demonstrations) still is whenever it names
      only built-in tasks (`TASK_NAMES`), and `task.weights` always is.
    problems: problems already found (e.g. by `parse_overrides`), reported first.
    num_processes: processes actually joined (`jax.process_count()` in the caller), whether by
      the explicit `distributed.*` keys or detected by `distributed.auto`; the multi-process
      checks (`rollout.lag`, `rollout.engine`) apply to it. None: the explicit keys alone.

  Returns:
    The mesh shape with a -1 axis resolved against `num_devices`.

  Raises:
    ConfigError: listing every problem found, one per line.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  ref = default_config.get_config()
  problems = list(problems)
  good: dict[str, Any] = {}
  _check_schema(cfg, ref, _flatten(ref).keys(), "", problems, good)

  rules = list(_RULES)
  if task_names is not None:
    known = sorted(task_names)
    rules.append(("task.name", (
        lambda v: all(n in known for n in v.split("+")) and len(set(v.split("+"))) ==
        len(v.split("+")),
        f"one of {known}, or several distinct ones joined by '+' (mixed per row)")))
  for key, (pred, requirement) in rules:
    if key in good and not pred(good[key]):
      problems.append(f"{_PREFIX}{key}: must be {requirement}, got {good[key]!r}")
      del good[key]  # a bad value takes no part in the cross-key checks below

  def have(*keys: str) -> bool:
    return all(k in good for k in keys)

  if have("model.num_heads", "model.num_kv_heads") and \
      good["model.num_heads"] % good["model.num_kv_heads"]:
    problems.append(
        f"{_PREFIX}model.num_heads: must be divisible by {_PREFIX}model.num_kv_heads, got "
        f"{good['model.num_heads']} and {good['model.num_kv_heads']}")

  mesh = None
  if have(*(f"mesh.{a}" for a in _MESH_AXES), "mesh.rollout", "mesh.train", "mesh.rollout_tensor"):
    split = _resolve_split(good, num_devices, problems)
    if split is not None:
      n_t, n_r = split
      mesh = _resolve_mesh({a: good[f"mesh.{a}"] for a in _MESH_AXES}, n_t, problems,
                           " train" if n_r else "")
      if mesh is not None and n_r:
        mesh = dataclasses.replace(mesh, train_devices=n_t, rollout_devices=n_r,
                                   rollout_tensor=good["mesh.rollout_tensor"])
  batch_shards = f"{_PREFIX}mesh.data * {_PREFIX}mesh.fsdp"

  if have("rollout.num_prompts", "rollout.group_size", "train.num_microbatches",
          "train.microbatch_tokens", "rollout.max_prompt_len", "rollout.max_new_tokens",
          "rollout.max_total_tokens"):
    p, g, m = (good[k] for k in
               ("rollout.num_prompts", "rollout.group_size", "train.num_microbatches"))
    rl_batch = f"{_PREFIX}rollout.num_prompts * {_PREFIX}rollout.group_size"
    shards = mesh.data * mesh.fsdp if mesh else 1
    if m == 0:  # auto: always a divisor of the rows each shard holds
      if (p * g) % shards:
        problems.append(
            f"{_PREFIX}rollout.num_prompts: the RL batch {rl_batch} = {p} * {g} = {p * g} must "
            f"be divisible by {batch_shards} = {shards}, since the batch axis is sharded over "
            "both")
    elif (p * g) % m:
      problems.append(
          f"{_PREFIX}train.num_microbatches: must divide the RL batch {rl_batch} "
          f"= {p} * {g} = {p * g}, got {m}")
    elif mesh and (p * g // m) % shards:
      problems.append(
          f"{_PREFIX}train.num_microbatches: each micro-batch ({rl_batch} / "
          f"{_PREFIX}train.num_microbatches = {p * g} / {m} = {p * g // m}) must be divisible "
          f"by {batch_shards} = {shards}, since the batch axis is sharded over both")
  for key in ("sft.batch_size", "val.batch_size"):
    if mesh and have(key) and good[key] % (mesh.data * mesh.fsdp):
      problems.append(
          f"{_PREFIX}{key}: must be divisible by {batch_shards} = {mesh.data * mesh.fsdp} "
          f"(the batch axis is sharded over both), got {good[key]}")
  if have("val.samples_per_prompt", "val.temperature") and good["val.samples_per_prompt"] > 1 \
      and good["val.temperature"] == 0:
    problems.append(
        f"{_PREFIX}val.temperature: must be > 0 with {_PREFIX}val.samples_per_prompt = "
        f"{good['val.samples_per_prompt']} (greedy samples of one prompt are all the same)")
  if good.get("rollout.partial_rollouts") and good.get("rollout.engine", "static") != "continuous":
    problems.append(
        f"{_PREFIX}rollout.partial_rollouts: needs {_PREFIX}rollout.engine = 'continuous' (the "
        "static sampler decodes a whole batch on one params version), got "
        f"{good.get('rollout.engine')!r}")
  if have("rollout.max_total_tokens", "rollout.max_new_tokens") and \
      0 < good["rollout.max_total_tokens"] < good["rollout.max_new_tokens"]:
    problems.append(
        f"{_PREFIX}rollout.max_total_tokens: must be 0 or >= {_PREFIX}rollout.max_new_tokens = "
        f"{good['rollout.max_new_tokens']}, got {good['rollout.max_total_tokens']}")

  _check_loss(good, problems)
  _check_distributed(good, problems, num_processes)
  _check_hf(good, _flatten(ref), problems)
  names = str(good.get("task.name", "")).split("+")
  _check_task(good, problems, tasks_known=task_names is not None or
              all(n in TASK_NAMES for n in names))

  if problems:
    raise ConfigError(problems)
  assert mesh is not None
  return mesh


def to_dict(cfg: ConfigDict) -> dict[str, Any]:
  """Plain nested dict (references resolved), e.g. for writing the resolved config as JSON."""
  return cfg.to_dict()


_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _parse_value(text: str, ref: Any) -> Any:
  """Parses `text` as the type of the default value `ref`; raises ValueError with a reason."""
  if isinstance(ref, bool):
    if text.lower() in _TRUE + _FALSE:
      return text.lower() in _TRUE
    raise ValueError(f"expected bool (true/false/1/0), got {text!r}")
  if isinstance(ref, int):
    try:
      return int(text)
    except ValueError:
      raise ValueError(f"expected int, got {text!r}") from None
  if isinstance(ref, float):
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"expected float, got {text!r}") from None
  return text


def parse_overrides(cfg: ConfigDict, argv: list[str],
                    problems: list[str] | None = None) -> ConfigDict:
  """Returns a copy of `cfg` with `--config.a.b=value` arguments from `argv` applied.

  Values are parsed by the type of the key in `jaxrl.configs.default` (int, float, bool as
  true/false/1/0 in any case, str verbatim). Arguments not starting with `--config.` are
  ignored, so `argv` may be the full command line. Later overrides of the same key win.

  absl must not see the overrides: `DEFINE_config_file` scans `sys.argv` for them when it is
  defined, so pass it `sys_argv=sys.argv[:1]` and give `app.run` a `flags_parser` that drops
  `--config.*` arguments before calling `flags.FLAGS(...)`.

  With a `problems` list, bad overrides are appended to it and the good ones still applied, so
  the caller can validate the rest and report everything at once.

  Raises:
    ConfigError: naming every bad override (unknown key, section, unparsable value, no `=`),
      when no `problems` list is given.
  """
  known = _flatten(default_config.get_config())
  out = cfg.to_dict()  # plain dicts: ConfigDict refuses a float into a field holding an int
  collect = problems is not None
  problems = [] if problems is None else problems
  for arg in argv:
    if not arg.startswith("--" + _PREFIX):
      continue
    path, sep, text = arg[len("--" + _PREFIX):].partition("=")
    if path not in known:
      problems.append(_unknown(path, known))
    elif _is_section(known[path]):
      problems.append(f"{_PREFIX}{path}: is a section; override its keys one by one")
    elif not sep:
      problems.append(f"{_PREFIX}{path}: override needs a value, as in {arg}=VALUE")
    else:
      try:
        value = _parse_value(text, known[path])
      except ValueError as e:
        problems.append(f"{_PREFIX}{path}: {e} (from {arg})")
        continue
      *parents, leaf = path.split(".")
      node = out
      for p in parents:
        node = node.setdefault(p, {}) if isinstance(node, dict) else None
      if isinstance(node, dict):
        node[leaf] = value
      # Otherwise the loaded config has a scalar where a section belongs; validate reports it.
  if problems and not collect:
    raise ConfigError(problems)
  return ConfigDict(out)
