"""`python -m jaxrl.train`: bad configs fail before any compile naming the key; a tiny run
writes every output; it works from any working directory."""

import json
import os
import subprocess
import sys

import pytest
from matplotlib import image as mpimg


def _train(args, cwd, env_extra=None, timeout=300):
  env = {**os.environ, "JAX_LOG_COMPILES": "1", **(env_extra or {})}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return subprocess.run([sys.executable, "-m", "jaxrl.train", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _assert_failed_before_compiling(proc, *keys):
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out
  # One problem is one line `jaxrl: config.<key>: ...`; several follow a header.
  assert "jaxrl: invalid config\n" in out or "jaxrl: config." in out, out
  for k in keys:
    assert k in out, f"{k} not named in:\n{out}"
  # JAX_LOG_COMPILES=1 logs every compilation; validation must come before any.
  assert "Compiling" not in out and "Finished tracing" not in out, out


def test_unknown_key_and_wrong_type_are_all_named(tmp_path):
  proc = _train(["--config.trian.steps=3", "--config.train.steps=1.5",
                 "--config.model.qkv_bias=maybe", f"--config.run_dir={tmp_path}/run"], tmp_path)
  _assert_failed_before_compiling(proc, "config.trian", "did you mean config.train",
                                  "config.train.steps", "config.model.qkv_bias")
  assert not (tmp_path / "run").exists()


def test_out_of_range_value_is_named(tmp_path):
  proc = _train(["--config.rollout.group_size=1", "--config.train.learning_rate=-1"], tmp_path)
  _assert_failed_before_compiling(proc, "config.rollout.group_size",
                                  "config.train.learning_rate")


def test_mesh_that_does_not_divide_the_devices(tmp_path):
  flags = "--xla_force_host_platform_device_count=8"
  # An override error and a validation error are reported together, not one per run.
  proc = _train(["--config.mesh.data=3", "--config.train.lr=1e-3"], tmp_path,
                {"XLA_FLAGS": flags})
  _assert_failed_before_compiling(proc, "2 problems", "config.mesh", "not divide the 8",
                                  "did you mean config.train.learning_rate")


def test_unknown_key_in_a_config_file(tmp_path):
  recipe = tmp_path / "recipe.py"
  recipe.write_text("from jaxrl.recipes.default import get_config as base\n"
                    "def get_config():\n  c = base()\n  c.train.lr = 0.1\n  return c\n")
  proc = _train([f"--config={recipe}"], tmp_path)
  _assert_failed_before_compiling(proc, "config.train.lr", "config.train.learning_rate")


def _tiny(sft_steps, steps, eval_every, *extra):
  """Overrides for a run small enough for the fast suite."""
  return ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
          f"--config.sft.max_steps={sft_steps}", "--config.sft.eval_every=10",
          f"--config.train.steps={steps}", f"--config.val.every={eval_every}",
          "--config.task.dev_size=64", "--config.task.val_size=64", "--config.val.batch_size=64",
          "--config.rollout.num_prompts=4", *extra]


@pytest.mark.slow
def test_tiny_run_writes_metrics_plot_and_summary(tmp_path):
  run_dir = tmp_path / "out"
  args = _tiny(20, 4, 2, "--config.rollout_kl.coef=0.05", f"--config.run_dir={run_dir}",
               "--config.name=tiny", "--config.loss.seq_logprob_error_threshold=1.5")
  elsewhere = tmp_path / "cwd"
  elsewhere.mkdir()
  proc = _train(args, elsewhere, {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "held-out accuracy" in proc.stdout and "before RL" in proc.stdout

  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  sft = [r for r in rows if r["phase"] == "sft"]
  rl = [r for r in rows if r["phase"] == "rl"]
  val = {r["step"]: r for r in rows if r["phase"] == "val"}
  summary = [r for r in rows if r["phase"] == "summary"]
  assert [r["step"] for r in sft] == list(range(1, 21))
  assert [r["step"] for r in rl] == list(range(1, 5))
  for r in rl:
    for key in ("reward", "loss", "grad_norm", "entropy", "perf/step_time_s", "rollout_kl",
                "mismatch/abs_diff/max", "mismatch/token_mult_prob_error", "mismatch/gen_kl"):
      assert key in r, key
    # Sampler and trainer log-probs agree on the rollouts actually trained on (read back from
    # the data plane), so sequence masking by log-prob error drops nothing on-policy.
    assert r["mismatch/abs_diff/max"] < 1e-4
    assert r["mismatch/num_masked_seqs"] == 0 and r["mismatch/seq_mult_prob_error/max"] < 1.001
  # Validation passes (asynchronous) are logged under the step whose params they used: before
  # RL (step 0), every val.every = 2 steps, and at the end.
  assert sorted(val) == [0, 2, 4]
  for r in val.values():
    for key in ("val/accuracy", "val/pass@1", "val/avg_length", "val/turns/mean",
                "val/env_calls", "val/time_s", "val/truncated_frac"):
      assert key in r, key
    assert r["val/env_calls"] == 1  # 64 prompts, one batch, one turn, one task: one call
  assert len(summary) == 1
  s = summary[0]
  assert s["val/accuracy_before_rl"] == val[0]["val/accuracy"]
  assert s["val/accuracy_after_rl"] == val[4]["val/accuracy"]

  config = json.loads((run_dir / "config.json").read_text())
  assert config["train"]["steps"] == 4 and config["model"]["d_model"] == 32
  assert json.loads((run_dir / "summary.json").read_text())["rl/steps"] == 4
  # The five panels of plotting.CURVES, 3 x 2 (tests/test_plotting.py checks what they draw).
  image = mpimg.imread(str(run_dir / "curves.png"))
  assert image.shape[:2] == (670, 1320)


@pytest.mark.slow  # a whole run (fast-suite time budget)
def test_tiny_run_with_lag_two_reports_exact_staleness(tmp_path):
  # Step s (1-based) trains on batch s - 1, generated with the params published after step
  # s - 1 - L: first-token staleness is exactly min(s - 1, 2); the ring holds at most 3 batches.
  run_dir = tmp_path / "out"
  args = _tiny(10, 6, 3, "--config.rollout.lag=2", f"--config.run_dir={run_dir}")
  proc = _train(args, tmp_path, {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl" and r["step"] > 0]
  assert [r["batch_id"] for r in rl] == list(range(6))
  for r in rl:
    want = min(r["batch_id"], 2)
    for k in ("first_token", "last_token", "token_mean"):
      for stat in ("min", "mean", "max"):
        assert r[f"staleness/{k}/{stat}"] == want, (r["step"], k, stat)
    assert r["pipeline/capacity"] == 3 and 1 <= r["pipeline/slots_held"] <= 3
    assert r["pipeline/consumed"] == r["batch_id"] + 1
    assert r["pipeline/submitted"] <= r["pipeline/consumed"] + 2
    # turn_wait_s: colocated on a CPU the train step lets the worker's sampler call go first
    # (rollout.sampler_first "auto"); the staleness above is the same either way.
    for k in ("completed", "utilization", "regenerated", "filtered", "worker_blocked_s",
              "trainer_wait_s", "turn_wait_s"):
      assert f"pipeline/{k}" in r, k


# Single-digit sums: a tiny model gets non-trivial rewards after a short warm-up, so groups with
# and without reward variance both occur and dynamic sampling has something to filter.
_ONE_DIGIT = ["--config.task.num_digits=1", "--config.task.dev_size=16",
              "--config.task.val_size=16", "--config.val.batch_size=16",
              "--config.sft.stop_accuracy=0.2", "--config.dynamic_sampling.enabled=true"]


def _rl_rows(run_dir):
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if r["phase"] == "rl" and r["step"] > 0]


def _check_filtered_batches(rl, group_size=8):
  for r in rl:
    # Every trained group has reward variance; the filter read the raw task reward.
    assert r["reward/mixed_groups"] == 1.0, r["step"]
    assert r["dynamic_sampling/num_gen_batches"] >= 1
    for k in ("reward", "filtered_reward", "dynamic_sampling/dropped_groups",
              "dynamic_sampling/discarded_valid_samples"):
      assert k in r, k
  assert sum(r["dynamic_sampling/dropped_groups"] for r in rl) > 0  # the filter did act


@pytest.mark.slow
def test_dynamic_sampling_with_lag_two_keeps_staleness_exact(tmp_path):
  # 30 steps, lag 2, filtering on: dropped groups are re-sampled into their own slot, so the
  # ring never loses a slot (no deadlock) and staleness stays exactly min(batch, 2).
  run_dir = tmp_path / "out"
  args = _tiny(300, 30, 30, *_ONE_DIGIT, "--config.rollout.lag=2", f"--config.run_dir={run_dir}")
  proc = _train(args, tmp_path, {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rl = _rl_rows(run_dir)
  assert [r["batch_id"] for r in rl] == list(range(30))
  _check_filtered_batches(rl)
  for r in rl:
    want = min(r["batch_id"], 2)
    for k in ("first_token", "last_token", "token_mean"):
      assert r[f"staleness/{k}/min"] == r[f"staleness/{k}/max"] == want, (r["step"], k)
    # Regeneration never over-generates; the pipeline counts every filtered group.
    assert r["dynamic_sampling/discarded_valid_samples"] == 0
    # At most L batches wait in the data plane after a step consumed its own (P x G rows each).
    assert r["data_plane/train_rows"] <= 2 * 4 * 8
  # The gate's count also covers the (up to 2) batches produced but not yet trained on.
  assert rl[-1]["pipeline/filtered"] >= sum(r["dynamic_sampling/dropped_groups"] for r in rl)


@pytest.mark.slow
def test_dynamic_sampling_synchronous_pending_cache(tmp_path):
  run_dir = tmp_path / "out"
  args = _tiny(300, 8, 8, *_ONE_DIGIT, f"--config.run_dir={run_dir}")
  proc = _train(args, tmp_path, {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rl = _rl_rows(run_dir)
  _check_filtered_batches(rl)
  for r in rl:
    # Whole extra generations fill the cache; their surplus groups are discarded whole.
    assert r["dynamic_sampling/discarded_valid_samples"] % 8 == 0
    assert r["data_plane/train_rows"] == 0  # lag 0: nothing left once the step consumed it
