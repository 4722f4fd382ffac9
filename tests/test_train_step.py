"""Train step: sharded == single device, micro-batched == whole batch, non-finite skip."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
import numpy as np

from conftest import tiny_model_config
from jaxrl import losses, parallel
from jaxrl.models import init_model
from jaxrl.learner.step import (StepConfig, build_train_step, learning_rate_schedule, make_optimizer,
                              row_shards, shard_params)
from jaxrl.core.types import TrainBatch

B, LP, N = 16, 6, 5


def _batch(seed=0, vocab=32) -> TrainBatch:
  rng = np.random.default_rng(seed)
  prompts = rng.integers(2, vocab, (B, LP)).astype(np.int32)
  valid = np.ones((B, LP), bool)
  for i in range(B):  # left padding of varying length
    pad = rng.integers(0, LP - 1)
    prompts[i, :pad], valid[i, :pad] = 0, False
  lengths = rng.integers(1, N + 1, B)
  mask = np.arange(N)[None] < lengths[:, None]
  tokens = np.where(mask, rng.integers(2, vocab, (B, N)), 0).astype(np.int32)
  return TrainBatch(prompts, valid, tokens, mask,
                    np.where(mask, -rng.random((B, N)), 0).astype(np.float32),
                    rng.integers(0, 2, B).astype(np.float32), np.arange(B, dtype=np.int32) // 4,
                    np.full(B, 0.9, np.float32))


def _run(mesh_shape, num_microbatches=1, loss="rl", batch=None, steps=2, step_cfg=None,
         **model_overrides):
  cfg = tiny_model_config(**model_overrides)
  mesh = parallel.make_mesh(*mesh_shape)
  graphdef, params = init_model(cfg, seed=0)
  params = shard_params(params, mesh)
  opt = make_optimizer(1e-3, b2=0.98)
  step_cfg = step_cfg or StepConfig(loss=loss)
  step_cfg = dataclasses.replace(step_cfg, num_microbatches=num_microbatches)
  step, init = build_train_step(graphdef, opt, step_cfg, mesh, params)
  state = init(params)
  batch = _batch() if batch is None else batch
  losses = []
  for _ in range(steps):
    state, m = step(state, jax.device_put(batch, parallel.batch_sharding(mesh)))
    losses.append(float(m["loss"]))
  return state, m, losses


def _max_param_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow  # 8-device compiles (fast-suite time budget)
def test_sharded_step_matches_single_device(devices):
  ref_state, ref_m, ref_losses = _run((1, 1, 1))
  state, m, losses = _run((2, 2, 2))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  assert _max_param_diff(state.params, ref_state.params) <= 1e-5
  # The params really were distributed: wq [L, D, H, Dh] over fsdp (D) and tensor (H).
  spec = state.params["wq"][...].sharding.spec
  assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  # Two steps moved the params, so "equal" is not "both unchanged".
  _, init_params = init_model(tiny_model_config(), seed=0)
  assert _max_param_diff(state.params, init_params) > 1e-4


@pytest.mark.slow  # ~10 s each on 2 quiet cores; the fast suite's budget is 10 min
@pytest.mark.parametrize("remat", ["none", "full"])
def test_fsdp_step_with_row_split_activations_matches_single_device(devices, remat):
  # Pure FSDP (rows and d_model both over 'fsdp'): the model pins its activations to the rows
  # (`constrain_rows`), with and without rematerialisation; same result as one device.
  ref_state, _, ref_losses = _run((1, 1, 1), num_microbatches=2, scan_layers=True)
  state, _, losses = _run((1, 8, 1), num_microbatches=2, scan_layers=True, remat=remat)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  assert _max_param_diff(state.params, ref_state.params) <= 1e-5


@pytest.mark.slow  # 8-device compiles (fast-suite time budget)
def test_activations_are_constrained_to_rows_only_on_a_multi_device_mesh(devices):
  # The residual stream of every layer is pinned to ('data', 'fsdp') when the step has more
  # than one row shard, and nothing is added on one device (the default run's program).
  def constraints(mesh_shape):
    cfg = tiny_model_config(scan_layers=False)
    mesh = parallel.make_mesh(*mesh_shape)
    graphdef, params = init_model(cfg, seed=0)
    step, init = build_train_step(graphdef, make_optimizer(1e-3), StepConfig(), mesh, params)
    state = jax.eval_shape(init, shard_params(params, mesh))
    batch = jax.device_put(_batch(), parallel.batch_sharding(mesh))
    text = step.jitted.lower(state, batch).as_text()
    return text.count("sharding_constraint"), text

  n1, _ = constraints((1, 1, 1))
  n8, text = constraints((1, 8, 1))
  # One device: only the step's own constraints on each micro-batch's fields (7 here), as before.
  assert n1 == 7
  assert n8 > n1 + 2 * tiny_model_config().num_layers
  assert '[{"data", "fsdp"}, {}, {}]' in text


@pytest.mark.slow  # compiles 2 steps (fast-suite time budget)
def test_microbatches_match_single_batch():
  ref_state, ref_m, ref_losses = _run((1, 1, 1), num_microbatches=1)
  state, m, losses = _run((1, 1, 1), num_microbatches=4)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(float(m["grad_norm"]), float(ref_m["grad_norm"]), rtol=1e-5)
  assert _max_param_diff(state.params, ref_state.params) <= 1e-6


@pytest.mark.slow  # compiles a step (fast-suite time budget)
def test_non_finite_gradient_skips_the_update():
  # A NaN embedding row for a token the batch uses makes the loss and gradient NaN.
  cfg = tiny_model_config()
  mesh = parallel.make_mesh(1, 1, 1)
  graphdef, params = init_model(cfg, seed=0)
  batch = _batch()
  params["embed"][...] = params["embed"][...].at[int(batch.tokens[0, 0])].set(jnp.nan)
  before = jax.tree.map(np.asarray, params)
  step, init = build_train_step(graphdef, make_optimizer(1e-3), StepConfig(), mesh, params)
  state, m = step(init(params), jax.device_put(batch, parallel.batch_sharding(mesh)))
  assert not np.isfinite(float(m["grad_norm"]))
  assert int(m["skipped_nonfinite"]) == 1 and int(state.step) == 0
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(x, np.asarray(y))  # NaN positions compare equal here
  # Adam's moments were not polluted by the NaN gradient.
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.opt_state))


@pytest.mark.slow  # compiles a step (fast-suite time budget)
def test_sft_loss_decreases_on_a_fixed_batch():
  _, _, losses = _run((1, 1, 1), loss="sft", steps=15)
  # lr 1e-3 on one batch: the NLL falls every step (3.47 -> 2.80 over 15 steps when written).
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < 0.85 * losses[0], losses


def test_learning_rate_warmup_starts_from_zero():
  # linear_schedule(0, lr, 10): the first update uses lr 0 (params unchanged), the second 0.1 lr.
  opt = make_optimizer(1e-2, warmup_steps=10)
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  grads = {"w": jnp.array([1.0, -2.0, 3.0])}
  upd, state = opt.update(grads, state, params)
  np.testing.assert_array_equal(np.asarray(upd["w"]), 0.0)
  upd, state = opt.update(grads, state, params)
  # Adam's second step with a constant gradient: m/sqrt(v) = sign(g) (bias-corrected), x lr 1e-3.
  np.testing.assert_allclose(np.asarray(upd["w"]), [-1e-3, 1e-3, -1e-3], rtol=1e-4)


@pytest.mark.parametrize("schedule,mid", [
    # lr 1e-3, ramp 10, end at update 110 with final_frac 0.1 (end rate 1e-4). Halfway through
    # the decay (update 60): linear 1e-3 + (1e-4 - 1e-3) / 2 = 5.5e-4; cosine
    # 1e-4 + (1e-3 - 1e-4) (1 + cos(pi / 2)) / 2 = 5.5e-4 too; at a quarter (update 35) they differ:
    # linear 1e-3 - 0.25 * 9e-4 = 7.75e-4, cosine 1e-4 + 9e-4 (1 + cos(pi / 4)) / 2 = 8.682e-4.
    ("linear", 7.75e-4), ("cosine", 8.682e-4)])
def test_learning_rate_decays_after_the_ramp_to_the_final_fraction(schedule, mid):
  lr = learning_rate_schedule(1e-3, warmup_steps=10, schedule=schedule, total_steps=110,
                              final_frac=0.1)
  at = lambda n: float(lr(n))
  assert at(0) == 0.0 and abs(at(5) - 5e-4) < 1e-9  # the ramp is unchanged
  np.testing.assert_allclose([at(10), at(35), at(60), at(110), at(500)],
                             [1e-3, mid, 5.5e-4, 1e-4, 1e-4], rtol=1e-4)
  # "constant" keeps the old behaviour: the ramp, then the full rate for good.
  const = learning_rate_schedule(1e-3, warmup_steps=10, schedule="constant", total_steps=110)
  np.testing.assert_allclose([float(const(5)), float(const(10)), float(const(500))],
                             [5e-4, 1e-3, 1e-3], rtol=1e-6)
  with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
    learning_rate_schedule(1e-3, schedule="step")


# Every term on: corrections, sequence masking, rollout KL, reference KL, entropy bonus.
_FULL = StepConfig(objective=losses.ObjectiveConfig(
    policy="ppo", eps_low=0.2, eps_high=0.28, dual_clip=3.0,
    correction=("outlier_mask", "token_tis"), reduction="seq_mean_token_mean",
    rollout_kl_coef=0.1, rollout_kl_reduction="seq_mean", ref_kl_coef=0.05, entropy_coef=0.01,
    seq_logprob_error_threshold=5.0), advantage="rloo", adv_clip=3.0)


# The second reduction runs in the slow step (fast-suite time budget).
@pytest.mark.slow  # 8-device compiles (fast-suite time budget)
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_sum_norm"])
def test_full_objective_microbatched_matches_single_batch(reduction):
  cfg = dataclasses.replace(_FULL, objective=dataclasses.replace(_FULL.objective,
                                                                 reduction=reduction))
  ref_state, ref_m, ref_losses = _run((1, 1, 1), 1, step_cfg=cfg, steps=3)
  state, m, losses_ = _run((1, 1, 1), 4, step_cfg=cfg, steps=3)
  np.testing.assert_allclose(losses_, ref_losses, rtol=1e-5, atol=1e-7)
  # Not exact: the 4 micro-batch gradients are summed in another order than one batch's, and
  # Adam divides each element by its own scale, so an element whose gradient is near 0 moves by
  # its relative rounding error times the rate (1e-3) per step. Observed max over 3 steps: under
  # 1e-6 before, 1.42e-6 since the one-hot embedding, one-chunk log-prob and 2-D projections
  # (2026-11-27: other programs, other summation orders).
  assert _max_param_diff(state.params, ref_state.params) <= 2e-6
  for key in ("rollout_kl", "ref_kl", "entropy", "mismatch/token_mult_prob_error",
              "mismatch/seq_mult_prob_error/max", "mismatch/is_ratio/min"):
    np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=1e-5, err_msg=key)
  # After two updates the policy has moved from the reference: the KL term is live.
  assert float(m["ref_kl"]) > 0 and float(m["rollout_kl"]) > 0


@pytest.mark.slow  # 8-device compiles (fast-suite time budget)
def test_padding_rows_add_exactly_nothing():
  # 16 real rows plus 16 padding rows built from the real batch's pytree (same fields, dtypes
  # and trailing shapes), loss mask all False and NaN sampler log-probs: with 4 micro-batches the
  # loss, metrics and update equal the real batch's alone.
  real = _batch()
  pad = jax.tree.map(lambda x: np.zeros_like(x), real)
  pad = pad._replace(rollout_logprobs=np.full_like(real.rollout_logprobs, np.nan),
                     group_id=np.arange(100, 116, dtype=np.int32),
                     temperature=np.ones_like(real.temperature))
  padded = jax.tree.map(lambda a, b: np.concatenate([a, b]), real, pad)
  ref_state, ref_m, ref_losses = _run((1, 1, 1), 1, batch=real, step_cfg=_FULL)
  state, m, losses_ = _run((1, 1, 1), 4, batch=padded, step_cfg=_FULL)
  np.testing.assert_allclose(losses_, ref_losses, rtol=1e-5, atol=1e-7)
  assert _max_param_diff(state.params, ref_state.params) <= 1e-6
  for key in ("rollout_kl", "entropy", "mismatch/abs_diff/max", "advantage/abs_mean", "tokens"):
    np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=1e-5, err_msg=key)


@pytest.mark.slow  # compiles a step (fast-suite time budget)
def test_missing_rollout_logprobs_fails_on_the_host_naming_the_field():
  mesh = parallel.make_mesh(1, 1, 1)
  graphdef, params = init_model(tiny_model_config(), seed=0)
  step, init = build_train_step(graphdef, make_optimizer(1e-3), _FULL, mesh, params)
  batch = _batch()._replace(rollout_logprobs=None)
  with pytest.raises(ValueError, match="rollout_logprobs is None.*rollout_kl.coef"):
    step(init(params), batch)
  assert step.jitted._cache_size() == 0  # nothing was traced or compiled
  # Without a term that needs them, the same batch trains (no mismatch metrics then).
  plain = StepConfig()
  step, init = build_train_step(graphdef, make_optimizer(1e-3), plain, mesh, params)
  _, m = step(init(params), batch)
  assert "loss" in m and not any(k.startswith("mismatch/") for k in m)


def test_reference_params_only_exist_with_a_reference_kl_term():
  mesh = parallel.make_mesh(1, 1, 1)
  graphdef, params = init_model(tiny_model_config(), seed=0)
  _, init = build_train_step(graphdef, make_optimizer(1e-3), StepConfig(), mesh, params)
  assert init(params).ref_params is None
  _, init = build_train_step(graphdef, make_optimizer(1e-3), _FULL, mesh, params)
  ref = init(params).ref_params
  assert _max_param_diff(ref, params) == 0.0


def _grouped_batch(seed=0) -> TrainBatch:
  """`_batch` with one prompt (and its padding) per group of 4 rows, as the trainer lays out
  GRPO batches, and some completion tokens that are context but not trained (multi-turn
  observations)."""
  b = _batch(seed)
  first = lambda x: np.repeat(x[::4], 4, axis=0)
  seen = b.mask | (np.arange(N)[None] < 2)
  return b._replace(prompt_tokens=first(b.prompt_tokens), prompt_valid=first(b.prompt_valid),
                    completion_valid=seen)


@pytest.mark.slow  # compiles 4 steps each (fast-suite time budget)
@pytest.mark.parametrize("pack", [False, True], ids=["cache", "packed"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_shared_prompts_match_running_every_row(scan_layers, pack):
  # Each group's prompt runs once and its 4 completions attend to that one copy of its keys and
  # values: the same losses, metrics and updates as running every row's prompt (the full
  # objective, so the reference model's pass is shared too), in 2 micro-batches of 2 groups.
  # Both forms: through a repeated key/value cache, and packed (`Transformer.grouped_forward`).
  batch = _grouped_batch()
  shared = dataclasses.replace(_FULL, shared_prompts=4, pack_prompts=pack)
  ref_state, ref_m, ref_losses = _run((1, 1, 1), 2, batch=batch, step_cfg=_FULL, steps=3,
                                      scan_layers=scan_layers)
  state, m, losses_ = _run((1, 1, 1), 2, batch=batch, step_cfg=shared, steps=3,
                           scan_layers=scan_layers)
  np.testing.assert_allclose(losses_, ref_losses, rtol=1e-5, atol=1e-7)
  assert _max_param_diff(state.params, ref_state.params) <= 1e-5
  for key in ("rollout_kl", "ref_kl", "entropy", "grad_norm", "mismatch/abs_diff/max"):
    np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=1e-4, err_msg=key)
  assert int(m["prompt_layout_errors"]) == 0 and int(state.step) == 3


@pytest.mark.slow  # compiles a step (fast-suite time budget)
def test_shared_prompts_refuse_a_batch_whose_groups_do_not_share_one_prompt():
  # `_batch` gives every row its own prompt: the shared pass would train on the wrong prompts,
  # so the step applies nothing and says so (the trainer then stops with an error).
  cfg = tiny_model_config()
  mesh = parallel.make_mesh(1, 1, 1)
  graphdef, params = init_model(cfg, seed=0)
  before = jax.tree.map(np.asarray, params)
  step, init = build_train_step(graphdef, make_optimizer(1e-3), StepConfig(shared_prompts=4),
                                mesh, params)
  state, m = step(init(params), jax.device_put(_batch(), parallel.batch_sharding(mesh)))
  assert int(m["prompt_layout_errors"]) == 1 and int(state.step) == 0
  assert _max_param_diff(before, state.params) == 0
  state, m = step(state, jax.device_put(_grouped_batch(), parallel.batch_sharding(mesh)))
  assert int(m["prompt_layout_errors"]) == 0 and int(state.step) == 1


@pytest.mark.slow  # 8-device compiles (fast-suite time budget)
@pytest.mark.parametrize("pack", [None, True], ids=["auto", "packed"])
def test_shared_prompts_on_a_sharded_mesh_match_one_device(devices, pack):
  # Rows split over 4 shards: by default the cache form (rows stay split); packed on request.
  batch = _grouped_batch()
  shared = dataclasses.replace(_FULL, shared_prompts=4, pack_prompts=pack)
  ref_state, _, ref_losses = _run((1, 1, 1), 1, batch=batch, step_cfg=_FULL)
  state, _, losses_ = _run((2, 2, 2), 2, batch=batch, step_cfg=shared)
  np.testing.assert_allclose(losses_, ref_losses, rtol=1e-5, atol=1e-6)
  assert _max_param_diff(state.params, ref_state.params) <= 1e-5


def test_row_shards_counts_the_batch_axes_the_rows_are_split_over(devices):
  assert row_shards(None) == 1
  assert row_shards(parallel.batch_sharding(parallel.make_mesh(1, 1, 1))) == 1
  assert row_shards(parallel.batch_sharding(parallel.make_mesh(2, 2, 2))) == 4
  assert row_shards(parallel.batch_sharding(parallel.make_mesh(1, 1, 8))) == 1


def test_shared_prompts_cache_form_rematerialises_its_layers():
  # The two-pass shared-prompt form runs both passes through a key/value cache: its layers must
  # rematerialise by `model.remat` like the per-row pass's (before, a cache turned remat off and
  # the 0.5B memory plan's step on 1x8x1 saved every layer's activations: 32.3 GiB of temps).
  def temp(remat):
    cfg = tiny_model_config(scan_layers=True, remat=remat, num_layers=4, d_model=64, mlp_dim=256)
    mesh = parallel.make_mesh(1, 1, 1)
    graphdef, params = init_model(cfg, seed=0)
    step_cfg = dataclasses.replace(_FULL, shared_prompts=4, pack_prompts=False)
    step, init = build_train_step(graphdef, make_optimizer(1e-3), step_cfg, mesh,
                                  shard_params(params, mesh))
    batch = jax.device_put(_grouped_batch(), parallel.batch_sharding(mesh))
    compiled = step.jitted.lower(init(shard_params(params, mesh)), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  assert temp("full") < 0.7 * temp("none")
