"""LoRA (`jaxrl.models.lora`, `ModelConfig.lora_*`, `model.lora.*`): the adapted model, the train
step that trains only adapters, merging, and runs with LoRA."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model_config
from jaxrl import config as config_lib
from jaxrl.runtime import checkpoint
from jaxrl import parallel
from jaxrl.run import driver
from jaxrl.run import directory as run_dir_lib
from jaxrl.recipes.default import get_config
from jaxrl.models import KVCache, abstract_model, init_model, left_positions
from jaxrl.models import lora
from jaxrl.run.parts import build_parts
from jaxrl.learner.rl import lora_model
from jaxrl.learner.step import (StepConfig, build_train_step, completion_logprobs, make_optimizer,
                              model_params)
from jaxrl.core.types import TrainBatch

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _lora_cfg(scan=False, targets=ALL, **kw):
  return tiny_model_config(scan_layers=scan, lora_rank=4, lora_alpha=8.0, lora_targets=targets,
                           **kw)


@functools.lru_cache(maxsize=None)
def _init(cfg):
  """`init_model(cfg, 0)`, made once per config for the whole file (each is a compile); callers
  never donate these params."""
  return init_model(cfg, 0)


def _randomize(params, scale=0.1, seed=3):
  """The same params with non-zero adapters (B starts at zero: the adapted model equals its
  base until B moves)."""
  adapters, base = lora.split(params)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape), adapters)
  return lora.join(base, adapters)


def _hidden(graphdef, params, cache=None, cache_index=0, tokens=None):
  """The model's final hidden states (and cache) for `tokens` (default `_tokens()`), jitted:
  eagerly every op of the model would compile on its own."""
  toks, pos, valid = _tokens() if tokens is None else tokens
  return _FORWARD(graphdef, params, toks, pos, valid, cache, cache_index)


_FORWARD = jax.jit(lambda g, p, toks, pos, valid, cache, index: nnx.merge(g, p)(
    toks, pos, valid, cache=cache, cache_index=index), static_argnums=(0,))


def _tokens(b=3, t=7, vocab=32):
  toks = jax.random.randint(jax.random.key(1), (b, t), 0, vocab)
  valid = jnp.ones((b, t), bool).at[0, :2].set(False)  # a left-padded row
  return toks, left_positions(valid), valid


# One case of each model test runs in the fast suite; the other layouts, whole runs and dropout
# (each a compile of its own) run with the slow tests.
SLOW = pytest.mark.slow


@SLOW  # the fast suite's 10-minute budget (2026-12-07)
@pytest.mark.parametrize("scan", [False, True])
def test_fresh_adapters_leave_the_base_model_unchanged(scan):
  """Adding LoRA draws no key a base weight uses (the base initialises as without it) and B = 0
  makes the adapted model equal its base exactly."""
  cfg = _lora_cfg(scan)
  g0, p0 = _init(lora.base_config(cfg))
  g1, p1 = _init(cfg)
  adapters, base = lora.split(p1)
  assert jax.tree.structure(base) == jax.tree.structure(p0)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(p0)):
    np.testing.assert_array_equal(a, b)
  assert sorted(adapters.keys()) == sorted(f"lora_{t}" for t in ALL)
  assert adapters["lora_q"]["lora_a"].shape == (2, 32, 4)   # [L, d_model, rank]
  assert adapters["lora_o"]["lora_a"].shape == (2, 32, 4)   # o's input: heads x head_dim = 32
  assert adapters["lora_k"]["lora_b"].shape == (2, 4, 16)   # 2 kv heads x 8
  assert adapters["lora_down"]["lora_a"].shape == (2, 64, 4)
  assert not np.any(np.asarray(adapters["lora_q"]["lora_b"][...]))
  h0, _ = _hidden(g0, p0)
  h1, _ = _hidden(g1, p1)
  np.testing.assert_array_equal(h0, h1)


@pytest.mark.parametrize("scan,targets", [
    (False, ALL), pytest.param(True, ALL, marks=SLOW), pytest.param(False, ("q", "v"), marks=SLOW),
    pytest.param(True, ("k", "up"), marks=SLOW)])
def test_adapters_add_alpha_over_rank_times_a_b_to_each_projection(scan, targets):
  """The adapted model equals the base model with `W + alpha / r * A @ B` in each adapted weight
  (`merged_weights`), fused (unrolled q/k/v, gate/up) or not, and the adapters change it."""
  cfg = _lora_cfg(scan, targets)
  g1, p1 = _init(cfg)
  p1 = _randomize(p1)
  h_lora, _ = _hidden(g1, p1)
  g0 = abstract_model(lora.base_config(cfg))[0]
  merged = lora.merge(cfg, p1)
  h_merged, _ = _hidden(g0, merged)
  np.testing.assert_allclose(h_lora, h_merged, atol=2e-5)
  h_base, _ = _hidden(g1, _init(cfg)[1])
  assert float(jnp.abs(h_lora - h_base).max()) > 0.1
  # Merging by hand for one weight: the arithmetic of `merged_weights`.
  if "q" in targets:
    a = np.asarray(p1["lora_q"]["lora_a"][...])
    b = np.asarray(p1["lora_q"]["lora_b"][...])
    w = np.asarray(p1["wq"][...]).reshape(2, 32, 32)
    want = (w + (8.0 / 4) * np.einsum("lir,lro->lio", a, b)).reshape(2, 32, 4, 8)
    np.testing.assert_allclose(merged["wq"][...], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_decode_with_a_cache_matches_the_full_forward():
  cfg = _lora_cfg(scan=True)
  g, p = init_model(cfg, 0)
  p = _randomize(p)
  toks, pos, valid = _tokens()
  full, _ = _hidden(g, p)
  cache = KVCache.zeros(cfg, 3, 7)
  out, cache = _hidden(g, p, cache, 0, (toks[:, :4], pos[:, :4], valid[:, :4]))
  outs = [out]
  for t in range(4, 7):
    o, cache = _hidden(g, p, cache, t, (toks[:, t:t + 1], pos[:, t:t + 1], valid[:, t:t + 1]))
    outs.append(o)
  np.testing.assert_allclose(jnp.concatenate(outs, 1)[1:], full[1:], atol=1e-4)


def _batch(b=8, lp=3, n=5, vocab=32, seed=0):
  rng = np.random.default_rng(seed)
  return TrainBatch(rng.integers(1, vocab, (b, lp)).astype(np.int32), np.ones((b, lp), bool),
                    rng.integers(1, vocab, (b, n)).astype(np.int32), np.ones((b, n), bool),
                    np.zeros((b, n), np.float32), rng.normal(size=b).astype(np.float32),
                    np.repeat(np.arange(b // 2), 2).astype(np.int32), np.ones(b, np.float32))


def _step(cfg, params, loss="rl", lr=1e-2):
  g = abstract_model(cfg)[0]
  return build_train_step(g, make_optimizer(lr), StepConfig(loss=loss), parallel.make_mesh(1, 1, 1),
                          params)


def test_the_step_trains_only_adapters_and_never_touches_the_base():
  cfg = _lora_cfg()
  _, params = _init(cfg)
  step, init = _step(cfg, params)
  state = init(params)
  adapters, base = lora.split(params)
  # Params and optimizer state are the adapters' alone; the base is frozen beside them.
  assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
  n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
  opt_values = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert opt_values == 2 * n_adapters + 1  # Adam's mu and nu, and its update count
  before = jax.tree.map(np.asarray, (state.frozen, state.params))
  for i in range(3):
    state, m = step(state, _batch(seed=i))
    assert float(m["grad_norm"]) > 0
  for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(state.frozen)):
    np.testing.assert_array_equal(a, b)
  changed = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(before[1]), jax.tree.leaves(state.params))]
  assert all(changed)
  assert int(state.step) == 3
  full = model_params(state)
  assert lora.counts(full) == (n_adapters, sum(x.size for x in jax.tree.leaves(base)))


def test_the_first_lora_step_has_the_full_models_loss_and_the_adapters_gradient():
  """At B = 0 the adapted model is the base: the same loss as the full-parameter step; and the
  adapters' gradient is the full model's gradient through `W + s A B`: dL/dB = s A^T dL/dW (per
  layer, inputs flattened), checked for q (every B is 0, so the others do not enter it)."""
  cfg = _lora_cfg()
  _, params = _init(cfg)
  base_cfg = lora.base_config(cfg)
  _, base_params = _init(base_cfg)
  # Through the trainer's own log-prob path (`completion_logprobs`, the base and the adapters as
  # the step passes them): the summed NLL and its gradients, jitted.
  g_l, g_f = abstract_model(cfg)[0], abstract_model(base_cfg)[0]
  scfg = StepConfig(loss="sft")
  tb = jax.tree.map(jnp.asarray, _batch())
  adapters, base = lora.split(params)
  loss_l = lambda ad: -jnp.sum(completion_logprobs(g_l, (base, ad), tb, scfg, False)[0])
  loss_f = lambda p: -jnp.sum(completion_logprobs(g_f, p, tb, scfg, False)[0])
  (vl, ga), (vf, gw) = (jax.jit(jax.value_and_grad(loss_l))(adapters),
                        jax.jit(jax.value_and_grad(loss_f))(base_params))
  np.testing.assert_allclose(float(vl), float(vf), rtol=1e-6)
  gw = gw["wq"][...].reshape(2, 32, 32)
  a = adapters["lora_q"]["lora_a"][...]
  want_b = 2.0 * jnp.einsum("lir,lio->lro", a, gw)  # s = alpha / r = 8 / 4
  np.testing.assert_allclose(ga["lora_q"]["lora_b"][...], want_b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_dropout_is_a_function_of_the_update_count():
  """LoRA dropout changes the loss from step to step but two runs from the same state drop the
  same (a resumed run trains exactly like the uninterrupted one)."""
  cfg = _lora_cfg(lora_dropout=0.5)
  _, params = init_model(cfg, 0)
  params = _randomize(params)
  losses = []
  step, init = _step(cfg, params, loss="sft", lr=0.0)
  for _ in range(2):
    state = init(params)
    run = []
    for _ in range(2):
      state, m = step(state, _batch())
      run.append(float(m["loss"]))
    losses.append(run)
  assert losses[0] == losses[1]
  assert losses[0][0] != losses[0][1]  # lr 0: only the dropout masks differ between steps
  no_drop = dataclasses.replace(cfg, lora_dropout=0.0)
  step, init = _step(no_drop, params, loss="sft", lr=0.0)
  _, m = step(init(params), _batch())
  assert float(m["loss"]) != losses[0][0]


@pytest.mark.parametrize("key,value,needle", [
    ("model.lora.targets", "q,x", "config.model.lora.targets: must be a comma-separated list"),
    ("model.lora.targets", "", "config.model.lora.targets"),
    ("model.lora.alpha", 0.0, "config.model.lora.alpha: must be > 0"),
    ("model.lora.rank", -1, "config.model.lora.rank: must be >= 0"),
    ("model.lora.dropout", 1.0, "config.model.lora.dropout"),
])
def test_bad_lora_keys_are_named(key, value, needle):
  cfg = get_config()
  section, leaf = key.rsplit(".", 1)
  sub = cfg
  for k in section.split("."):
    sub = sub[k]
  sub[leaf] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 1)
  assert needle in str(e.value)


@pytest.mark.slow
def test_a_tiny_lora_run_reports_counts_and_checkpoints_the_frozen_base(tmp_path, capsys):
  """A run with LoRA at lag 1 on the continuous engine with partial rollouts: it prints the
  trained-parameter and optimizer-state counts, staleness is exact, and its checkpoints hold the
  adapters as the train state's params and the same frozen base at every step."""
  cfg = get_config()
  cfg.model.d_model, cfg.model.head_dim, cfg.model.mlp_dim = 32, 16, 64
  cfg.sft.enabled, cfg.train.steps = False, 4
  cfg.val.at_start = cfg.val.at_end = False
  cfg.val.every, cfg.task.dev_size, cfg.task.val_size, cfg.val.batch_size = 1000, 32, 32, 32
  cfg.rollout.num_prompts, cfg.rollout.lag = 4, 1
  cfg.rollout.engine, cfg.rollout.partial_rollouts = "continuous", True
  cfg.model.lora.rank = 4
  cfg.checkpoint.every = 2
  run_dir = tmp_path / "run"
  summary = driver.run(cfg, str(run_dir), config_lib.validate(cfg, 1))
  assert summary["rl/steps"] == 4
  # Per layer, sum over targets of (din + dout) x rank: q 32+64, k 32+32, v 32+32, o 64+32,
  # gate 32+64, up 32+64, down 64+32 = 608; x 4 x 2 layers = 4,864; Adam: 2 x that + its count.
  assert ("LoRA rank 4 (alpha 32) on q,k,v,o,gate,up,down: 4,864 trained params of 30,496 "
          "(15.95%), optimizer state 9,730 values, base frozen") in capsys.readouterr().out
  rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["staleness/first_token/max"] for r in rl] == [0, 1, 1, 1]
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                                   tree)
  reader = checkpoint.Checkpointer(checkpoint.checkpoint_dir(str(run_dir)), read_only=True)
  try:
    assert reader.all_steps() == [2, 4]
    parts, params = build_parts(cfg, config_lib.validate(cfg, 1))
    adapters = lora.abstract_adapters(lora_model(parts))
    got = {s: reader.restore_fields(s, {"params": spec(adapters), "frozen": spec(params)})[1]
           for s in (2, 4)}
  finally:
    reader.close()
  assert jax.tree.structure(got[4]["params"]) == jax.tree.structure(adapters)
  for a, b in zip(jax.tree.leaves(got[2]["frozen"]), jax.tree.leaves(got[4]["frozen"])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_the_rollout_mesh_gets_the_base_once_then_adapter_bytes_only():
  """Disaggregated (4 train + 4 rollout devices): `AdapterSync` over `Parts.rollout_place`
  moves the frozen base on the first version and only the adapters after it; the sampler's
  weights land on the rollout mesh and equal the merge done on the train mesh."""
  cfg = get_config()
  cfg.task.num_digits, cfg.task.dev_size, cfg.task.val_size = 1, 16, 32
  cfg.mesh.rollout, cfg.model.lora.rank = 4, 4
  parts, params = build_parts(cfg, config_lib.validate(cfg, 8))
  lcfg = lora_model(parts)
  full = _randomize(lora.join(params, lora.init_adapters(lcfg, 0)))
  full = jax.device_put(full, parallel.param_shardings(full, parts.mesh))
  sync = lora.AdapterSync(lcfg, parts.rollout_place)
  first = sync(full)
  adapter_bytes = lora.nbytes(lora.split(full)[0])
  assert sync.last_moved_bytes == adapter_bytes + lora.nbytes(lora.split(full)[1])
  second = sync(full)
  assert sync.last_moved_bytes == adapter_bytes
  rollout_devices = set(parts.rollout_mesh.devices.flat)
  want = lora.merge(lcfg, full)
  for a, b, w in zip(jax.tree.leaves(first), jax.tree.leaves(second), jax.tree.leaves(want)):
    assert a.sharding.device_set <= rollout_devices
    np.testing.assert_allclose(np.asarray(b), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_resuming_with_another_lora_rank_or_targets_is_refused_by_name():
  """`model.lora.rank` and `.targets` are checkpoint keys: a resume that changes them is named
  before anything is restored (the adapters' shapes would not fit the checkpoint)."""
  saved = get_config()
  saved.model.lora.rank = 4
  host = {"config": run_dir_lib.checkpoint_config(saved)}
  now = get_config()
  now.model.lora.rank = 8
  now.model.lora.targets = "q,v"
  assert run_dir_lib.config_changes(now, host, "unused") == [
      "config.model.lora.rank = 4 in the checkpoint, 8 now",
      "config.model.lora.targets = 'q,k,v,o,gate,up,down' in the checkpoint, 'q,v' now"]
  assert run_dir_lib.config_changes(saved, host, "unused") == []
