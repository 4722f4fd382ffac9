"""Low-precision rollouts (`rollout.dtype`): the config is checked; `cast_params` makes fresh,
same-sharded copies; the samplers' model, KV cache and published params are bfloat16 while the
log-probs stay float32 and differ from the float32 trainer's recompute by bfloat16 rounding;
evaluation on the trainer's float32 params with the bfloat16 model casts on the fly to the same
policy; and a run's mismatch metrics see that gap, which a float32 sampler does not have (slow
step: two whole runs)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl.run import driver
from jaxrl.recipes.default import get_config
from jaxrl.data import left_pad
from jaxrl.run.validation import evaluate
from jaxrl.models import KVCache
from jaxrl.run.parts import build_parts
from jaxrl.rollout.precision import cast_params, rollout_dtype
from jaxrl.learner.step import StepConfig, completion_logprobs
from jaxrl.core.types import TrainBatch


def _cfg(dtype="bfloat16", **over):
  """The default recipe's model, a few rows: builds in a second or two."""
  cfg = get_config()
  cfg.task.num_digits, cfg.task.dev_size, cfg.task.val_size = 1, 16, 16
  cfg.val.batch_size = 16
  cfg.rollout.num_prompts, cfg.rollout.group_size = 4, 4
  cfg.rollout.dtype = dtype
  for k, v in over.items():
    section, key = k.split("__")
    cfg[section][key] = v
  return cfg


def _parts(dtype="bfloat16", **over):
  cfg = _cfg(dtype, **over)
  return build_parts(cfg, config_lib.validate(cfg, jax.device_count()))


def _buffers(x) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


@pytest.mark.parametrize("bad", ["float16", "bf16", "", "half"])
def test_bad_rollout_dtype_is_named(bad):
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(_cfg(bad), 8)
  assert info.value.problems == [
      f"config.rollout.dtype: must be one of ['auto', 'bfloat16', 'float32'], got {bad!r}"]


def test_rollout_dtype_is_none_for_the_trainers_own_precision():
  assert rollout_dtype(_cfg("auto")) is None
  assert rollout_dtype(_cfg("float32")) is None  # the default model is float32 throughout
  assert rollout_dtype(_cfg("bfloat16")) == "bfloat16"
  # float32 params with bfloat16 compute: "float32" is a change (the compute), not "auto".
  assert rollout_dtype(_cfg("float32", model__dtype="bfloat16")) == "float32"
  assert rollout_dtype(_cfg("bfloat16", model__param_dtype="bfloat16",
                            model__dtype="bfloat16")) is None


def test_cast_params_makes_fresh_same_sharded_copies(devices):
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(2, 4), ("data", "fsdp"))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "data"))
  one = jax.sharding.SingleDeviceSharding(devices[3])
  tree = {"w": jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 7, split),
          "step": jax.device_put(jnp.arange(4, dtype=jnp.int32), one)}
  for dtype, want in ((None, jnp.float32), ("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    out = cast_params(tree, dtype)
    assert out["w"].dtype == want and out["step"].dtype == jnp.int32  # ints are never cast
    for k in tree:
      assert out[k].sharding == tree[k].sharding
      assert not _buffers(out[k]) & _buffers(tree[k]), (dtype, k)  # a copy, even uncast
    # bfloat16 keeps 8 bits of mantissa: 1/7 = 0.142857... -> 0.142578125 (a float32 copy or a
    # cast that dropped the rounding would give other values).
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(tree["w"].astype(want)))
    np.testing.assert_array_equal(np.asarray(out["step"]), np.arange(4))
  assert float(cast_params(tree, "bfloat16")["w"][0, 1]) == 0.142578125
  # The copy outlives the source's deletion (what donating it to the train step does).
  out = cast_params(tree, "bfloat16")
  tree["w"].delete()
  assert float(out["w"][0, 1]) == 0.142578125


@pytest.mark.slow  # three sampler compiles: with the slow tests
def test_samplers_run_in_bfloat16_with_float32_logprobs():
  parts, params = _parts("bfloat16")
  assert parts.rollout_graphdef is not parts.graphdef
  copy = parts.rollout_copy(params)
  model = nnx.merge(parts.rollout_graphdef, copy)
  assert (model.cfg.param_dtype, model.cfg.dtype) == ("bfloat16", "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(copy)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}  # untouched
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
    assert a.sharding == b.sharding and not _buffers(a) & _buffers(b)

  tasks = parts.source.split("val")[:4]
  prompts, valid = left_pad([parts.tok.encode_prompt(t.prompt) for t in tasks],
                            parts.cfg.rollout.max_prompt_len, parts.tok.pad_id)
  # The samplers make their KV cache with `KVCache.zeros(model.cfg, ...)`: the compute dtype.
  cache = KVCache.zeros(model.cfg, 1, 8)
  assert {x.dtype for x in jax.tree.leaves((cache.k, cache.v))} == {jnp.dtype(jnp.bfloat16)}
  ids = np.arange(16, dtype=np.int32)
  out = jax.tree.map(np.asarray, parts.train_loop().sample_first(
      copy, prompts, valid, jax.random.key(3), ids, 1.0))
  assert out.logprobs.dtype == np.float32 and out.mask.sum() > 16
  # The float32 trainer's log-probs of the same tokens: a gap of bfloat16 rounding, a mean of
  # ~5e-4 (max ~2e-3) on log-probs of about -2.6 here (a float32 sampler: ~1e-7).
  batch = TrainBatch(np.repeat(prompts, 4, 0), np.repeat(valid, 4, 0), out.tokens, out.mask,
                     out.logprobs, np.zeros(16, np.float32), np.repeat(np.arange(4), 4),
                     np.ones(16, np.float32))
  recompute = jax.jit(completion_logprobs, static_argnums=(0, 3, 4))
  trainer_lp, _ = recompute(parts.graphdef, params, batch, StepConfig(), False)
  gap = np.abs(np.asarray(trainer_lp) - out.logprobs)[out.mask]
  assert 1e-4 < gap.mean() < 3e-2, gap.mean()
  # Evaluation of the trainer's float32 params (the warm-up's, or on several processes the train
  # state's) measures the same policy as that of the published copy.
  drop = lambda m: {k: v for k, v in m.items() if k != "val/time_s"}
  assert drop(evaluate(parts, params, "val", "f32")) == drop(evaluate(parts, copy, "val", "bf16"))


def test_auto_and_same_dtype_share_the_trainers_model():
  parts, params = _parts("float32")
  assert parts.rollout_graphdef is parts.graphdef
  copy = parts.rollout_copy(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
    assert a.dtype == b.dtype == jnp.float32 and not _buffers(a) & _buffers(b)


def test_disaggregated_copy_is_cast_and_on_the_rollout_devices():
  parts, params = _parts("bfloat16", mesh__rollout=4, mesh__data=4)
  copy = parts.rollout_copy(params)
  on = {d.id for x in jax.tree.leaves(copy) for d in x.sharding.device_set}
  assert on == {4, 5, 6, 7}
  assert {x.dtype for x in jax.tree.leaves(copy)} == {jnp.dtype(jnp.bfloat16)}
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))


def _run_mismatch(tmp_path, dtype) -> list[float]:
  run_dir = tmp_path / dtype
  # The bfloat16 run also evaluates at its end (on the published bfloat16 copy).
  cfg = _cfg(dtype, sft__enabled=False, train__steps=2, val__at_start=False,
             val__at_end=dtype == "bfloat16", val__every=100)
  cfg.run_dir = str(run_dir)
  driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()))
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2]
  assert [r["step"] for r in rows if r["phase"] == "val"] == ([2] if dtype == "bfloat16" else [])
  return [r["mismatch/abs_diff/mean"] for r in rl]


# Two whole runs (each compiles a train step and a sampler): the slow step.
@pytest.mark.slow
def test_bfloat16_rollouts_show_in_the_mismatch_metrics(tmp_path):
  """Same run, same keys: with a float32 sampler its log-probs are the trainer's recompute up to
  float32 rounding (measured ~2e-8 mean); a bfloat16 sampler's differ by bfloat16 rounding
  (~6e-4), the gap the mismatch metrics and `loss.correction` exist for."""
  f32 = _run_mismatch(tmp_path, "float32")
  bf16 = _run_mismatch(tmp_path, "bfloat16")
  assert max(f32) < 1e-5, f32
  assert min(bf16) > 1e-4, bf16
