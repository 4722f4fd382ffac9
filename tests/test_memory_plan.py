"""benchmarks/memory_plan.py: per-device bytes from shapes and shardings, checked by hand."""

import importlib.util
import pathlib
import sys

import pytest
from jax.sharding import PartitionSpec as P

from conftest import tiny_model_config
from jaxrl import parallel

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "memory_plan.py"
_spec = importlib.util.spec_from_file_location("memory_plan", _PATH)
mp = importlib.util.module_from_spec(_spec)
sys.modules["memory_plan"] = mp  # dataclasses look their module up there
_spec.loader.exec_module(mp)

# tiny_model_config: vocab 32, d 32, 2 layers, 4 heads, 2 kv heads, head_dim 8, mlp 64, untied.
L, D, H, K, DH, F, V = 2, 32, 4, 2, 8, 64, 32
# Leaves with an "embed" (-> fsdp) axis; 32 divides by every fsdp size used here.
SHARDED = (V * D * 2  # embed, lm_head
           + L * D * H * DH * 2  # wq, wo
           + L * D * K * DH * 2  # wk, wv
           + L * D * F * 3)  # w_gate, w_up, w_down
REPLICATED = L * D * 2 + D  # attn_norm, mlp_norm, final_norm
SIZES = mp.Sizes(rows=16, train_prompt_len=4, train_new_tokens=4, microbatches=2, prompts=4,
                 group=2, prompt_len=4, new_tokens=4)


def _plan(mesh_shape, param_dtype="float32", **kw):
  cfg = tiny_model_config(param_dtype=param_dtype, dtype=param_dtype)
  return mp.plan(cfg, parallel.make_mesh(*mesh_shape), SIZES, **kw)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 4, 1)])
@pytest.mark.parametrize("param_dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_param_optimizer_and_kv_bytes(devices, mesh_shape, param_dtype, itemsize):
  r = _plan(mesh_shape, param_dtype)
  data, fsdp = mesh_shape[:2]
  b, g = r["per_device_bytes"], r["global_bytes"]
  assert r["params"] == SHARDED + REPLICATED
  assert g["params"] == (SHARDED + REPLICATED) * itemsize
  assert b["params"] == (SHARDED // fsdp + REPLICATED) * itemsize
  assert b["gradients"] == b["params"]
  # Adam's mu and nu are laid out like the params; the rest are replicated int32 step counts.
  extra = b["optimizer_state"] - 2 * b["params"]
  assert 0 < extra <= 16 and extra % 4 == 0
  assert g["optimizer_state"] - 2 * g["params"] == extra
  # Rows over data x fsdp = 8 devices. [B, Lp]: tokens int32 + valid bool; [B, N]: tokens int32,
  # mask bool, rollout log-probs f32, completion_valid bool; [B]: three 4-byte fields.
  B, Lp, N = SIZES.rows, SIZES.train_prompt_len, SIZES.train_new_tokens
  assert b["train_batch"] * 8 == g["train_batch"] == B * (4 * Lp + Lp + 4 * N + N + 4 * N + N
                                                          + 12)
  # The sampler splits the cache's rows over 'data' (8 rows: 1 or 2 shards), never over 'fsdp'.
  rows, slots = SIZES.prompts * SIZES.group, SIZES.prompt_len + SIZES.new_tokens
  kv = L * 2 * rows * K * DH * slots * itemsize
  assert r["kv_cache"]["shards"] == data
  assert r["kv_cache"]["replicated_bytes"] == g["kv_cache"] == kv + rows * slots  # + bool mask
  assert b["kv_cache"] == (kv + rows * slots) // data
  assert r["kv_cache"]["k_shape"] == [L, rows, K, DH, slots]
  assert r["train_step"]["compiled"] is False and "memory_analysis" not in r["train_step"]
  t = r["totals_bytes"]
  assert t["train"] == b["params"] * 2 + b["optimizer_state"] + b["train_batch"]
  assert t["lag1"] == t["train"] + b["params"] + b["kv_cache"]


def test_compiled_memory_analysis(devices):
  # The one train-step compile of this file (5-10 s here): fsdp and tensor axes both in play.
  r = _plan((1, 4, 2), compile_train=True, compile_rollout=True, compile_decode=False)
  b = r["per_device_bytes"]
  for part in (r["train_step"], r["rollout"]["prefill"]):
    ma = part["memory_analysis"]
    if ma is None:  # allowed, but then the output must say why
      assert part["memory_analysis_note"]
      continue
    assert set(ma) >= {"argument_size_in_bytes", "temp_size_in_bytes"}
    for f, v in ma.items():
      assert isinstance(v, int) and v >= 0, (f, v)
  ma = r["train_step"]["memory_analysis"]
  if ma is not None:
    # The compiled step's arguments are the state and batch the eval_shape plan counted, per
    # device (+ the replicated int32 step counter): the plan and XLA agree on every sharding.
    assert ma["argument_size_in_bytes"] == (b["params"] + b["optimizer_state"]
                                            + b["train_batch"] + 4)
    assert ma["alias_size_in_bytes"] >= b["params"] + b["optimizer_state"]  # donated state
    assert r["totals_bytes"]["train"] == ma["peak_estimate_bytes"] > ma["temp_size_in_bytes"]
  # 2 kv heads on a tensor axis of 2: the sampler splits the cache by kv head (data 1 splits no
  # row), as the compiled prefill's output shardings agree (`plan` checks them).
  rows, slots = SIZES.prompts * SIZES.group, SIZES.prompt_len + SIZES.new_tokens
  assert r["kv_cache"]["shards"] == 2, r["kv_cache"]["sharding"]
  assert r["kv_cache"]["sharding"]["k"] == str(P(None, None, "tensor"))
  assert "checked" in r["kv_cache"]["sharded_as"]
  # Keys and values halved; the [rows, slots] bool validity mask (no head axis) whole.
  assert b["kv_cache"] == L * 2 * rows * K * DH * slots * 4 // 2 + rows * slots


def test_kv_cache_whole_on_fsdp_mesh(devices):
  # Rollout rows go over 'data' only: on a pure fsdp mesh every device holds the whole cache.
  r = _plan((1, 8, 1))
  rows, slots = SIZES.prompts * SIZES.group, SIZES.prompt_len + SIZES.new_tokens
  assert r["kv_cache"]["shards"] == 1 and "note" in r["kv_cache"]
  assert r["per_device_bytes"]["kv_cache"] == L * 2 * rows * K * DH * slots * 4 + rows * slots
  assert "decode" not in r["rollout"]


def test_recipe_kv_cache_drops_by_the_data_factor_on_an_8_device_rollout_mesh(devices):
  """configs/qwen2_5_0_5b_gsm8k.py's rollout (64 prompts x 8 samples, 256 + 512 cache slots,
  bf16) on Qwen2.5-0.5B shapes: 24 layers x 2 kv heads x 64 dims.

  Keys + values: 24 x 2 x 512 rows x 2 x 64 x 768 slots x 2 bytes = 4,831,838,208 bytes, + the
  512 x 768 bool mask = 4,832,231,424 (4.50 GiB) on every device unsplit; on an (8, 1, 1)
  rollout mesh each device holds 64 rows: 604,028,928 (0.56 GiB), 1/8. A (4, 1, 2) mesh splits
  rows by 4 and the 2 kv heads by 2: the keys and values by 8 again, the mask by 4.
  """
  from jaxrl.recipe import load_recipe
  recipe = mp.recipe_defaults(load_recipe(str(_PATH.parents[1] / "configs" /
                                              "qwen2_5_0_5b_gsm8k.py")), 8)
  assert recipe["mesh"] == "1,8,1"  # fsdp over every device, colocated
  sizes = mp.Sizes(rows=512, train_prompt_len=256, train_new_tokens=512,
                   microbatches=recipe["microbatches"], prompts=recipe["prompts"],
                   group=recipe["group"], prompt_len=recipe["prompt_len"],
                   new_tokens=recipe["new_tokens"])
  cfg = mp.qwen_config("0.5b", recipe["param_dtype"], recipe["dtype"])
  whole = 24 * 2 * 512 * 2 * 64 * 768 * 2 + 512 * 768
  for mesh_shape, shards, per_device in [((8, 1, 1), 8, whole // 8),
                                         ((4, 1, 2), 8, (whole - 512 * 768) // 8 + 512 * 768 // 4),
                                         ((1, 8, 1), 1, whole)]:  # the colocated recipe mesh
    kv, _ = mp.kv_cache_plan(cfg, parallel.make_mesh(*mesh_shape), sizes)
    assert kv["replicated_bytes"] == whole == 4_832_231_424
    assert kv["shards"] == shards and kv["per_device_bytes"] == per_device, (mesh_shape, kv)
  assert whole // 8 == 604_028_928


def test_qwen_shapes_match_published_counts():
  for name, (_, _, published) in mp.QWEN.items():
    cfg = mp.qwen_config(name)
    assert cfg.scan_layers and cfg.qkv_bias and cfg.rope_theta == 1e6
    n = (cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2) + cfg.d_model
         + cfg.num_layers * (
             cfg.d_model * cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * 1
             + cfg.num_heads * cfg.head_dim * cfg.d_model
             + cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads)
             + 2 * cfg.d_model + 3 * cfg.d_model * cfg.mlp_dim))
    assert n == published, name


def test_rejects_microbatches_that_do_not_split_over_devices(devices):
  bad = mp.Sizes(rows=8, train_prompt_len=4, train_new_tokens=4, microbatches=2, prompts=4,
                 group=2, prompt_len=4, new_tokens=4)
  with pytest.raises(ValueError, match="divisible by data x fsdp"):
    mp.plan(tiny_model_config(), parallel.make_mesh(1, 8, 1), bad)


def test_qwen_0_5b_matches_the_model_classmethod():
  from jaxrl.models import ModelConfig
  assert mp.qwen_config("0.5b", "float32") == ModelConfig.qwen2_5_0_5b(scan_layers=True)


def test_memory_analysis_missing_is_reported():
  class NoAnalysis:
    def memory_analysis(self):
      return None

  class Raises:
    def memory_analysis(self):
      raise NotImplementedError("not on this backend")

  class Partial:
    def memory_analysis(self):
      return type("Stats", (), {"argument_size_in_bytes": 8, "temp_size_in_bytes": 2})()

  stats, note = mp.memory_stats(NoAnalysis())
  assert stats is None and "returned None" in note
  stats, note = mp.memory_stats(Raises())
  assert stats is None and "NotImplementedError" in note
  stats, note = mp.memory_stats(Partial())
  assert stats == {"argument_size_in_bytes": 8, "temp_size_in_bytes": 2}
  assert "output_size_in_bytes" in note and "peak_estimate_bytes" not in stats
