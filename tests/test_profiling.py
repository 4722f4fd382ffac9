"""Profiling and the per-step time breakdown: `profile.steps` is checked up front and traces
exactly its window; the model-FLOPs formula behind `perf/mfu`; every RL row's `perf/*` keys are
there, non-negative, and the phases add up to the step time."""

from __future__ import annotations

import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest

from jaxrl import config as config_lib
from jaxrl.observe import profiling
from jaxrl.run import driver
from jaxrl.recipes.default import get_config
from jaxrl.models import ModelConfig

PERF_PHASES = ("perf/wait_s", "perf/train_s", "perf/publish_s", "perf/val_s")


def tiny_cfg(run_dir, **over):
  """A run of a few seconds of steps (no warm-up, one validation at the end)."""
  cfg = get_config()
  cfg.model.d_model, cfg.model.head_dim, cfg.model.mlp_dim = 32, 16, 64
  cfg.sft.enabled = False
  cfg.train.steps = 4
  cfg.rollout.num_prompts = 4
  cfg.val.at_start, cfg.val.every = False, 100
  cfg.task.dev_size = cfg.task.val_size = cfg.val.batch_size = 16
  cfg.run_dir = str(run_dir)
  for k, v in over.items():
    section, key = k.split("__")
    cfg[section][key] = v
  return cfg


@pytest.mark.parametrize("steps", ["3", "a:b", "0:2", "3:2", "1:2:3", ":4", "2.5:3"])
def test_malformed_profile_steps_is_named(tmp_path, steps):
  cfg = tiny_cfg(tmp_path / "run", profile__steps=steps)
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(cfg, jax.device_count())
  assert info.value.problems == [
      f"config.profile.steps: must be '' (off) or 'A:B' with whole numbers 1 <= A <= B (RL steps "
      f"A to B), got {steps!r}"]


def test_profile_window_after_the_last_step_and_negative_peak_are_named(tmp_path):
  cfg = tiny_cfg(tmp_path / "run", profile__steps="5:9", profile__peak_flops=-1.0)
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(cfg, jax.device_count())
  assert sorted(info.value.problems) == [
      "config.profile.peak_flops: must be >= 0, got -1.0",
      "config.profile.steps: '5:9' starts after the last RL step (config.train.steps = 4), so "
      "nothing would be traced"]
  for ok in ("", "1:1", "4:9"):  # a window may run past the end: it stops with the run
    config_lib.validate(tiny_cfg(tmp_path / "run", profile__steps=ok), jax.device_count())


def test_step_flops_counts_shared_prompts_once():
  cfg = get_config()  # 128 prompts x 8 samples, 6 prompt + 4 completion tokens, shared prompts
  model = ModelConfig(vocab_size=16, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=192)
  n = 100_000
  # Matmul params: 100,000 - 16 x 64 (untied input embedding) = 98,976.
  # Tokens: 128 groups x (6 + 8 x 4) = 4,864. Causal pairs: 128 x (6^2/2 + 8 x (4 x 6 + 4^2/2))
  # = 128 x 274 = 35,072. Forward: 2 x 98,976 x 4,864 + 4 x 2 layers x 4 heads x 16 x 35,072
  # = 962,838,528 + 17,956,864 = 980,795,392; training = 3 forward passes.
  assert profiling.step_flops(cfg, model, n) == (3 * 980_795_392, 4_864)
  # Without sharing every row runs its prompt: 1,024 rows x 10 tokens, 1,024 x 10^2 / 2 pairs
  # (counting the shared prompt G times overstates the dense work by 10,240 / 4,864 = 2.1x).
  cfg.train.share_prompts = False
  assert profiling.step_flops(cfg, model, n) == (
      3 * (2 * 98_976 * 10_240 + 4 * 2 * 4 * 16 * 51_200), 10_240)
  # A reference model adds one forward pass; a tied embedding is the output matmul.
  cfg.ref_kl.coef = 0.1
  tied = ModelConfig(**{**model.__dict__, "tie_embeddings": True})
  assert profiling.step_flops(cfg, tied, n)[0] == 4 * (2 * n * 10_240 + 4 * 2 * 4 * 16 * 51_200)


def test_peak_flops_by_device_kind():
  assert profiling.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert profiling.peak_flops("TPU v5 lite") == 197e12  # not v5p's 459e12
  assert profiling.peak_flops("TPU v5") == 459e12
  assert math.isnan(profiling.peak_flops("cpu"))


def _trace_files(directory):
  return sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*")))


def test_profiler_traces_its_window_only(tmp_path):
  prof = profiling.StepProfiler((2, 3), str(tmp_path / "profile"))
  tracing = []
  for step in range(1, 6):
    prof.step(step)
    tracing.append(prof.tracing)
    (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
  prof.close()
  assert tracing == [False, True, True, False, False]
  files = _trace_files(tmp_path / "profile")
  assert any(f.endswith(".xplane.pb") for f in files), files
  assert all(os.path.getsize(f) > 0 for f in files)
  off = profiling.StepProfiler((1, 2), None)  # no directory (processes other than 0): off
  off.step(1)
  assert not off.tracing


@pytest.mark.slow  # a whole (tiny) run: ~60 s on 2 busy cores
def test_run_writes_its_trace_and_a_time_breakdown_per_step(tmp_path):
  run_dir = tmp_path / "run"
  cfg = tiny_cfg(run_dir, profile__steps="2:3", profile__peak_flops=1e12)
  driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()))
  files = _trace_files(run_dir / "profile")
  for suffix in (".xplane.pb", "perfetto_trace.json.gz"):  # TensorBoard / Perfetto
    hits = [f for f in files if f.endswith(suffix)]
    assert hits and all(os.path.getsize(f) > 0 for f in hits), files
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3, 4]
  # 4 groups x (6 prompt + 8 x 4 completion tokens), the prompt shared by the group.
  tokens = 4 * (6 + 8 * 4)
  assert profiling.step_flops(cfg, ModelConfig(16, 32, 2, 4, 2, 16, 64), 0)[1] == tokens
  for r in rl:
    for key in (*PERF_PHASES, "perf/step_time_s", "perf/rollout_s", "perf/train_tokens_per_s",
                "perf/gen_tokens_per_s", "perf/mfu"):
      assert r[key] is not None and r[key] >= 0, (key, r)
    # The phases partition the step: their sum is the step time (to float rounding).
    assert sum(r[k] for k in PERF_PHASES) == pytest.approx(r["perf/step_time_s"], abs=1e-9)
    assert r["perf/step_time_s"] <= r["perf/elapsed_s"]
    assert r["perf/rollout_s"] == r["perf/sample_time_s"]
    assert r["perf/train_tokens_per_s"] * r["perf/train_s"] == pytest.approx(tokens)
    assert 0 < r["perf/mfu"] < 1
  # The first step waits for the first batch's generation (compiling the sampler): lag 0 means
  # the trainer waits for each batch, so wait_s covers that batch's rollout.
  assert rl[0]["perf/wait_s"] >= 0.5 * rl[0]["perf/rollout_s"]
