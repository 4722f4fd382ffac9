"""Token-budget packing (`train.packing`): the layout, and a packed step equal to the unpacked one."""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_model_config
from jaxrl import losses
from jaxrl.core.types import TrainBatch
from jaxrl.learner import packing
from jaxrl.learner.step import StepConfig, build_train_step
from jaxrl.models.transformer import init_model
from jaxrl.parallel.sharding import make_mesh


def test_layout_of_two_groups_by_hand():
  # Two groups of 2 rows; prompts [_, 5, 6] and [7, 8, 9] (left padding "_"); completions with
  # 2, 1, 3 and 0 real tokens (row 3 failed: nothing of it is placed).
  prompt_tokens = jnp.array([[0, 5, 6]] * 2 + [[7, 8, 9]] * 2, jnp.int32)
  prompt_valid = jnp.array([[False, True, True]] * 2 + [[True, True, True]] * 2)
  tokens = jnp.array([[11, 12, 0], [13, 0, 0], [14, 15, 16], [0, 0, 0]], jnp.int32)
  seen = tokens > 0
  p = packing.pack(prompt_tokens, prompt_valid, tokens, seen, jnp.ones(4), group=2, budget=8,
                   streams=2)
  # Unit lengths: group 0 = 2 + 2 + 1 = 5, group 1 = 3 + 3 + 0 = 6. First fit decreasing puts
  # group 1 (6) in stream 0 and group 0 (5) in stream 1 (5 + 6 > 8).
  u0, u1 = 1 << packing.UNIT_SHIFT, 2 << packing.UNIT_SHIFT
  assert p.tokens.tolist() == [[7, 8, 9, 14, 15, 16, 0, 0], [5, 6, 11, 12, 13, 0, 0, 0]]
  assert p.segment.tolist() == [[u1, u1, u1, u1 | 1, u1 | 1, u1 | 1, -1, -1],
                                [u0, u0, u0 | 1, u0 | 1, u0 | 2, -1, -1, -1]]
  assert p.shared.tolist() == [[True] * 3 + [False] * 5, [True] * 2 + [False] * 6]
  # Positions continue from each prompt's real tokens, per continuation.
  assert p.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2, 3, 2, 0, 0, 0]]
  # Each completion position predicts its row's next token; the last one and prompts predict none
  # here (the prompt's last position predicts every continuation's first token: `first`).
  assert p.target.tolist() == [[0, 0, 0, 15, 16, 0, 0, 0], [0, 0, 12, 0, 0, 0, 0, 0]]
  assert p.first.tolist() == [9, 9, 2, 2]  # flat: stream 1 position 1, stream 0 position 2
  assert p.slot[:, 0].tolist() == [10, 12, 3, -1] and p.stream.tolist() == [1, 1, 0, 0]
  assert int(p.used) == 2 and int(p.overflow) == 0


def test_a_group_longer_than_a_packed_row_is_cut_with_its_prompt_copied():
  prompt_tokens = jnp.array([[5, 6]] * 3, jnp.int32)
  tokens = jnp.array([[11, 12, 13]] * 3, jnp.int32)
  p = packing.pack(prompt_tokens, jnp.ones((3, 2), bool), tokens, tokens > 0, jnp.ones(3),
                   group=3, budget=8, streams=3)
  # 2 + 3 x 3 = 11 > 8: rows 0 and 1 (2 + 6 = 8) form one unit, row 2 another (2 + 3).
  assert p.tokens.tolist()[:2] == [[5, 6, 11, 12, 13, 11, 12, 13], [5, 6, 11, 12, 13, 0, 0, 0]]
  assert p.stream.tolist() == [0, 0, 1] and int(p.used) == 2


def test_capacity_and_padding_fraction():
  # 10 rows of 4 + 12 positions in rows of 32: 160 positions, first fit needs at most
  # 2 x ceil(160 / 32) + 1 = 11 streams, and never more than one per row (10).
  assert packing.capacity(10, 4, 12, 32) == 10
  # 100 such rows in rows of 64: 2 x 1600 / 64 + 1 = 51 streams, whole micro-batches of 4: 52.
  assert packing.capacity(100, 4, 12, 64, shards=4) == 52
  with pytest.raises(ValueError, match="does not fit"):
    packing.capacity(4, 8, 30, 32)
  # Lengths 6, 5, 3, 2 into 8: {6, 2} and {5, 3}: no padding; padding to the longest would
  # leave 1 - 16 / 24 = 1/3 of the positions empty.
  assert packing.padding_fraction([6, 5, 3, 2], 8) == 0.0
  assert packing.padding_fraction([6, 5], 8) == pytest.approx(1 - 11 / 16)


def _batch(rows, group, lp, n, vocab, seed=0):
  rng = np.random.default_rng(seed)
  pv = np.ones((rows // group, lp), bool)
  for g in range(rows // group):
    pv[g, : rng.integers(0, lp // 2)] = False  # left padding
  lens = rng.integers(0, n + 1, rows)  # some rows empty, some full
  return TrainBatch(
      prompt_tokens=np.repeat(rng.integers(2, vocab, (rows // group, lp)), group, 0)
      .astype(np.int32),
      prompt_valid=np.repeat(pv, group, 0),
      tokens=rng.integers(2, vocab, (rows, n)).astype(np.int32),
      mask=np.arange(n)[None] < lens[:, None],
      rollout_logprobs=(-rng.uniform(0.5, 3, (rows, n))).astype(np.float32),
      rewards=rng.integers(0, 2, rows).astype(np.float32),
      group_id=(np.arange(rows) // group).astype(np.int32),
      temperature=np.full(rows, 0.9, np.float32))


def _packed_step(mesh_shape, budget):
  """The step's new params and metrics on the batch of `test_packed_step_equals_unpacked`, packed
  to `budget` tokens (None: unpacked)."""
  cfg = tiny_model_config()
  graphdef, params = init_model(cfg, 0)
  batch = _batch(16, 4, 6, 10, cfg.vocab_size)
  mesh = make_mesh(*mesh_shape, devices=jax.devices())
  step_cfg = StepConfig(shared_prompts=4, pack_tokens=budget)
  step, init = build_train_step(graphdef, optax.sgd(1.0), step_cfg, mesh, params)
  return step(init(jax.tree.map(jnp.copy, params)), batch)


# The unpacked step, compiled and run once per mesh for every budget of the test below (a train
# step's compile is most of each case's time).
_unpacked_step = functools.lru_cache(maxsize=None)(functools.partial(_packed_step, budget=None))


@pytest.mark.parametrize("mesh_shape,budget", [
    ((1, 1, 1), 23),
    # Fast-suite time budget: the slow step runs these.
    pytest.param((1, 1, 1), 16, marks=pytest.mark.slow),
    pytest.param((1, 4, 1), 40, marks=pytest.mark.slow),
    pytest.param((1, 1, 1), 300, marks=pytest.mark.slow),
    pytest.param((2, 1, 1), 23, marks=pytest.mark.slow)])
def test_packed_step_equals_unpacked(devices, mesh_shape, budget):
  """Gradients (SGD with rate 1: new params = params - gradient) and every metric within 1e-5.
  Budget 16 = one row (every group cut), 23 (units of 1-2 rows), 300 (one stream holds all)."""
  base, base_m = _unpacked_step(mesh_shape)
  new, new_m = _packed_step(mesh_shape, budget)
  assert set(base_m) == set(new_m)
  for k in base_m:
    np.testing.assert_allclose(new_m[k], base_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), base.params, new.params)
  assert max(jax.tree.leaves(diff)) < 1e-5, diff


@pytest.mark.slow
def test_packed_step_equals_unpacked_with_every_term(devices):
  """GSPO's sequence ratios, seq-mean-token-sum reduction, rollout and reference KL, an entropy
  bonus, a truncated importance correction, and multi-turn rows (environment tokens seen but not
  trained: `completion_valid` wider than `mask`, with holes in the mask)."""
  cfg = tiny_model_config()
  graphdef, params = init_model(cfg, 1)
  batch = _batch(16, 4, 6, 12, cfg.vocab_size, seed=3)
  seen = batch.mask | np.roll(batch.mask, 2, axis=1)
  mask = batch.mask & (np.arange(12)[None] % 5 != 2)  # holes: environment turns
  batch = batch._replace(mask=mask, completion_valid=seen)
  objective = losses.ObjectiveConfig(
      policy="gspo", reduction="seq_mean_token_sum", rollout_kl_coef=0.05, ref_kl_coef=0.02,
      entropy_coef=0.01, correction=losses.parse_correction("token_tis"))
  mesh = make_mesh(1, 1, 1, devices=devices)

  def run(step_cfg):
    step, init = build_train_step(graphdef, optax.sgd(1.0), step_cfg, mesh, params)
    state = init(jax.tree.map(jnp.copy, params))
    # A reference that differs from the policy, so the reference KL has a gradient.
    state = state._replace(ref_params=jax.tree.map(lambda x: x * 0.9, state.ref_params))
    return step(state, batch)
  base, base_m = run(StepConfig(shared_prompts=4, objective=objective))
  new, new_m = run(StepConfig(shared_prompts=4, objective=objective, pack_tokens=24))
  for k in base_m:
    np.testing.assert_allclose(new_m[k], base_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), base.params, new.params)
  assert max(jax.tree.leaves(diff)) < 1e-5, diff


@pytest.mark.slow  # fast-suite time budget (packing: the cases above; LoRA: test_lora.py)
def test_packed_lora_step_equals_unpacked(devices):
  """LoRA adapters on every projection (no dropout: its keys follow the micro-batch index, and
  packing forms other micro-batches): the adapters' gradients agree."""
  cfg = tiny_model_config(lora_rank=4, lora_alpha=8.0,
                          lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
  graphdef, params = init_model(cfg, 2)
  batch = _batch(8, 4, 5, 7, cfg.vocab_size, seed=5)
  mesh = make_mesh(1, 1, 1, devices=devices)

  def run(step_cfg):
    step, init = build_train_step(graphdef, optax.sgd(1.0), step_cfg, mesh, params)
    return step(init(jax.tree.map(jnp.copy, params)), batch)
  base, base_m = run(StepConfig(shared_prompts=4))
  new, new_m = run(StepConfig(shared_prompts=4, pack_tokens=200))
  for k in base_m:
    np.testing.assert_allclose(new_m[k], base_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), base.params, new.params)
  assert max(jax.tree.leaves(diff)) < 1e-5, diff


def _run(tmp_path, name, *flags):
  out = tmp_path / name
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", f"--config.run_dir={out}",
                         "--config.sft.cache=", "--config.train.steps=5", *flags],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
          if r.get("phase") == "rl"]


@pytest.mark.slow
def test_packed_default_run_matches_unpacked(tmp_path):
  """The default recipe's first 5 RL steps, packed into rows of 64 positions, give the unpacked
  run's metrics within 1e-5 (timings aside)."""
  base = _run(tmp_path, "base")
  packed = _run(tmp_path, "packed", "--config.train.packing=True",
                "--config.train.microbatch_tokens=64")
  assert len(base) == len(packed) == 5
  timing = lambda k: "time" in k or "wait" in k or k.endswith("_s") or k.startswith("perf/")
  for a, b in zip(base, packed):
    for k, v in a.items():
      if isinstance(v, (int, float)) and not timing(k):
        assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-5), (a["step"], k)


def test_packing_refuses_a_row_longer_than_a_packed_row(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", f"--config.run_dir={tmp_path / 'r'}",
                         "--config.train.packing=True", "--config.train.microbatch_tokens=5"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "jaxrl: " in proc.stderr and "train.microbatch_tokens" in proc.stderr
  assert not (tmp_path / "r").exists()
