"""`train.length_buckets`: each batch's step runs at the widths its rows use (`learner.widths`)."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import tiny_model_config
from jaxrl import losses, parallel
from jaxrl.core.types import TrainBatch
from jaxrl.learner import widths
from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer, shard_params
from jaxrl.models import init_model

B, G = 8, 4


def test_a_width_is_the_smallest_bucket_that_holds_the_columns_used():
  # 64 columns in 8 buckets: 8, 16, ..., 64. 41 columns -> 48; 48 -> 48; 49 -> 56.
  assert [widths.bucket(u, 64, 8) for u in (1, 8, 9, 41, 48, 49, 64)] == [8, 8, 16, 48, 48, 56, 64]
  # 96 prompt columns in 8 buckets of 12: 61 -> 72. Uneven splits round up: ceil(10 k / 4) =
  # 3, 5, 8, 10, so 4 -> 5 and 6 -> 8.
  assert widths.bucket(61, 96, 8) == 72
  assert [widths.bucket(u, 10, 4) for u in (3, 4, 6, 9)] == [3, 5, 8, 10]
  # Off (0 or 1 bucket): always the full width.
  assert widths.bucket(3, 64, 1) == widths.bucket(3, 64, 0) == 64


def test_the_columns_used_are_counted_from_the_first_prompt_token_to_the_last_seen_one():
  prompt_valid = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], bool)  # 4 columns used
  mask = np.array([[1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]], bool)
  assert widths.used_columns(prompt_valid, mask, None).tolist() == [4, 2]
  # A context token (completion_valid) past the last trained one is attended to: kept.
  seen = mask.copy()
  seen[1, 4] = True
  assert widths.used_columns(prompt_valid, mask, seen).tolist() == [4, 5]
  # No token at all: 0 columns (the step then runs the smallest bucket).
  assert widths.used_columns(~prompt_valid & False, mask & False, None).tolist() == [0, 0]


def _batch(lp: int, n: int, seed: int = 0) -> TrainBatch:
  """Groups of G rows with one prompt each (up to 5 tokens, left padded to `lp`) and completions
  of 1-5 tokens right padded to `n`: columns past those are padding in every row."""
  rng = np.random.default_rng(seed)
  prompts = np.zeros((B, lp), np.int32)
  valid = np.zeros((B, lp), bool)
  for g in range(B // G):
    k = int(rng.integers(2, 6))
    prompts[g * G:(g + 1) * G, lp - k:] = rng.integers(2, 32, k)
    valid[g * G:(g + 1) * G, lp - k:] = True
  lengths = rng.integers(1, 6, B)
  mask = np.arange(n)[None] < lengths[:, None]
  tokens = np.where(mask, rng.integers(2, 32, (B, n)), 0).astype(np.int32)
  return TrainBatch(prompts, valid, tokens, mask,
                    np.where(mask, -rng.random((B, n)), 0).astype(np.float32),
                    rng.integers(0, 2, B).astype(np.float32), np.arange(B, dtype=np.int32) // G,
                    np.full(B, 0.9, np.float32))


_FULL = StepConfig(objective=losses.ObjectiveConfig(
    policy="ppo", eps_low=0.2, eps_high=0.28, correction=("token_tis",),
    reduction="seq_mean_token_mean", rollout_kl_coef=0.1, ref_kl_coef=0.05, entropy_coef=0.01),
    num_microbatches=2)


def _steps(step_cfg: StepConfig, batch: TrainBatch, steps: int = 2):
  mesh = parallel.make_mesh(1, 1, 1)
  graphdef, params = init_model(tiny_model_config(), seed=0)
  step, init = build_train_step(graphdef, make_optimizer(1e-3), step_cfg, mesh,
                                shard_params(params, mesh))
  state, rows = init(params), []
  for _ in range(steps):
    state, m = step(state, jax.device_put(batch, parallel.batch_sharding(mesh)))
    rows.append(jax.tree.map(np.asarray, m))
  return state, rows, step


@pytest.mark.parametrize("shared", [0, pytest.param(G, marks=pytest.mark.slow)],
                         ids=["per-row", "shared-prompts"])  # slow: two more compiles (~25 s)
def test_a_batch_cut_to_its_bucket_trains_as_the_whole_padded_batch(shared):
  # 24 prompt and 40 completion columns, of which at most 5 each are used: in 8 buckets the step
  # runs 6 (ceil(24/8) = 3 is too few for 5 -> 6) and 5 columns. Same losses, metrics and
  # update as the padded batch run whole (only float summation order differs).
  batch = _batch(24, 40)
  cfg = dataclasses.replace(_FULL, shared_prompts=shared)
  ref_state, ref_rows, _ = _steps(cfg, batch)
  state, rows, _ = _steps(dataclasses.replace(cfg, length_buckets=8), batch)
  assert [(int(r["train/prompt_width"]), int(r["train/completion_width"])) for r in rows] == \
      [(6, 5), (6, 5)]
  assert "train/completion_width" not in ref_rows[0]  # off: no width metrics, as before
  for r, ref in zip(rows, ref_rows):
    for key in ("loss", "grad_norm", "rollout_kl", "ref_kl", "entropy", "tokens"):
      np.testing.assert_allclose(r[key], ref[key], rtol=2e-5, atol=1e-7, err_msg=key)
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)))
  assert diff <= 1e-6


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_a_batch_that_fills_its_budget_runs_the_program_compiled_for_the_full_width():
  batch = _batch(5, 5)  # every column used by some row: nothing to cut
  batch = batch._replace(prompt_valid=np.ones_like(batch.prompt_valid),
                         mask=batch.mask | (np.arange(5)[None] == 4))
  _, rows, _ = _steps(dataclasses.replace(_FULL, length_buckets=4), batch, steps=1)
  assert (int(rows[0]["train/prompt_width"]), int(rows[0]["train/completion_width"])) == (5, 5)


@pytest.mark.slow  # compiles the default recipe's step twice (fast-suite time budget)
def test_the_step_variants_benchmark_times_both_forms_of_the_same_update():
  # benchmarks/step_variants.py --quick: the default recipe's step whole and in 4 buckets on one
  # batch; the two losses are the same function of the batch, and the bucketed one reports the
  # widths it ran at (inside the budgets).
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "step_variants.py"
  spec = importlib.util.spec_from_file_location("step_variants", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = bench.main(["--quick", "--repeats", "1", "--max-reply", "2"])
  full, buckets = out["variants"]["full"], out["variants"]["buckets4"]
  assert full["widths"] is None and len(buckets["times_s"]) == 1 == len(full["times_s"])
  np.testing.assert_allclose(buckets["loss"], full["loss"], rtol=1e-5)
  prompt_w, completion_w = buckets["widths"]
  assert 1 <= completion_w < out["batch"]["longest_reply"] + 4 and prompt_w >= 1
