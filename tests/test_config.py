"""Tests for jaxrl.config: schema, types, ranges, mesh, cross-key checks and overrides."""

import json
import pathlib
import subprocess
import sys

import pytest
from ml_collections import ConfigDict

from jaxrl.config import (ConfigError, MeshShape, distributed_settings, parse_overrides,
                          resolve_microbatches, run_microbatches, shared_prompts, to_dict,
                          validate)
from jaxrl.recipes.default import get_config


def _problems(cfg, num_devices=1, **kwargs) -> list[str]:
  with pytest.raises(ConfigError) as info:
    validate(cfg, num_devices, **kwargs)
  err = info.value
  lines = str(err).splitlines()
  n = len(err.problems)
  # One problem is its line alone; several follow a header that counts them.
  assert lines == (err.problems if n == 1 else [f"{n} problems found in config:", *err.problems])
  assert all(p.startswith("config.") for p in err.problems)
  return err.problems


def _one(cfg, key, num_devices=1, **kwargs) -> str:
  problems = _problems(cfg, num_devices, **kwargs)
  assert len(problems) == 1, problems
  assert problems[0].startswith(f"config.{key}:"), problems
  return problems[0]


@pytest.mark.parametrize("num_devices", [1, 8])
def test_default_config_is_valid(num_devices):
  assert validate(get_config(), num_devices) == MeshShape(1, 1, 1)
  assert validate(get_config(), num_devices, task_names={"add"}) == MeshShape(1, 1, 1)


@pytest.mark.parametrize("axis", ["data", "fsdp", "tensor"])
def test_minus_one_axis_takes_remaining_devices(axis):
  cfg = get_config()
  cfg.mesh[axis] = -1
  assert getattr(validate(cfg, 8), axis) == 8
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, -1, 2
  assert validate(cfg, 8) == MeshShape(2, 2, 2)


def test_mesh_smaller_than_device_count_is_allowed_when_it_divides():
  cfg = get_config()
  cfg.mesh.data = 4
  assert validate(cfg, 8) == MeshShape(4, 1, 1)


def test_unknown_key_suggests_closest():
  cfg = get_config()
  cfg.train.lerning_rate = 1e-3
  msg = _one(cfg, "train.lerning_rate")
  assert "unknown key" in msg and "did you mean config.train.learning_rate?" in msg


def test_unknown_section_suggests_closest_and_is_reported_once():
  cfg = get_config()
  cfg.trian = ConfigDict({"steps": 5})
  msg = _one(cfg, "trian")
  assert "did you mean config.train?" in msg


def test_unknown_key_without_close_match_has_no_suggestion():
  cfg = get_config()
  cfg.zzzzzz = 1
  assert "did you mean" not in _one(cfg, "zzzzzz")


def test_missing_key_is_reported_not_filled():
  cfg = ConfigDict(get_config().to_dict())
  del cfg.train["b2"]
  assert "missing key" in _one(cfg, "train.b2")


def test_section_vs_scalar_mismatch():
  d = get_config().to_dict()
  d["loss"] = 0.2
  d["model"]["d_model"] = {"width": 128}
  problems = _problems(ConfigDict(d))
  assert any(p.startswith("config.loss: expected a section") for p in problems)
  assert any(p.startswith("config.model.d_model: expected int, got a section") for p in problems)


@pytest.mark.parametrize("key,value,expected", [
    ("train.steps", 1.5, "expected int, got float 1.5"),
    ("train.steps", True, "expected int, got bool True"),  # bool is not an int here
    ("train.learning_rate", False, "expected float, got bool False"),
    ("train.learning_rate", "1e-3", "expected float, got str '1e-3'"),
    ("model.qkv_bias", 1, "expected bool, got int 1"),
    ("model.dtype", 32, "expected str, got int 32"),
])
def test_wrong_type(key, value, expected):
  d = get_config().to_dict()
  section, leaf = key.split(".")
  d[section][leaf] = value
  assert expected in _one(ConfigDict(d), key)


def test_int_is_accepted_where_float_is_expected():
  d = get_config().to_dict()
  d["train"]["grad_clip"] = 1
  validate(ConfigDict(d), 1)


@pytest.mark.parametrize("key,value,expected", [
    ("train.learning_rate", -1.0, "must be > 0, got -1.0"),
    ("seed", -3, "must be >= 0, got -3"),
    ("model.head_dim", 33, "must be even"),
    ("model.dtype", "float8", "must be one of ['bfloat16', 'float16', 'float32'], got 'float8'"),
    ("task.num_digits", 5, "must be in [1, 4]"),
    ("sft.stop_accuracy", 1.5, "must be in [0, 1], got 1.5"),
    ("rollout.group_size", 1, "must be >= 2"),
    ("rollout.top_p", 0.0, "must be in (0, 1], got 0.0"),
    ("train.b2", 1.0, "must be in [0, 1), got 1.0"),
    ("loss.eps_high", float("nan"), "must be finite, got nan"),
    ("rollout.lag", -1, "must be >= 0 or 'auto', got -1"),
    ("rollout.stall_timeout_s", 0.0, "must be >= 1.0"),
    ("rollout.max_regenerations", -2, "must be >= 0"),
    ("rollout.partial_rollouts", True, "needs config.rollout.engine = 'continuous'"),
    ("mesh.fsdp", 0, "must be >= 1 or -1, got 0"),
    ("dynamic_sampling.tol", -0.1, "must be >= 0"),
    ("dynamic_sampling.max_gen_batches", 0, "must be >= 1, got 0"),
    ("dynamic_sampling.reward_field", "shaped", "must be one of ['reward'], got 'shaped'"),
    ("distributed.num_processes", 0, "must be >= 1, got 0"),
    ("distributed.process_id", -1, "must be >= 0, got -1"),
    ("distributed.init_timeout_s", 0, "must be > 0"),
    ("distributed.peer_timeout_s", 2, "must be >= 5, got 2"),
    ("train.adam_eps", 0.0, "must be > 0"),
])
def test_out_of_range(key, value, expected):
  cfg = get_config()
  section, leaf = key.split(".") if "." in key else (None, key)
  (cfg[section] if section else cfg)[leaf] = value
  assert expected in _one(cfg, key)


def test_num_heads_must_be_multiple_of_kv_heads():
  cfg = get_config()
  cfg.model.num_kv_heads = 3
  assert "config.model.num_kv_heads" in _one(cfg, "model.num_heads")


def test_task_name_is_checked_against_the_registry_or_given_names():
  cfg = get_config()
  cfg.task.name = "sub"
  assert "got 'sub'" in _one(cfg, "task.name")  # not a registered task
  assert "got 'sub'" in _one(cfg, "task.name", task_names=["add", "mul"])
  validate(cfg, 1, task_names=["sub"])


def test_mesh_not_dividing_devices():
  cfg = get_config()
  cfg.mesh.data = 3
  msg = _one(cfg, "mesh", num_devices=8)
  assert "data=3" in msg and "8" in msg


def test_mesh_larger_than_device_count():
  cfg = get_config()
  cfg.mesh.tensor = 2
  assert "tensor=2" in _one(cfg, "mesh", num_devices=1)


def test_two_minus_one_axes():
  cfg = get_config()
  cfg.mesh.data = cfg.mesh.fsdp = -1
  assert "at most one axis may be -1" in _one(cfg, "mesh", num_devices=8)


def test_minus_one_not_resolvable():
  cfg = get_config()
  cfg.mesh.data, cfg.mesh.tensor = -1, 3
  assert "-1 cannot be resolved" in _one(cfg, "mesh.data", num_devices=8)


def test_rl_batch_not_divisible_by_microbatches():
  cfg = get_config()
  cfg.rollout.num_prompts = 32
  cfg.train.num_microbatches = 3  # 32 * 8 = 256 rows, not a multiple of 3
  msg = _one(cfg, "train.num_microbatches")
  assert "config.rollout.num_prompts" in msg and "config.rollout.group_size" in msg
  assert "256" in msg


def test_microbatch_not_divisible_by_batch_shards():
  cfg = get_config()
  cfg.rollout.num_prompts = 4  # 4 * 8 / 4 = 8 per micro-batch, 16 batch shards
  cfg.train.num_microbatches = 4
  cfg.mesh.data, cfg.mesh.fsdp = 4, 4
  cfg.sft.batch_size = cfg.val.batch_size = 16
  msg = _one(cfg, "train.num_microbatches", num_devices=16)
  assert "config.mesh.data * config.mesh.fsdp = 16" in msg


def test_auto_microbatches_keep_each_device_within_the_token_budget():
  # The default runs each group's prompt once (train.share_prompts): 128 groups of
  # 6 + 8 x 4 = 38 tokens, budget 2048: 128 / m * 38 <= 2048 needs m >= 2.4, and the smallest
  # divisor of 128 from there is 4 (32 groups, 1216 tokens).
  cfg = get_config()
  assert cfg.train.num_microbatches == 0 and cfg.train.microbatch_tokens == 2048
  assert cfg.train.share_prompts and shared_prompts(cfg) == 8
  assert run_microbatches(cfg, shards=1) == 4
  # Over 8 batch shards each device holds 16 groups (608 tokens): one micro-batch.
  assert run_microbatches(cfg, shards=8) == 1
  # Row by row: 1024 rows of 6 + 4 = 10 tokens: 1024 / m * 10 <= 2048 needs m >= 5.1, and the
  # smallest divisor of 1024 from there is 8 (128 rows, 1280 tokens).
  cfg.train.share_prompts = False
  assert shared_prompts(cfg) == 0 and run_microbatches(cfg, shards=1) == 8
  # A small batch fits at once; an explicit count is taken as it is.
  assert resolve_microbatches(0, rows=16, seq_len=10, shards=1, token_budget=2048) == 1
  assert resolve_microbatches(3, rows=1024, seq_len=10, shards=1, token_budget=2048) == 3
  # 96 rows per shard of 100 tokens, budget 1000: 10 rows at most, so m = 12 (8 rows); m = 10
  # would fit the budget but does not divide 96.
  assert resolve_microbatches(0, rows=192, seq_len=100, shards=2, token_budget=1000) == 12
  # One row over the budget: one row per shard per micro-batch.
  assert resolve_microbatches(0, rows=64, seq_len=5000, shards=4, token_budget=2048) == 16
  # The completion budget counts all turns when max_total_tokens is set.
  cfg.rollout.max_total_tokens = 14  # 1024 x (6 + 14) = 20 tokens a row: 1024 / m <= 102
  assert run_microbatches(cfg, shards=1) == 16
  # Shared prompts: 128 groups of 6 + 8 x 14 = 118 tokens: 128 / m <= 17.4, so m = 8.
  cfg.train.share_prompts = True
  assert run_microbatches(cfg, shards=1) == 8


def test_auto_microbatches_need_a_batch_the_shards_divide():
  cfg = get_config()
  cfg.rollout.num_prompts, cfg.rollout.group_size = 3, 2  # 6 rows over 4 shards
  cfg.mesh.data = 4
  cfg.sft.batch_size = cfg.val.batch_size = 16
  msg = _one(cfg, "rollout.num_prompts", num_devices=4)
  assert "6 must be divisible by config.mesh.data * config.mesh.fsdp = 4" in msg
  cfg.train.num_microbatches, cfg.rollout.num_prompts = 0, 4  # 8 rows: fine
  validate(cfg, num_devices=4)
  cfg.train.microbatch_tokens = 0
  assert "train.microbatch_tokens" in _one(cfg, "train.microbatch_tokens", num_devices=4)


@pytest.mark.parametrize("key", ["sft.batch_size", "val.batch_size"])
def test_batch_sizes_divisible_by_batch_shards(key):
  cfg = get_config()
  cfg.mesh.fsdp = -1
  section, leaf = key.split(".")
  cfg.sft.batch_size = cfg.val.batch_size = 16
  cfg[section][leaf] = 20
  assert "config.mesh.data * config.mesh.fsdp = 8" in _one(cfg, key, num_devices=8)


def test_all_problems_in_one_error():
  cfg = get_config()
  cfg.train.lerning_rate = 1.0
  cfg.seed = True
  cfg.rollout.top_p = 2.0
  cfg.mesh.data = cfg.mesh.fsdp = -1
  cfg.train.num_microbatches = 3
  problems = _problems(cfg, 8)
  assert len(problems) == 5, problems
  for key in ("train.lerning_rate", "seed", "rollout.top_p", "mesh", "train.num_microbatches"):
    assert any(p.startswith(f"config.{key}:") for p in problems), key


def test_type_errors_skip_dependent_checks_without_crashing():
  d = get_config().to_dict()
  d["rollout"]["num_prompts"] = "32"
  d["mesh"]["data"] = "2"
  d["model"]["num_kv_heads"] = 2.0
  d["train"]["learning_rate"] = "abc"
  problems = _problems(ConfigDict(d), 8)
  assert len(problems) == 4, problems
  assert all("expected" in p for p in problems)
  for key in ("rollout.num_prompts", "mesh.data", "model.num_kv_heads", "train.learning_rate"):
    assert any(p.startswith(f"config.{key}:") for p in problems), key


def test_to_dict_is_json_serialisable():
  d = to_dict(get_config())
  assert type(d) is dict and type(d["train"]) is dict
  assert json.loads(json.dumps(d)) == d


def test_config_module_does_not_import_jax():
  code = "import sys, jaxrl.config; assert 'jax' not in sys.modules, 'jax imported'"
  subprocess.run([sys.executable, "-c", code], check=True,
                 cwd=pathlib.Path(__file__).resolve().parents[1])


def test_parse_overrides_applies_typed_values():
  cfg = parse_overrides(get_config(), [
      "prog", "--other=1", "--config.train.steps=5", "--config.train.learning_rate=1",
      "--config.model.qkv_bias=TRUE", "--config.model.tie_embeddings=0",
      "--config.mesh.data=-1", "--config.name=x=y"])
  assert cfg.train.steps == 5 and type(cfg.train.steps) is int
  assert cfg.train.learning_rate == 1.0 and type(cfg.train.learning_rate) is float
  assert cfg.model.qkv_bias is True and cfg.model.tie_embeddings is False
  assert cfg.name == "x=y"
  assert validate(cfg, 4) == MeshShape(4, 1, 1)


def test_parse_overrides_does_not_mutate_input():
  cfg = get_config()
  parse_overrides(cfg, ["--config.train.steps=5"])
  assert cfg.train.steps == get_config().train.steps != 5


def test_parse_overrides_reports_every_bad_key():
  with pytest.raises(ConfigError) as info:
    parse_overrides(get_config(), [
        "--config.nonexistent=1", "--config.train.learning_rate=abc",
        "--config.train.steps=1.5", "--config.model.qkv_bias=maybe",
        "--config.train.lerning_rate=1", "--config.train=5", "--config.seed"])
  problems = info.value.problems
  assert str(info.value).splitlines()[0] == "7 problems found in config:"
  expected = {
      "nonexistent": "unknown key",
      "train.learning_rate": "expected float, got 'abc'",
      "train.steps": "expected int, got '1.5'",
      "model.qkv_bias": "expected bool (true/false/1/0), got 'maybe'",
      "train.lerning_rate": "did you mean config.train.learning_rate?",
      "train": "is a section",
      "seed": "needs a value",
  }
  assert len(problems) == len(expected)
  for p, (key, text) in zip(problems, expected.items()):
    assert p.startswith(f"config.{key}:") and text in p, p


def test_registry_names_are_the_librarys():
  # The names are spelled once (jaxrl.core.names, jax-free); the library dispatches on them and a
  # registry whose implementations differ fails at import.
  import jax.numpy as jnp
  from jaxrl import losses as L
  from jaxrl.core import names
  assert L.POLICY_LOSSES is names.POLICY_LOSSES and tuple(L.policy.POLICIES) == names.POLICY_LOSSES
  assert tuple(L.KL_REDUCTIONS) == names.KL_REDUCTIONS
  with pytest.raises(AssertionError,
                     match=r"jaxrl.core.names.X is \('a',\), but the implementations are \('a', 'b'\)"):
    names.check_registry("X", ("a",), {"a": 1, "b": 2})
  for name in names.ADVANTAGE_ESTIMATORS:  # every name reaches an implementation
    L.compute_advantages(name, jnp.array([1.0, 0.0]), jnp.zeros(2, jnp.int32), eps=1e-4)
  for name in names.KL_ESTIMATORS:
    L.kl_estimate(jnp.zeros(2), jnp.zeros(2), name)
  for name in names.REDUCTIONS:
    L.reduce(name, jnp.ones((1, 2)), jnp.ones((1, 2), bool))


@pytest.mark.parametrize("overrides,key,expected", [
    ({"loss.correction": "token_tis+bogus"}, "loss.correction", "unknown correction(s) ['bogus']"),
    ({"loss.correction": "token_tis+seq_tis"}, "loss.correction", "at most one importance"),
    ({"loss.correction": "geo_mask+geo_mask"}, "loss.correction", "listed twice"),
    ({"loss.policy": "cispo", "loss.dual_clip": 3.0}, "loss.dual_clip",
     "cispo does not take a dual clip"),
    ({"loss.policy": "gspo", "loss.reduction": "seq_mean_token_mean",
      "loss.correction": "seq_mask_tis"}, "loss.correction", "seq_mask_tis cannot be combined"),
    ({"loss.policy": "gspo"}, "loss.reduction", "needs 'seq_mean_token_mean'"),
    ({"rollout.logprobs": False, "rollout_kl.coef": 0.1}, "rollout_kl.coef",
     "config.rollout.logprobs is false"),
    ({"rollout.logprobs": False, "loss.correction": "icepop"}, "loss.correction",
     "needs the sampler's log-probs"),
    ({"loss.geo_mask_low": 1.2}, "loss.geo_mask_low", "must be < config.loss.geo_mask_high"),
    ({"loss.dual_clip": 0.5}, "loss.dual_clip", "0 (off) or > 1"),
    ({"rollout_kl.estimator": "k4"}, "rollout_kl.estimator", "must be one of"),
    ({"loss.policy": "dpo"}, "loss.policy", "must be one of"),
    ({"advantage.estimator": "gae"}, "advantage.estimator", "must be one of"),
])
def test_incompatible_loss_settings_name_the_key(overrides, key, expected):
  cfg = get_config()
  for k, v in overrides.items():
    section, leaf = k.split(".")
    cfg[section][leaf] = v
  assert expected in _one(cfg, key)


def test_every_loss_option_combination_that_is_legal_validates():
  cfg = get_config()
  cfg.loss.policy = "gspo"
  cfg.loss.reduction = "seq_mean_token_mean"
  cfg.loss.correction = "outlier_mask+token_tis+dppo_tv"
  cfg.rollout_kl.coef = 0.1
  cfg.ref_kl.coef = 0.01
  cfg.loss.seq_logprob_error_threshold = 1.5
  validate(cfg, 1)


def test_ratio_base_rules():
  cfg = get_config()
  cfg.rollout.lag = 2
  cfg.loss.correction = "token_tis"  # auto + lag > 0 means the ratio already has the IS weight
  assert "already includes" in _one(cfg, "loss.correction")
  cfg.loss.correction = "outlier_mask"  # a mask is fine
  validate(cfg, 1)
  cfg.rollout.logprobs = False
  assert "config.rollout.logprobs is false" in "\n".join(_problems(cfg, 1))
  cfg = get_config()
  cfg.loss.ratio_base = "sampler"
  assert "must be one of" in _one(cfg, "loss.ratio_base")


@pytest.mark.parametrize("overrides, key, expected", [
    ({"process_id": 2, "num_processes": 2, "coordinator_address": "127.0.0.1:1234"},
     "distributed.process_id", "must be < config.distributed.num_processes = 2, got 2"),
    ({"num_processes": 2}, "distributed.coordinator_address", "needs process 0's 'host:port'"),
    ({"num_processes": 2, "coordinator_address": "host"}, "distributed.coordinator_address",
     "got 'host'"),
])
def test_distributed_cross_checks(overrides, key, expected):
  cfg = get_config()
  for k, v in overrides.items():
    cfg.distributed[k] = v
  assert expected in _one(cfg, key)
  # The pre-start check refuses the same settings (and validate() then names them).
  assert distributed_settings(cfg) is None


def test_distributed_settings_before_jax_starts():
  cfg = get_config()
  assert distributed_settings(cfg) == ("", 1, 0, 300)
  cfg.distributed.num_processes = 2
  cfg.distributed.process_id = 1
  cfg.distributed.coordinator_address = "10.0.0.2:8476"
  assert distributed_settings(cfg) == ("10.0.0.2:8476", 2, 1, 300)
  validate(cfg, 8)
  cfg.rollout.lag = 1  # several processes make lagged rollouts inline, in one order
  validate(cfg, 8)
  cfg.rollout.engine = "continuous"  # each process's rollout thread runs it on its own devices
  validate(cfg, 8)
  cfg.dynamic_sampling.enabled = True  # each process filters its own groups
  validate(cfg, 8)
  cfg.mesh.rollout = 4  # ... but a disaggregated batch is made inline over every process
  assert "must be 'static' with config.distributed.num_processes > 1 when " \
      "config.mesh.rollout > 0 (disaggregated)" in _one(cfg, "rollout.engine", 8)
  cfg.mesh.rollout = 0
  assert distributed_settings(cfg) == ("10.0.0.2:8476", 2, 1, 300)  # the engine is validate's
  cfg.distributed.process_id = 2
  assert distributed_settings(cfg) is None
  cfg = ConfigDict(get_config().to_dict(), type_safe=False)
  cfg.distributed.num_processes = "2"
  assert distributed_settings(cfg) is None


def test_mixed_task_names_and_weights():
  cfg = get_config()
  cfg.task.name = "add+guess"
  cfg.sft.enabled = False  # only 'add' alone has warm-up demonstrations
  validate(cfg, 1, task_names=["add", "guess"])
  cfg.task.name = "add+add"
  assert "joined by '+'" in _one(cfg, "task.name", task_names=["add", "guess"])
  cfg.task.name = "add+sub"
  assert "got 'add+sub'" in _one(cfg, "task.name", task_names=["add", "guess"])
  cfg.task.name = "add"
  for bad in ("1,x", "0,0", "-1,2"):
    cfg.task.weights = bad
    assert f"got {bad!r}" in _one(cfg, "task.weights")
