"""benchmarks/recipe_scale.py: the FLOP and padding arithmetic by hand, and the --quick run's JSON."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_model_config

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PATH = _ROOT / "benchmarks" / "recipe_scale.py"
_spec = importlib.util.spec_from_file_location("recipe_scale", _PATH)
rs = importlib.util.module_from_spec(_spec)
sys.modules["recipe_scale"] = rs
_spec.loader.exec_module(rs)


def test_model_flops_by_hand():
  # P = 100, L = 2, H = 3, Dh = 4; one group of 2 rows sharing a 3-token prompt, completions of 2
  # and 1 tokens.
  # T = 3 (prompt once) + 2 + 1 = 6 -> 6 x 100 x 6 = 3,600.
  # C: prompt 1 + 2 + 3 = 6; row 0's tokens see 3 + 1, 3 + 2 = 9; row 1's sees 3 + 1 = 4 -> 19;
  # 12 x 2 x 3 x 4 x 19 = 5,472. Total 9,072.
  # A prompt counted per row would give T = 9 (5,400 + ...) and C = 6 + 9 + 6 + 4 = 25 (7,200).
  f = rs.model_flops(100, 2, 3, 4, [3], [2, 1], group=2)
  assert (f["trained_positions"], f["context_sum"]) == (6, 19)
  assert (f["dense_flops"], f["attention_flops"], f["flops"]) == (3600, 5472, 9072)
  # Two groups add up: a second group of prompt 1 and completions 0, 4 -> T 5, C 1 + (2+3+4+5).
  g = rs.model_flops(100, 2, 3, 4, [3, 1], [2, 1, 0, 4], group=2)
  assert (g["trained_positions"], g["context_sum"]) == (6 + 5, 19 + 15)


def test_flop_params_counts_the_head_once():
  # tiny_model_config: V 32, D 32, L 2, H 4, K 2, Dh 8, F 64. Untied: the input embedding is a
  # lookup (not counted), the LM head is. Tied: the one table counted once (as the head).
  V, D, L, H, K, DH, F = 32, 32, 2, 4, 2, 8, 64
  body = L * (D * H * DH * 2 + D * K * DH * 2 + D * F * 3 + 2 * D) + D
  assert rs.flop_params(tiny_model_config()) == body + V * D
  assert rs.flop_params(tiny_model_config(tie_embeddings=True)) == body + V * D


def test_padding_by_hand():
  # 2 groups of 2 rows, prompts 3 and 5 tokens (budget 8), completions 4, 2 | 6, 2 (budget 8):
  # real per row 7 + 5 + 11 + 7 = 30 of 4 x 16 = 64 -> 1 - 30/64; shared prompts
  # 3 + 5 + 14 = 22 of 2 x 8 + 4 x 8 = 48 -> 1 - 22/48.
  # Packing into rows of 12: group 0 is one unit 3 + 4 + 2 = 9; group 1's 5 + 6 = 11 then + 2
  # overflows 12, so row 3 starts a unit of its own with the prompt again: 5 + 2 = 7. First fit
  # decreasing: [11], [9], [7] -> 3 rows of 12, 27 real -> 1 - 27/36. (Cutting row 3 without a
  # prompt copy would give 25 real; ignoring the budget, 2 rows.)
  p, c = np.array([3, 5]), np.array([4, 2, 6, 2])
  pad = rs.padding(p, c, group=2, prompt_len=8, new_tokens=8, budget=12, share=2)
  assert pad["unpacked_rows"] == pytest.approx(1 - 30 / 64)
  assert pad["unpacked_shared_prompts"] == pytest.approx(1 - 22 / 48)
  assert (pad["packing_units"], pad["packed_rows_used"]) == (3, 3)
  assert pad["packed"] == pytest.approx(1 - 27 / 36)
  # Without sharing every row is a unit with its own prompt.
  assert rs.packing_units(np.repeat(p, 2), c, 0, 12) == [7, 5, 11, 7]


def test_peak_table():
  assert rs.peak_tflops("NVIDIA H100 80GB HBM3", None)[0] == 989.0
  assert rs.peak_tflops("TPU v5 lite", None)[0] == 197.0
  assert rs.peak_tflops("cpu", None)[0] is None
  assert rs.peak_tflops("cpu", 1.5)[0] == 1.5


def test_decode_roofline_by_hand():
  # W = 1,000 f32 params (4 bytes), L = 2, K = 2, Dh = 4, bf16 cache (2 bytes), B = 3 rows,
  # Lp = 5, N = 6. Weights 4,000 bytes. One slot of every row: 2 x 2 (k, v) x 2 x 4 x 2 x 3 = 192
  # bytes. Decode steps s = 1..5 attend 5 + s = 6, 7, 8, 9, 10 slots: mean 8 = Lp + N / 2, so the
  # cache is 192 x 8 = 1,536 bytes a step; 5,536 in all. The full cache (11 slots): 2,112.
  # At 0.001 GB/s (1e6 bytes/s) a step takes 5.536 ms: 3 rows / 5.536 ms = 541.9 tokens/s.
  f = rs.decode_roofline(1000, 4, 2, 2, 4, 2, rows=3, prompt_len=5, new_tokens=6, peak_gbs=1e-3)
  assert (f["weights_bytes"], f["kv_bytes_mean"], f["bytes_per_step"]) == (4000, 1536, 5536)
  assert (f["mean_filled_new_tokens"], f["kv_bytes_full_cache"]) == (3, 2112)
  assert f["roofline_tokens_per_s"] == pytest.approx(3 / 5.536e-3)
  assert rs.decode_roofline(1000, 4, 2, 2, 4, 2, 3, 5, 6)["roofline_tokens_per_s"] is None


def test_peak_bandwidth_table():
  assert rs.peak_gbs("NVIDIA H100 80GB HBM3", None)[0] == 3350.0
  assert rs.peak_gbs("NVIDIA H100 PCIe", None)[0] == 2000.0
  assert rs.peak_gbs("NVIDIA H200", None)[0] == 4800.0
  assert rs.peak_gbs("NVIDIA A100-SXM4-80GB", None)[0] == 2039.0
  assert rs.peak_gbs("NVIDIA A100-SXM4-40GB", None)[0] == 1555.0
  assert rs.peak_gbs("TPU v5 lite", None)[0] == 819.0
  assert rs.peak_gbs("TPU v5p", None)[0] == 2765.0
  assert rs.peak_gbs("cpu", None)[0] is None
  assert rs.peak_gbs("NVIDIA H200", 4300.0) == (4300.0, "--peak-gbs")


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--packing", "--no-packing"])
def test_quick_run_json(flag):
  # One CPU device (the recipe's fsdp = -1 would otherwise take conftest's 8 simulated ones).
  # The rollout runs in one of the two (it does not depend on packing), so the other stays short.
  env = {**os.environ, "PYTHONPATH": str(_ROOT), "XLA_FLAGS": ""}
  rollout = flag == "--packing"
  out = subprocess.run([sys.executable, str(_PATH), "--quick", flag, "--steps", "1",
                        "--warmup", "0", "--padding-batches", "2",
                        "--rollout" if rollout else "--no-rollout", "--rollout-calls", "1"],
                       cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(out.stdout)
  assert r["benchmark"] == "recipe_scale"
  if rollout:
    ro = r["rollout"]
    assert (ro["rows"], ro["prompt_len"], ro["new_tokens"]) == (4, 32, 8)
    # The JSON rounds the rate to 0.1 (38.1 for 38.139 on a slow machine): half that step.
    assert ro["tokens_per_s"] == pytest.approx(4 * 8 / ro["median_call_s"], rel=1e-3, abs=0.05)
    assert ro["ms_per_decode_step"] > 0 and ro["median_prefill_s"] < ro["median_call_s"]
    roof = ro["roofline"]
    # The recipe samples with the trainer's f32 weights and bf16 compute ("auto").
    assert (ro["param_dtype"], ro["dtype"]) == ("float32", "bfloat16")
    assert roof["weights_bytes"] == 4 * rs.flop_params(rs.ModelConfig(**{
        **rs.ARCHITECTURES["qwen2.5-0.5b"], "num_layers": 2, "vocab_size": 4096}))
    # The KV cache at its own dtype (rollout.kv_cache_dtype "auto": the bf16 compute on CPU):
    # 2 layers x 2 x 2 kv heads x 64 x 2 bytes x 4 rows x (32 + 8 / 2)
    assert ro["kv_cache_dtype"] == "bfloat16" and ro["fused_sampling"] is False
    assert ro["kv_bytes_per_position_row"] == 2 * 2 * 2 * 64 * 2
    assert roof["kv_bytes_mean"] == 2 * 2 * 2 * 64 * 2 * 4 * 36
    assert roof["roofline_tokens_per_s"] is None and ro["fraction_of_roofline"] is None
    assert ro["hf"] is None and "--hf" in ro["hf_reason"]
  else:
    assert r["rollout"] is None
  assert flag in r["command"] and r["versions"]["jax"] and r["device"]["backend"] == "cpu"
  assert r["device"]["peak_bf16_tflops"] is None and r["mfu"] is None
  assert r["model"]["num_layers"] == 2 and r["model"]["d_model"] == 896
  assert r["batch"]["rows"] == 16 and r["timing"]["applied_steps"] == 1
  assert r["step"]["packing"] == (flag == "--packing")
  mb = r["step"]["micro_batches"]
  assert mb["count"] >= 1
  if flag == "--packing":
    assert mb["streams_used"] == r["padding"]["timed_batch"]["packed_rows_used"]
  assert r["compiled_memory"]["temp_size_in_bytes"] > 0
  f = r["flops"]
  assert f["flops"] == f["dense_flops"] + f["attention_flops"]
  assert r["trained_positions_per_s"] == pytest.approx(
      f["trained_positions"] / r["timing"]["median_step_s"], rel=1e-3)
  pad = r["padding"]["timed_batch"]
  assert 0 <= pad["packed"] < pad["unpacked_rows"] < 1
