"""Bad data and non-finite values: bad task rows are skipped and counted or raise naming the row;
non-finite log-probs skip the update (counted) and training continues; a row with a NaN or infinite
reward is excluded like a failed sample (counted) without poisoning the update; the
`train.max_skipped_updates` cap stops the run with a checkpoint and a clear message."""

from __future__ import annotations

import io
import os

import jax
import numpy as np
import pytest

from jaxrl.runtime import checkpoint

from jaxrl import config as config_lib

from jaxrl.observe import metrics as metrics_lib

from jaxrl.run import parts as parts_lib
from jaxrl.learner import rl as rl_step_lib
from jaxrl.run import loop
from jaxrl.run.topology import Topology
from jaxrl.recipes.default import get_config
from jaxrl.data.sources import BadRow, CheckedSource
from jaxrl.envs.base import Task
from fake_sources import ListSource  # tests/ is on sys.path


def _check(task):
  if not task.prompt:
    return "empty_prompt", "the prompt is empty"
  if len(task.prompt) > 3:
    return "too_long", f"{len(task.prompt)} > 3"
  return None


def _rows(prompts, split="train"):
  return [Task("add", p, {}, f"{split}/{i}") for i, p in enumerate(prompts)]


def test_skip_counts_and_redraws_deterministically():
  src = ListSource(_rows(["ab", "", "abcdef", "ba"]), _rows(["a", "", "b"], "val"))
  checked = CheckedSource(src, _check, "skip")
  assert [t.prompt for t in checked.split("val")] == ["a", "b"]
  assert checked.skipped == {"empty_prompt": 1}
  a = checked.sample(np.random.default_rng(0), 50)
  assert len(a) == 50 and all(t.prompt in ("ab", "ba") for t in a)
  assert checked.skipped["empty_prompt"] > 1 and checked.skipped["too_long"] > 0
  again = CheckedSource(src, _check, "skip").sample(np.random.default_rng(0), 50)
  assert [t.uid for t in again] == [t.uid for t in a]


def test_raise_names_the_row_and_reason():
  checked = CheckedSource(ListSource(_rows(["ab", "abcdef"])), _check, "raise")
  with pytest.raises(BadRow, match=r"train row 'train/1': too_long: 6 > 3"):
    for seed in range(20):
      checked.sample(np.random.default_rng(seed), 4)
  with pytest.raises(BadRow, match="val row 'val/0': empty_prompt"):
    CheckedSource(ListSource([], _rows([""], "val")), _check, "raise").split("val")


def test_all_bad_rows_stop_with_an_error_not_a_hang():
  checked = CheckedSource(ListSource(_rows(["", "abcdef"])), _check, "skip", max_redraws=5)
  with pytest.raises(BadRow, match="over 5 bad rows drawn per good row"):
    checked.sample(np.random.default_rng(0), 2)


def _tiny_cfg(**over):
  cfg = get_config()
  cfg.model.d_model, cfg.model.head_dim, cfg.model.mlp_dim = 32, 16, 64
  cfg.sft.enabled = False
  cfg.train.steps = 6
  cfg.rollout.num_prompts = 4
  cfg.val.at_start = cfg.val.at_end = False
  cfg.val.every = 100
  cfg.task.dev_size = cfg.task.val_size = 16
  cfg.val.batch_size = 16
  for k, v in over.items():
    section, key = k.split("__")
    cfg[section][key] = v
  return cfg


def _parts(cfg, **kw):
  """(parts, initial params) of `cfg`; keyword arguments go to `build_parts` (envs, source)."""
  return parts_lib.build_parts(cfg, config_lib.validate(cfg, jax.device_count()), **kw)


def test_row_checks_name_each_reason():
  parts, _ = _parts(_tiny_cfg())
  check = parts.row_problem
  assert check(Task("add", "12+34=", {}, "ok")) is None
  assert check(Task("countdown", "12+34=", {}, "x"))[0] == "unknown_task"
  assert check(Task("add", "  ", {}, "x"))[0] == "empty_prompt"
  assert check(Task("add", "12+3é=", {}, "x"))[0] == "undecodable"
  assert check(Task("add", "1234+5678=", {}, "x")) == (
      "too_long", "10 prompt tokens, over rollout.max_prompt_len=6", 10)  # size: its tokens


class _Injecting:
  """Wraps a source: every 4th draw is a row with a prompt over the budget."""

  def __init__(self, source):
    self.source, self.name, self.alphabet, self.n = source, source.name, source.alphabet, 0

  def split(self, name):
    return self.source.split(name)

  def sample(self, rng, n):
    out = []
    for t in self.source.sample(rng, n):
      self.n += 1
      out.append(Task(t.env, t.prompt * 3, t.data, t.uid + "-long") if self.n % 4 == 0 else t)
    return out


def _run(built, tmp_path, ckpt=None, on_batch=None, rl_step=None):
  parts, params = built
  out = metrics_lib.MetricsWriter(str(tmp_path))
  try:
    step = loop.RLStep(*(rl_step or rl_step_lib.build_rl_step(parts, params)),
                       on_batch=on_batch)
    loop.rl(parts, params, Topology.of(parts),
            loop.RunIO(out, metrics_lib.Progress(stream=io.StringIO()), ckpt=ckpt), step=step)
  finally:
    out.close()
  return [r for r in out.rows if r["phase"] == "rl"]


@pytest.mark.slow  # a whole run (fast-suite time budget)
def test_bad_rows_in_training_are_skipped_and_counted(tmp_path):
  cfg = _tiny_cfg()
  parts = _parts(cfg, source=_Injecting(parts_lib.task_source(cfg)))
  rl = _run(parts, tmp_path)
  assert len(rl) == 6
  counts = [r.get("data/skipped/too_long", 0) for r in rl]
  assert counts[-1] > 0 and counts == sorted(counts)  # cumulative, growing


def _poison(poisons):
  """`rl`'s on_batch: makes the train batch of the given (1-based) steps non-finite, by
  `poisons = {step: what}`."""

  def on_batch(step, batch):
    what = poisons.get(step)
    if what in ("inf_reward", "nan_reward"):
      value = np.inf if what == "inf_reward" else np.nan
      batch = batch._replace(rewards=batch.rewards.at[0].set(value))
    elif what == "logprobs":  # non-finite sampler log-probs: the rollout-KL term is NaN
      batch = batch._replace(rollout_logprobs=batch.rollout_logprobs * np.nan)
    return batch

  return on_batch


@pytest.mark.slow  # a whole run (fast-suite time budget)
def test_non_finite_log_probs_skip_the_update_and_training_continues(tmp_path):
  parts = _parts(_tiny_cfg(rollout_kl__coef=0.1))
  rl = _run(parts, tmp_path, on_batch=_poison({3: "logprobs"}))
  assert [r["skipped_nonfinite"] for r in rl] == [0, 0, 1, 0, 0, 0]
  assert [r["train/skipped_updates"] for r in rl] == [0, 0, 1, 1, 1, 1]
  assert rl[2]["grad_norm"] is None  # NaN, written to metrics.jsonl as null
  assert all(np.isfinite(r["grad_norm"]) for i, r in enumerate(rl) if i != 2)


@pytest.mark.slow  # a whole run (fast-suite time budget)
def test_non_finite_rewards_are_excluded_and_counted(tmp_path):
  # A row with a NaN or infinite reward is excluded like a failed sample (advantage 0, out of
  # its group's statistics); the update goes ahead, finite.
  parts = _parts(_tiny_cfg())
  rl = _run(parts, tmp_path, on_batch=_poison({3: "nan_reward", 5: "inf_reward"}))
  assert [r["nonfinite_rewards"] for r in rl] == [0, 0, 1, 0, 1, 0]
  assert all(r["skipped_nonfinite"] == 0 and np.isfinite(r["loss"]) for r in rl)


@pytest.mark.slow  # a whole run to its checkpoint (fast-suite time budget)
def test_skip_cap_stops_with_a_checkpoint(tmp_path):
  parts = _parts(_tiny_cfg(train__max_skipped_updates=1, rollout_kl__coef=0.1))
  on_batch = _poison({2: "logprobs", 3: "logprobs"})
  ckpt = checkpoint.Checkpointer(os.path.join(tmp_path, "ckpt"), async_save=False)
  with pytest.raises(loop.TrainingHalted,
                     match=r"2 updates were skipped .* train.max_skipped_updates=1; checkpoint "
                           r"of step 3 saved"):
    _run(parts, tmp_path, ckpt, on_batch)
  assert ckpt.latest_step() == 3
  ckpt.close()


def test_non_finite_reward_row_leaves_its_group_signal_intact():
  # Group 0: rewards [nan, 1, 0, 0] -> the NaN row is dropped and [1, 0, 0] keeps its signal:
  # mean 1/3, population std sqrt(2/9) = 0.4714, A = [0, 1.414, -0.707, -0.707] (eps 1e-4).
  import jax.numpy as jnp
  from jaxrl import losses
  rewards = jnp.array([jnp.nan, 1.0, 0.0, 0.0])
  valid = jnp.isfinite(rewards)
  adv = losses.compute_advantages("grpo", rewards, jnp.zeros(4, jnp.int32), valid, eps=1e-4)
  np.testing.assert_allclose(adv, [0.0, 1.41391, -0.706955, -0.706955], rtol=1e-4)


@pytest.mark.slow
def test_rl_batch_spec_is_what_the_step_gets_and_compiling_ahead_is_reused(tmp_path):
  # The trainer compiles the RL step ahead from `rl_batch_spec` (shapes, dtypes, missing fields)
  # while the warm-up runs; a spec that differed from the real batches would compile twice.
  from jax._src import dispatch, monitoring
  cfg = _tiny_cfg(train__steps=2, rollout__max_total_tokens=6, rollout__logprobs=False)
  parts = _parts(cfg)
  spec = rl_step_lib.rl_batch_spec(cfg)
  assert spec.rollout_logprobs is None and spec.tokens.shape == (32, 6)  # 4 x 8 rows, budget 6
  seen = []

  def on_batch(step, batch):
    assert jax.tree.structure(batch) == jax.tree.structure(spec)
    for got, want in zip(jax.tree.leaves(batch), jax.tree.leaves(spec)):
      assert (got.shape, got.dtype) == (want.shape, want.dtype)
    seen.append(step)
    return batch

  rl_step = rl_step_lib.build_rl_step(*parts)
  ahead = rl_step_lib.CompileAhead(parts[0], rl_step, parts[1])
  assert ahead.wait() and ahead.error is None
  compiles = []

  def listener(name, secs, **kw):
    if name == dispatch.BACKEND_COMPILE_EVENT:
      compiles.append(secs)

  # Everything else the loop runs (sampling, the data plane) compiles once; the step must not.
  calls = {"n": 0}
  step_fn, init_state = rl_step

  def counting_step(state, batch):
    before = len(compiles)
    out = step_fn(state, batch)
    calls["n"] += int(len(compiles) > before)
    return out

  monitoring.register_event_duration_secs_listener(listener)
  try:
    _run(parts, tmp_path, on_batch=on_batch, rl_step=(counting_step, init_state))
  finally:
    monitoring.unregister_event_duration_listener(listener)
  assert seen == [1, 2]
  assert compiles, "the listener sees compilations at all"
  assert calls["n"] == 0, "the RL step compiled again after compiling ahead"

