"""Invalid run configs, one per case, each rejected by `validate` with a line per bad key.

Every case goes the way of the command line: `--config.key=value` overrides applied by
`parse_overrides` (collecting its problems) and then `validate` for 8 devices and the built-in
tasks. A case passes only if the error names exactly its keys, so a check that fires on the wrong
key, or a second check that fires with it, fails the case too.
"""

import pytest

from jaxrl.config import ConfigError, parse_overrides, validate
from jaxrl.recipes.default import get_config
from jaxrl.envs import AdditionTask
from jaxrl.envs.arithmetic import add_lengths
from test_cli import _assert_failed_before_compiling, _train

TASKS = ("add", "countdown", "guess", "math")
NO_SFT = "--config.sft.enabled=false"
MULTI = ["--config.distributed.num_processes=2",
         "--config.distributed.coordinator_address=10.0.0.1:8476"]

# (case id, overrides, keys that must be named (and no other), a fragment of the reason)
CASES = [
    # model
    ("kv_heads_do_not_divide_heads", ["--config.model.num_kv_heads=3"], ["model.num_heads"],
     "divisible by config.model.num_kv_heads"),
    ("odd_head_dim", ["--config.model.head_dim=33"], ["model.head_dim"], "even"),
    ("unknown_dtype", ["--config.model.dtype=float8"], ["model.dtype"], "must be one of"),
    ("unknown_attention", ["--config.model.attention=flash"], ["model.attention"],
     "must be one of ['auto', 'cudnn', 'dense', 'pallas_tpu', 'xla']"),
    ("zero_width", ["--config.model.d_model=0"], ["model.d_model"], "must be >= 1, got 0"),
    ("nan_float", ["--config.model.rms_eps=nan"], ["model.rms_eps"], "must be finite, got nan"),
    ("bool_not_parsable", ["--config.model.qkv_bias=maybe"], ["model.qkv_bias"],
     "expected bool"),
    # task
    ("duplicated_mixed_task", ["--config.task.name=add+add"], ["task.name"],
     "several distinct ones"),
    ("unknown_task", ["--config.task.name=sub"], ["task.name"], "got 'sub'"),
    ("negative_weight", [NO_SFT, "--config.task.name=add+countdown", "--config.task.weights=1,-1"],
     ["task.weights"], "comma-separated numbers >= 0"),
    ("weights_count_differs_from_tasks", ["--config.task.weights=3,1"], ["task.weights"],
     "2 weights for the 1 task(s)"),
    ("math_without_path", [NO_SFT, "--config.task.name=math"], ["task.path"],
     "needs a JSONL file"),
    ("math_path_missing", [NO_SFT, "--config.task.name=math",
                           "--config.task.path=/nonexistent/gsm8k.jsonl"], ["task.path"],
     "no file '/nonexistent/gsm8k.jsonl'"),
    ("too_many_digits", ["--config.task.num_digits=5"], ["task.num_digits"], "in [1, 4]"),
    ("splits_leave_no_training_problems", ["--config.task.num_digits=1"], ["task.dev_size"],
     "leaves no training problems: task 'add' has 100"),
    ("add_prompt_and_answer_do_not_fit", ["--config.task.num_digits=3"],
     ["rollout.max_prompt_len", "rollout.max_new_tokens"], "prompts have 8 tokens"),
    ("mixed_add_answer_does_not_fit", [NO_SFT, "--config.task.name=add+guess",
                                       "--config.rollout.max_new_tokens=3"],
     ["rollout.max_new_tokens"], "answers need up to 4 tokens"),
    # sft
    ("warm_up_without_demonstrations", ["--config.task.name=countdown"], ["sft.enabled"],
     "no demonstrations"),
    ("warm_up_on_a_mix", ["--config.task.name=add+guess"], ["sft.enabled"], "'add+guess'"),
    ("stop_accuracy_above_one", ["--config.sft.stop_accuracy=1.5"], ["sft.stop_accuracy"],
     "in [0, 1]"),
    ("sft_batch_vs_shards", ["--config.mesh.data=8", "--config.sft.batch_size=100"],
     ["sft.batch_size"], "config.mesh.data * config.mesh.fsdp = 8"),
    # rollout
    ("group_of_one", ["--config.rollout.group_size=1"], ["rollout.group_size"], ">= 2"),
    ("greedy_rollouts", ["--config.rollout.temperature=0"], ["rollout.temperature"],
     "every advantage would be 0"),
    ("top_1_rollouts", ["--config.rollout.top_k=1"], ["rollout.top_k"], "top-1 sampling is greedy"),
    ("top_p_zero", ["--config.rollout.top_p=0"], ["rollout.top_p"], "in (0, 1]"),
    ("total_budget_below_a_turn", ["--config.rollout.max_total_tokens=3"],
     ["rollout.max_total_tokens"], "must be 0 or >= config.rollout.max_new_tokens = 4"),
    ("partial_rollouts_static", ["--config.rollout.partial_rollouts=true"],
     ["rollout.partial_rollouts"], "needs config.rollout.engine = 'continuous'"),
    ("unknown_engine", ["--config.rollout.engine=vllm"], ["rollout.engine"],
     "must be one of ['continuous', 'static']"),
    ("misspelt_key", ["--config.rollout.max_new_token=8"], ["rollout.max_new_token"],
     "did you mean config.rollout.max_new_tokens?"),
    # dynamic_sampling
    ("no_generation_attempts", ["--config.dynamic_sampling.enabled=true",
                                "--config.dynamic_sampling.max_gen_batches=0"],
     ["dynamic_sampling.max_gen_batches"], "must be >= 1, got 0"),
    ("unknown_reward_field", ["--config.dynamic_sampling.reward_field=shaped"],
     ["dynamic_sampling.reward_field"], "one of ['reward']"),
    # train
    ("micro_batches_do_not_divide_batch", ["--config.train.num_microbatches=3"],
     ["train.num_microbatches"], "must divide the RL batch"),
    ("micro_batch_vs_shards", ["--config.mesh.data=8", "--config.train.num_microbatches=256"],
     ["train.num_microbatches"], "1024 / 256 = 4) must be divisible by config.mesh.data"),
    ("adam_b2_one", ["--config.train.b2=1.0"], ["train.b2"], "in [0, 1)"),
    ("float_for_int", ["--config.train.steps=1.5"], ["train.steps"], "expected int"),
    ("initials_suggest_key", ["--config.train.lr=1e-3"], ["train.lr"],
     "did you mean config.train.learning_rate?"),
    ("section_overridden", ["--config.train=5"], ["train"], "is a section"),
    ("override_without_value", ["--config.seed"], ["seed"], "needs a value"),
    # advantage
    ("unknown_estimator", ["--config.advantage.estimator=gae"], ["advantage.estimator"],
     "one of ['dr_grpo', 'grpo', 'grpo_batch_std', 'rloo']"),
    ("negative_advantage_clip", ["--config.advantage.clip=-1"], ["advantage.clip"], ">= 0"),
    # loss
    ("two_importance_weights", ["--config.loss.correction=token_tis+seq_tis"],
     ["loss.correction"], "at most one importance weighting"),
    ("unknown_correction", ["--config.loss.correction=icepop+bogus"], ["loss.correction"],
     "unknown correction(s) ['bogus']"),
    ("cispo_with_dual_clip", ["--config.loss.policy=cispo", "--config.loss.dual_clip=3"],
     ["loss.dual_clip"], "cispo does not take a dual clip"),
    ("gspo_with_token_reduction", ["--config.loss.policy=gspo"], ["loss.reduction"],
     "needs 'seq_mean_token_mean'"),
    ("inverted_mask_band", ["--config.loss.geo_mask_low=1.2"], ["loss.geo_mask_low"],
     "must be < config.loss.geo_mask_high"),
    ("weighting_twice_with_lag", ["--config.rollout.lag=1", "--config.loss.correction=token_tis"],
     ["loss.correction"], "already includes"),
    ("sequence_masking_without_logprobs", ["--config.rollout.logprobs=false",
                                           "--config.loss.seq_logprob_error_threshold=1.5"],
     ["loss.seq_logprob_error_threshold"], "config.rollout.logprobs is false"),
    # rollout_kl
    ("rollout_kl_without_logprobs", ["--config.rollout.logprobs=false",
                                     "--config.rollout_kl.coef=0.1"],
     ["rollout_kl.coef"], "needs the sampler's log-probs"),
    ("unknown_kl_estimator", ["--config.rollout_kl.estimator=k4"], ["rollout_kl.estimator"],
     "one of ['abs', 'k1', 'k2', 'k3']"),
    # ref_kl
    ("unknown_kl_reduction", ["--config.ref_kl.reduction=seq_sum"], ["ref_kl.reduction"],
     "one of ['policy', 'seq_mean', 'token_mean']"),
    ("negative_ref_kl", ["--config.ref_kl.coef=-0.1"], ["ref_kl.coef"], ">= 0"),
    # val
    ("greedy_pass_at_k", ["--config.val.samples_per_prompt=4"], ["val.temperature"],
     "greedy samples of one prompt are all the same"),
    ("val_batch_vs_shards", ["--config.mesh.fsdp=-1", "--config.val.batch_size=100"],
     ["val.batch_size"], "config.mesh.data * config.mesh.fsdp = 8"),
    ("val_never_waits", ["--config.val.max_wait_s=0"], ["val.max_wait_s"], "> 0"),
    # env
    ("negative_env_timeout", ["--config.env.timeout_s=-1"], ["env.timeout_s"], ">= 0.1"),
    ("tiny_env_timeout", ["--config.env.timeout_s=1e-9"], ["env.timeout_s"], ">= 0.1"),
    # train: 0 steps would run nothing and still write a run directory; -1 skipped updates in a
    # row would stop the run after its first step
    ("no_rl_steps", ["--config.train.steps=0"], ["train.steps"], ">= 1"),
    ("negative_consecutive_skips", ["--config.train.max_consecutive_skipped=-1"],
     ["train.max_consecutive_skipped"], ">= 0"),
    ("tiny_stall_timeout", ["--config.rollout.stall_timeout_s=1e-6"],
     ["rollout.stall_timeout_s"], ">= 1.0"),
    # distributed
    ("process_id_out_of_range", [*MULTI, "--config.distributed.process_id=2"],
     ["distributed.process_id"], "must be < config.distributed.num_processes = 2"),
    # the continuous engine runs on each process's own devices, not where batches are inline
    ("rollout_processes_on_one_process", ["--config.mesh.rollout_processes=0"],
     ["mesh.rollout_processes"], "the run has one process"),
    ("engine_with_several_processes_disaggregated",
     [*MULTI, "--config.rollout.engine=continuous", "--config.mesh.rollout=4"],
     ["rollout.engine"], "config.mesh.rollout > 0 (disaggregated)"),
    ("no_coordinator", ["--config.distributed.num_processes=2"],
     ["distributed.coordinator_address"], "needs process 0's 'host:port'"),
    # mesh
    ("mesh_does_not_divide_devices", ["--config.mesh.data=3"], ["mesh"], "not divide the 8"),
    ("two_wildcard_axes", ["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], ["mesh"],
     "at most one axis may be -1"),
    ("wildcard_unresolvable", ["--config.mesh.data=-1", "--config.mesh.tensor=3"], ["mesh.data"],
     "-1 cannot be resolved"),
    ("mesh_larger_than_devices", ["--config.mesh.tensor=16"], ["mesh"], "uses 16 devices"),
    ("zero_axis", ["--config.mesh.fsdp=0"], ["mesh.fsdp"], ">= 1 or -1"),
    # several sections at once: each named on its own line
    ("independent_problems_together",
     ["--config.rollout.temperature=0", "--config.loss.policy=cispo", "--config.loss.dual_clip=2",
      "--config.mesh.data=3", "--config.trian.steps=3"],
     ["rollout.temperature", "loss.dual_clip", "mesh", "trian.steps"], "did you mean"),
]


def _key(line: str) -> str:
  assert line.startswith("config."), line
  return line[len("config."):].split(":", 1)[0]


@pytest.mark.parametrize("overrides,keys,reason", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_invalid_config_names_exactly_its_keys(overrides, keys, reason):
  problems: list[str] = []
  cfg = parse_overrides(get_config(), overrides, problems)
  with pytest.raises(ConfigError) as info:
    validate(cfg, 8, task_names=TASKS, problems=problems)
  lines = info.value.problems
  # One problem is its line alone; several follow a header that counts them.
  assert str(info.value).splitlines() == (
      lines if len(lines) == 1 else [f"{len(lines)} problems found in config:", *lines])
  assert sorted(_key(line) for line in lines) == sorted(keys), "\n".join(lines)
  assert any(reason in line for line in lines), f"{reason!r} not in:\n" + "\n".join(lines)


def test_add_lengths_match_the_task():
  # Config validation spells out task 'add''s lengths (it must not build the task); they must
  # not drift.
  for n in (1, 2, 3):
    prompt_len, answer_len, total = add_lengths(n)
    task = AdditionTask(num_digits=n, dev_size=1, val_size=1)
    largest = task.problem(total - 1)  # 9...9 + 9...9: the longest answer
    assert {len(task.tokenizer.encode(task.problem(i).prompt)) for i in (0, total - 1)} == {
        prompt_len}
    assert task.max_answer_tokens == len(task.demonstration(largest)) == answer_len
    AdditionTask(num_digits=n, dev_size=total // 2, val_size=total - total // 2 - 1)
    with pytest.raises(ValueError, match="no training problems"):
      AdditionTask(num_digits=n, dev_size=total // 2, val_size=total - total // 2)


def test_cli_names_every_bad_override_before_compiling(tmp_path):
  proc = _train(["--config.task.name=guess", "--config.rollout.temperature=0",
                 "--config.loss.policy=cispo", "--config.loss.dual_clip=2",
                 "--config.train.lr=1e-3", f"--config.run_dir={tmp_path}/run"], tmp_path,
                {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  _assert_failed_before_compiling(proc, "4 problems", "config.sft.enabled",
                                  "config.rollout.temperature", "config.loss.dual_clip",
                                  "did you mean config.train.learning_rate")
  assert not (tmp_path / "run").exists()


def test_backend_only_attention_is_refused_elsewhere():
  """cudnn exists on a CUDA GPU only, in 16-bit compute; pallas_tpu is not a GPU kernel."""
  cases = [("cudnn", "cpu", "bfloat16", "runs on a CUDA GPU"),
           ("cudnn", "gpu", "float32", "computes in bfloat16 or float16"),
           ("pallas_tpu", "gpu", "float32", "the TPU kernel")]
  for impl, backend in (("pallas_tpu", "gpu"), ("pallas_gpu", "tpu")):
    cfg = get_config()
    cfg.model.decode_attention = impl
    with pytest.raises(ConfigError, match="model.decode_attention"):
      validate(cfg, 1, backend=backend)
  for impl, backend, dtype, words in cases:
    cfg = get_config()
    cfg.model.attention, cfg.model.dtype = impl, dtype
    with pytest.raises(ConfigError, match=words):
      validate(cfg, 1, backend=backend)
  cfg = get_config()
  cfg.model.attention, cfg.model.dtype = "cudnn", "bfloat16"
  validate(cfg, 1, backend="gpu")  # accepted where it runs
