"""benchmarks/vs_trl.py's accounting: the train step's FLOPs by hand, the matmul peak, the command."""

import importlib.util
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"
_spec = importlib.util.spec_from_file_location("vs_trl", _PATH)
vs = importlib.util.module_from_spec(_spec)
sys.modules["vs_trl"] = vs
_spec.loader.exec_module(vs)

PARAMS = 494_720  # the workload's Qwen2 (vocab 16, d 128, 2 layers, SwiGLU 512, q/k/v biases)


def test_train_step_flops_by_hand():
  # Shared prompts: 8 prompts x 7 positions + 64 rows x 16 completion positions = 1,080.
  # Attention keys per layer: prompts 8 x (1 + ... + 7) = 8 x 28 = 224; completions
  # 64 x sum_{j=1..16} (7 + j) = 64 x (112 + 136) = 15,872; 16,096 in all.
  f = vs.train_step_flops(PARAMS)
  assert f["positions"] == 1_080
  assert f["dense_flops"] == 6 * PARAMS * 1_080 == 3_205_785_600
  assert f["attention_flops"] == 3 * 2 * 2 * 128 * 16_096 * 2 == 49_446_912
  assert f["flops"] == 3_255_232_512
  # Unshared: 64 x (7 + 16) = 1,472 positions; prompt keys 64 x 28 = 1,792.
  g = vs.train_step_flops(PARAMS, share_prompts=False)
  assert g["positions"] == 1_472
  assert g["attention_flops"] == 12 * 128 * (1_792 + 15_872) * 2


def test_matmul_peak_times_one_product():
  r = vs.matmul_peak(n=128, runs=3)
  assert r["flops"] == 2 * 128 ** 3
  assert 0 < r["best_s"] <= r["median_s"]
  assert abs(r["gflops_best"] - r["flops"] / r["best_s"] / 1e9) < 1e-6


def test_sampler_logprobs_are_dropped_at_lag_0_only():
  class Args:
    jaxrl_python, steps = "python", 100

  lag0 = vs.jaxrl_command(Args, "m", "r", "c", 0, 0)
  lag1 = vs.jaxrl_command(Args, "m", "r", "c", 1, 0)
  assert "--config.rollout.logprobs=false" in lag0
  assert not any("logprobs" in a for a in lag1)
  assert "--config.rollout.lag=1" in lag1
