"""benchmarks/lora_publish.py --quick: what a published LoRA version moves, checked by hand.

One run of the benchmark's smoke test (tiny shapes; compiled with LLVM's optimisation off, since
only its bytes and tokens are checked here, not its times): ~15 s of CPU.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # one benchmark run (~15 s) that every test here reads

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def adapter_params(c: dict) -> int:
  """sum over targets of L x (din + dout) x r: A [L, din, r] and B [L, r, dout], heads flattened
  (q and o: heads x head_dim; k and v: kv heads x head_dim; gate, up, down: d_model and mlp)."""
  D, F = c["d_model"], c["mlp_dim"]
  q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
  dims = {"q": (D, q), "k": (D, kv), "v": (D, kv), "o": (q, D), "gate": (D, F), "up": (D, F),
          "down": (F, D)}
  return sum(c["num_layers"] * (dims[t][0] + dims[t][1]) * c["lora_rank"]
             for t in c["lora_targets"])


def model_params(c: dict) -> int:
  """The model without adapters: embeddings (+ untied head), per layer q/k/v/o (+ q/k/v bias),
  two norms and the SwiGLU MLP, and the final norm."""
  D, F, V, L = c["d_model"], c["mlp_dim"], c["vocab_size"], c["num_layers"]
  q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
  per_layer = D * (q + 2 * kv) + q * D + 2 * D + 3 * D * F + ((q + 2 * kv) if c["qkv_bias"] else 0)
  return V * D * (1 if c["tie_embeddings"] else 2) + L * per_layer + D


@pytest.fixture(scope="module")
def report():
  env = dict(os.environ, PYTHONPATH=REPO)
  # The benchmark sets its own 8 host devices; its smoke test's programs are run a few times
  # only, so skip LLVM's optimisation of them (compiles take about 60% of the time).
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "lora_publish.py"),
                        "--quick", "--repeats", "2", "--sampler-repeats", "2"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(run.stdout)


def test_bytes_per_version_are_the_adapters(report):
  b = report["bytes"]  # the Qwen2.5-0.5B shape, f32, rank 16 on all seven targets
  c = b["model_config"]
  assert (c["num_layers"], c["d_model"], c["lora_rank"], len(c["lora_targets"])) == (24, 896, 16, 7)
  # 24 x 16 x ((896+896) + 2 (896+128) + (896+896) + 2 (896+4864) + (4864+896)) = 8,798,208
  assert adapter_params(c) == b["adapter_params"] == 8_798_208
  assert model_params(c) == b["model_params"] == 494_032_768
  assert b["adapter_bytes"] == 4 * 8_798_208 and b["model_bytes"] == 4 * 494_032_768
  assert b["ratio"] == b["adapter_bytes"] / b["model_bytes"] == 8_798_208 / 494_032_768
  assert b["met"] is True and b["ratio"] <= 1 / 50  # 1/56.2


@pytest.mark.parametrize("where", ["colocated", "disaggregated"])
def test_adapter_sync_moves_the_base_once_then_adapters_only(report, where):
  p = report["publish"]
  c = p["model_config"]
  assert p["adapter_bytes"] == 4 * adapter_params(c)
  assert p["model_bytes"] == 4 * model_params(c)
  s = p[where]
  assert s["moved_bytes_first"] == p["model_bytes"] + p["adapter_bytes"]
  assert s["moved_bytes_after"] == [p["adapter_bytes"]] * report["repeats"]
  # (The benchmark also checks every merged weight against lora.merge's, on the right devices.)
  assert len(s["with_lora_times_s"]) == len(s["without_lora_times_s"]) == report["repeats"]
  if where == "disaggregated":
    assert s["base_bytes"] == p["model_bytes"]
  assert set(p["merged_leaves_checked"]) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def test_merged_sampler_samples_the_applied_samplers_tokens(report):
  s = report["sampler"]["default"]
  # Same keys, adapters applied in every matmul vs folded into the weights: the same tokens
  # exactly (the float sums differ in order only: log-probs agree to ~1e-6).
  assert s["tokens_equal"] is True and s["token_match_fraction"] == 1.0
  assert s["max_abs_logprob_diff_equal_prefix"] < 1e-4
  assert s["rows"] * s["new_tokens"] == s["generated_tokens_per_call"]
  assert s["faster"] in ("merge", "apply")
