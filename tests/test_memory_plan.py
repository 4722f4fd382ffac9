"""benchmarks/memory_plan.py: per-device bytes from shapes and shardings, checked by hand."""

import importlib.util
import pathlib
import sys

import jax
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


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
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
  from jaxrl.config.loader import load_recipe
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


# LoRA rank 4 on all seven projections of tiny_model_config. A target adapting a [din, dout]
# projection holds A [L, din, r] and B [L, r, dout]: L x (din + dout) x r parameters.
R = 4
LORA_DIMS = {"q": (D, H * DH), "k": (D, K * DH), "v": (D, K * DH), "o": (H * DH, D),
             "gate": (D, F), "up": (D, F), "down": (F, D)}
ADAPTERS = sum(L * (din + dout) * R for din, dout in LORA_DIMS.values())
# = 2 x 4 x ((32+32) + 2 (32+16) + (32+32) + 2 (32+64) + (64+32)) = 8 x 512
assert ADAPTERS == 4096


def _lora_plan(mesh_shape, param_dtype="float32", **kw):
  import types
  from jaxrl.models import lora
  cfg = lora.with_lora(tiny_model_config(param_dtype=param_dtype, dtype=param_dtype),
                       types.SimpleNamespace(rank=R, alpha=8.0, targets=",".join(LORA_DIMS),
                                             dropout=0.0))
  return mp.plan(cfg, parallel.make_mesh(*mesh_shape), SIZES, **kw)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 4, 1)])
@pytest.mark.parametrize("param_dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_lora_trains_adapters_only(devices, mesh_shape, param_dtype, itemsize):
  full, r = _plan(mesh_shape, param_dtype), _lora_plan(mesh_shape, param_dtype)
  fsdp = mesh_shape[1]
  b, g = r["per_device_bytes"], r["global_bytes"]
  assert r["params"] == SHARDED + REPLICATED  # the model's own, adapters not counted
  assert r["trainable_params"] == r["lora"]["adapter_params"] == ADAPTERS
  assert r["lora"]["adapter_params_arithmetic"] == ADAPTERS
  assert mp.lora_params(mp.qwen_config("0.5b")) == 0  # no rank: no adapters
  # Adapters are f32 whatever the base's dtype, and replicated (their rule: ('layers', None,
  # None)): all of them on every device. The frozen base is laid out as the full model's params.
  assert b["trainable_params"] == g["trainable_params"] == ADAPTERS * 4
  assert b["frozen_params"] == full["per_device_bytes"]["params"] == \
      (SHARDED // fsdp + REPLICATED) * itemsize
  assert b["params"] == b["frozen_params"] + b["trainable_params"]
  # Gradients and Adam's mu + nu for the adapters alone (+ int32 step counts).
  assert b["gradients"] == ADAPTERS * 4
  extra = b["optimizer_state"] - 2 * ADAPTERS * 4
  assert 0 < extra <= 16 and extra % 4 == 0
  # The sampler gets merged weights in the base layout: published copy and KV cache as without.
  assert b["published_params"] == b["frozen_params"]
  assert b["kv_cache"] == full["per_device_bytes"]["kv_cache"]
  t = r["totals_bytes"]
  assert t["train"] == b["params"] + b["gradients"] + b["optimizer_state"] + b["train_batch"]
  assert t["rollout"] == b["published_params"] + b["kv_cache"]
  assert t["lag1"] == t["train"] + t["rollout"]
  c = mp.lora_comparison(full, r)
  assert c["trainable_params"] == [SHARDED + REPLICATED, ADAPTERS]
  assert c["per_device_bytes"]["gradients"] == {
      "without_lora": full["per_device_bytes"]["params"], "with_lora": ADAPTERS * 4,
      "ratio": round(ADAPTERS * 4 / full["per_device_bytes"]["params"], 5)}


def test_lora_adapter_counts_of_qwen_shapes():
  """Rank 16 on q, k, v, o, gate, up, down: L x 16 x sum of (din + dout), from each config.json
  (heads x head_dim for q/o, kv heads x head_dim for k/v). Shapes only: nothing allocated."""
  import types
  from jaxrl.models import lora
  section = types.SimpleNamespace(rank=16, alpha=32.0, targets="q,k,v,o,gate,up,down",
                                  dropout=0.0)
  expected = {
      # 24 x 16 x ((896+896) + 2 (896+128) + (896+896) + 2 (896+4864) + (4864+896))
      "0.5b": 24 * 16 * (1792 + 2 * 1024 + 1792 + 2 * 5760 + 5760),
      # 28 x 16 x ((1536+1536) + 2 (1536+256) + (1536+1536) + 2 (1536+8960) + (8960+1536))
      "1.5b": 28 * 16 * (3072 + 2 * 1792 + 3072 + 2 * 10496 + 10496),
      # 28 x 16 x ((3584+3584) + 2 (3584+512) + (3584+3584) + 2 (3584+18944) + (18944+3584))
      "7b": 28 * 16 * (7168 + 2 * 4096 + 7168 + 2 * 22528 + 22528),
  }
  assert expected == {"0.5b": 8_798_208, "1.5b": 18_464_768, "7b": 40_370_176}
  for name, n in expected.items():
    cfg = lora.with_lora(mp.qwen_config(name), section)
    got = sum(int(x.size) for x in jax.tree.leaves(lora.abstract_adapters(cfg)))
    assert got == mp.lora_params(cfg) == n, name
