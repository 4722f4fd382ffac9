"""The accounting of benchmarks/vs_trl_smollm2.py (time to TRL's final reward, the ratios and
targets) and benchmarks/smollm2_learning.py (a run directory read back, whole or its first N
steps), on hand-made numbers."""

import importlib.util
import json
import pathlib
import sys

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


sys.path.insert(0, str(_BENCH))  # vs_trl_smollm2 imports vs_trl from its own folder
vs = _load("vs_trl_smollm2")
learning = _load("smollm2_learning")

MEASURED = {"wall_s": 100.0, "first_step_done_s": 20.0, "peak_rss_tree_mib": 1000.0,
            "ru_maxrss_mib": 900.0, "load_avg_1m": 1.0, "returncode": 0}


def test_time_to_reward_needs_a_full_trailing_window():
  steps, rewards = [10.0, 5.0, 5.0, 5.0], [0.5, 0.1, 0.4, 0.6]
  # Trailing 2-step means: (0.5+0.1)/2 = 0.3 at step 2, 0.25 at step 3, 0.5 at step 4. Step 1's
  # 0.5 alone is not a full window, so a target of 0.45 is first met at step 4: 25 s.
  assert vs.time_to_reward(steps, rewards, 0.45, 2) == 25.0
  assert vs.time_to_reward(steps, rewards, 0.3, 2) == 15.0
  assert vs.time_to_reward(steps, rewards, 0.7, 2) is None
  assert vs.time_to_reward(steps, rewards, None, 2) is None


def test_summary_ratios_and_targets():
  trl = {"side": "trl", "tag": "t", **vs.side_stats(
      [40.0, 20.0, 20.0, 20.0], [10.0, 8.0, 8.0, 8.0], [0.1, 0.2, 0.3, 0.3], MEASURED, 2)}
  jax_ = {"side": "jaxrl", "tag": "j", **vs.side_stats(
      [12.0, 8.0, 9.0, 8.0], [4.0, 3.0, 3.0, 3.0], [0.1, 0.3, 0.4, 0.5],
      MEASURED | {"peak_rss_tree_mib": 400.0}, 2)}
  out = vs.summarise([trl, jax_], 2)
  m = out["medians"]
  # Medians over steps 2..: TRL 20 s (rollout 8, train 12); jaxrl 8 s (rollout 3, train 5).
  assert (m["trl"]["step_median_s"], m["trl"]["train_median_s"]) == (20.0, 12.0)
  assert (m["jaxrl"]["step_median_s"], m["jaxrl"]["train_median_s"]) == (8.0, 5.0)
  # TRL's final reward: mean of its last 2 steps, 0.3, first reached as a 2-step mean at its
  # step 4 (40 + 20 + 20 + 20 = 100 s); jaxrl's 2-step mean is 0.35 at step 3: 12 + 8 + 9 = 29 s.
  assert m["trl"]["reward_final"] == pytest.approx(0.3)
  assert m["trl"]["time_to_trl_final_reward_s"] == 100.0
  assert m["jaxrl"]["time_to_trl_final_reward_s"] == 29.0
  r = out["ratios_jaxrl_over_trl"]
  assert r["step_median_s"] == pytest.approx(0.4) and r["peak_rss_tree_mib"] == 0.4
  assert r["time_to_trl_final_reward_s"] == pytest.approx(0.29)
  assert out["trl_reward_rose"] and all(out["targets_met"].values())


def test_a_flat_trl_reward_leaves_the_time_target_unjudged():
  flat = {"side": "trl", "tag": "t", **vs.side_stats(
      [10.0, 10.0], [5.0, 5.0], [0.2, 0.2], MEASURED, 1)}
  fast = {"side": "jaxrl", "tag": "j", **vs.side_stats(
      [2.0, 2.0], [1.0, 1.0], [0.2, 0.3], MEASURED, 1)}
  out = vs.summarise([flat, fast], 1)
  assert not out["trl_reward_rose"]
  assert out["targets_met"]["time to TRL's final reward <= 0.5x TRL's"] is None
  assert out["targets_met"]["step <= 0.5x TRL"] is True


def _run_dir(tmp_path, steps=4, every=2, finished=True):
  d = tmp_path / "run"
  d.mkdir()
  (d / "config.json").write_text(json.dumps({"seed": 3}))
  rows = []
  for s in range(1, steps + 1):
    rows.append({"phase": "rl", "step": s, "reward": s / 10, "completion_len": 30 - s,
                 "perf/step_time_s": 10.0, "perf/elapsed_s": 10.0 * s})
  for s in range(0, steps + 1, every):
    rows.append({"phase": "val", "step": s, "val/accuracy": 0.2 + s / 20,
                 "val/avg_length": 30.0 - s, "val/time_s": 3.0})
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if finished:
    (d / "summary.json").write_text(json.dumps({
        "val/accuracy_before_rl": 0.2, "val/accuracy_after_rl": 0.4, "val/rl_gain": 0.2,
        "rl/time_s": 50.0, "total_time_s": 55.0}))
  return d


def test_learning_summary_of_a_finished_run(tmp_path):
  r = learning.summarize_run(str(_run_dir(tmp_path)))
  assert (r["seed"], r["before_rl"], r["after_rl"], r["gain"]) == (3, 0.2, 0.4, 0.2)
  assert r["rl_time_s"] == 50.0 and r["rl_steps"] == 4
  assert [v["step"] for v in r["val_curve"]] == [0, 2, 4]
  assert r["reward_curve"] == [0.1, 0.2, 0.3, 0.4]


def test_learning_summary_of_a_runs_first_steps(tmp_path):
  d = _run_dir(tmp_path, finished=False)
  r = learning.summarize_run(str(d), upto=2)
  # Validation at step 2: 0.2 + 2/20 = 0.3; RL time = elapsed at step 2 (20 s) + its val (3 s).
  assert (r["before_rl"], r["rl_steps"]) == (0.2, 2) and r["after_rl"] == pytest.approx(0.3)
  assert r["gain"] == pytest.approx(0.1) and r["rl_time_s"] == 23.0
  with pytest.raises(SystemExit, match="no validation at step 3"):
    learning.summarize_run(str(d), upto=3)
  w = learning.weakest([r])
  assert w["gain"]["margin"] == pytest.approx(0.1 - 0.25) and not w["bars_met"]
