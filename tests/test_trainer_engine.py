"""`rollout.engine=continuous` in the trainer: the slot engine behind the same multi-turn loop
trains exactly like the static sampler (same tokens for the same keys), with fewer slots than
rows so slots are refilled mid-batch, on a multi-turn task so later turns go through it too."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib

from jaxrl.run import driver
from jaxrl.run.parts import build_parts

from test_bad_input import _tiny_cfg


def _run(tmp_path, engine):
  cfg = _tiny_cfg(rollout__engine=engine, rollout__engine_slots=6, rollout__engine_steps=3,
                  train__steps=3, task__name="guess+add", task__weights="1,1",
                  rollout__max_turns=3, rollout__max_prompt_len=32,
                  rollout__max_total_tokens=24, val__at_end=True)
  mesh = config_lib.validate(cfg, jax.device_count())
  run_dir = tmp_path / engine
  driver.run(cfg, str(run_dir), mesh)
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if r["phase"] == "rl"], [r for r in rows if r["phase"] == "val"]


@pytest.mark.slow
def test_continuous_engine_trains_like_the_static_sampler(tmp_path):
  static_rl, static_val = _run(tmp_path, "static")
  cont_rl, cont_val = _run(tmp_path, "continuous")
  assert len(static_rl) == len(cont_rl) == 3
  for a, b in zip(static_rl, cont_rl):
    # The same generations: rewards, lengths and episode shapes are equal exactly ...
    for key in ("reward", "completion_len", "env/turns/mean", "env/terminated_frac"):
      assert a[key] == b[key], (key, a[key], b[key])
    # ... and the update equal up to the sampler log-probs' float rounding (<= 1e-5).
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
  assert max(r["env/turns/mean"] for r in cont_rl) > 1.0  # later turns really ran
  assert [v["val/accuracy"] for v in static_val] == [v["val/accuracy"] for v in cont_val]


def test_continuous_engine_is_refused_with_several_processes():
  # Where batches are made inline (a disaggregated mesh within processes): each process's own
  # devices run it otherwise (dynamic sampling included).
  cfg = _tiny_cfg(rollout__engine="continuous", distributed__num_processes=2,
                  distributed__coordinator_address="127.0.0.1:1234",
                  dynamic_sampling__enabled=True)
  config_lib.validate(cfg, 8)
  cfg.mesh.rollout = 4
  with pytest.raises(config_lib.ConfigError, match="config.rollout.engine: must be 'static'"):
    config_lib.validate(cfg, 8)


@pytest.mark.parametrize("compact", [True, False])
def test_engine_compact_key_reaches_every_engine(compact):
  # rollout.engine_compact=false leaves the engine one decode program (all slots, whole cache).
  cfg = _tiny_cfg(rollout__engine="continuous", rollout__engine_compact=compact)
  parts, _ = build_parts(cfg, config_lib.validate(cfg, jax.device_count()))
  for sample in (parts.train_loop().sample_first, parts.val_loop.sample_first):
    engine = sample.engine
    assert engine.compact is compact
    full = ((engine.num_slots, None),)
    assert (engine.programs() == [full]) is not compact


@pytest.mark.slow
def test_partial_rollouts_keep_the_forced_lag_for_first_tokens(tmp_path):
  # Lag 1 with partial rollouts: batch b starts on params b - 1 and may switch to params b when
  # the trainer publishes them mid-generation (one decode step per dispatch, few slots, so a
  # batch spans many dispatches). Whether a switch happens depends on timing; what must hold
  # always: the batch's first tokens are exactly 1 update old, no token is older, and versions
  # are never newer than the step that trains on them.
  cfg = _tiny_cfg(rollout__engine="continuous", rollout__engine_slots=4, rollout__engine_steps=1,
                  rollout__partial_rollouts=True, rollout__lag=1, train__steps=4)
  mesh = config_lib.validate(cfg, jax.device_count())
  run_dir = tmp_path / "partial"
  driver.run(cfg, str(run_dir), mesh)
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["batch_id"] for r in rl] == list(range(4))
  for r in rl:
    lag = min(r["batch_id"], 1)
    assert r["staleness/first_token/max"] == lag, r
    for kind in ("first_token", "last_token", "token_mean"):
      assert 0 <= r[f"staleness/{kind}/min"] <= r[f"staleness/{kind}/max"] <= lag, (kind, r)
