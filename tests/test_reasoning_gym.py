"""Tasks `reasoning_gym:<dataset>` (jaxrl.envs.reasoning_gym): rewards from each dataset's own
scorer on hand-checked rows, seeded disjoint splits, config errors before anything is built, a
tiny run on a mixture of two datasets, and the message when reasoning-gym is not installed.

Every test but the last needs the `reasoning-gym` extra (`pip install -e ".[dev,reasoning-gym]"`)
and is marked `reasoning_gym`: CI runs them in their own step (`pytest -m reasoning_gym -n 0`),
and they are skipped where the extra is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.recipes.default import get_config
from jaxrl.envs import Turn, call_step, make_env, make_source, registry
from test_cli import _train

ARITH, LEGS = "reasoning_gym:basic_arithmetic", "reasoning_gym:leg_counting"
# Small problems: one-digit sums and products without parentheses, one or two kinds of animals.
RG_CONFIG = {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                  "max_digits": 1, "operators": ["+", "*"],
                                  "allow_parentheses": False, "allow_negation": False},
             "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3}}


@pytest.fixture(autouse=True)
def _registry_as_found():
  """Task names resolved here are dropped afterwards: other tests check the registry's exact
  contents in the same process."""
  saved = dict(registry.TASKS), dict(registry.ENVIRONMENTS)
  yield
  for table, before in zip((registry.TASKS, registry.ENVIRONMENTS), saved):
    table.clear()
    table.update(before)


def _cfg(**task):
  cfg = get_config()
  cfg.task.name = f"{ARITH}+{LEGS}"
  cfg.task.rg_config = json.dumps(RG_CONFIG)
  cfg.task.val_size, cfg.task.dev_size = 4, 2
  cfg.sft.enabled = False  # no demonstrations for the warm-up
  for k, v in task.items():
    setattr(cfg.task, k, v)
  return cfg


def _row(source, text):
  """The val row whose question contains `text` (one only)."""
  rows = [t for t in source.split("val") if text in t.data["entry"]["question"]]
  assert len(rows) == 1, [t.data["entry"]["question"] for t in source.split("val")]
  return rows[0]


def _rewards(name, pairs, truncated=False):
  result = call_step(make_env(name), [Turn(task, 0, text, truncated) for task, text in pairs])
  return result.rewards.tolist(), result


@pytest.mark.reasoning_gym
def test_hand_checked_answers_are_graded_by_each_datasets_scorer():
  pytest.importorskip("reasoning_gym")
  cfg = _cfg()
  config_lib.validate(cfg, 8)
  arith, legs = make_source(ARITH, cfg), make_source(LEGS, cfg)
  # Seed 0, val rows 0-3 of each dataset (read off once, answers worked out by hand):
  # basic_arithmetic "Calculate 5 * 9." = 45 and "Calculate 1 + 5." = 6; leg_counting
  # "2 grasshoppers, 3 jellyfishs" = 2 * 6 + 3 * 0 = 12 legs.
  five_nines, one_five = _row(arith, "Calculate 5 * 9."), _row(arith, "Calculate 1 + 5.")
  bugs = _row(legs, "2 grasshoppers, 3 jellyfishs")
  assert five_nines.prompt.startswith("Given a problem") and "<answer>answer here</answer>" in \
      five_nines.prompt and five_nines.prompt.endswith("\n\nCalculate 5 * 9.")

  rewards, result = _rewards(ARITH, [
      (five_nines, "5 * 9: five nines. <answer>45</answer>"),  # right
      (five_nines, "<answer>54</answer>"),  # wrong
      # The dataset's own partial credit: the gold inside a longer answer scores
      # len("45") / len("45 apples") = 2/9 (an exact-match grader would give 0).
      (five_nines, "<answer>45 apples</answer>"),
      (five_nines, "45"),  # no <answer> tag: nothing extracted
      (five_nines, "<answer>44</answer> then <answer>45</answer>"),  # the last tag counts
      # Each row is graded against its own entry: 45 is wrong for "1 + 5".
      (one_five, "<answer>45</answer>"),
      (one_five, "<answer> 6 </answer>"),  # stripped
  ])
  assert rewards == pytest.approx([1.0, 0.0, 2 / 9, 0.0, 1.0, 0.0, 1.0])
  assert result.components["format"].tolist() == [1, 1, 1, 0, 1, 1, 1]
  assert result.components["correct"].tolist() == [1, 0, 0, 0, 1, 0, 1]
  assert [m["extracted"] for m in result.metadata] == ["45", "54", "45 apples", None, "45", "45",
                                                       "6"]
  assert result.metadata[0][f"{ARITH}/score"] == 1.0

  rewards, _ = _rewards(LEGS, [(bugs, "<answer>12</answer>"), (bugs, "<answer>14</answer>"),
                               (bugs, "<answer>12 legs</answer>")])  # 2/7: the dataset's credit
  assert rewards == pytest.approx([1.0, 0.0, 2 / 7])
  # Like every built-in task, a turn cut by the token budget scores 0 even when right.
  rewards, result = _rewards(LEGS, [(bugs, "<answer>12</answer>")], truncated=True)
  assert rewards == [0.0] and result.metadata[0]["error"] == "truncated"


@pytest.mark.reasoning_gym
def test_splits_are_seeded_disjoint_and_sized():
  pytest.importorskip("reasoning_gym")
  cfg = _cfg(val_size=64, dev_size=32)
  config_lib.validate(cfg, 8)
  a, b = make_source(LEGS, cfg), make_source(LEGS, cfg)
  val, dev = a.split("val"), a.split("dev")
  assert 0 < len(val) <= 64 and 0 < len(dev) <= 32  # duplicate questions are dropped
  train = a.sample(np.random.default_rng(1), 500)
  questions = [{t.data["entry"]["question"] for t in rows} for rows in (val, dev, train)]
  assert not (questions[0] & questions[1]) and not (questions[2] & (questions[0] | questions[1]))
  assert {t.uid.split("/")[1] for t in train} == {"train"}
  # Same seed: the same rows; another seed: other rows.
  assert [t.uid for t in b.sample(np.random.default_rng(1), 500)] == [t.uid for t in train]
  assert [t.prompt for t in b.split("val")] == [t.prompt for t in val]
  cfg.seed = 1
  assert [t.prompt for t in make_source(LEGS, cfg).split("val")] != [t.prompt for t in val]
  with pytest.raises(NotImplementedError):  # training rows are drawn, not listed
    a.split("train")


def _problems(cfg) -> list[str]:
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 8)
  return e.value.problems


@pytest.mark.reasoning_gym
def test_config_errors_name_the_key_and_the_bad_value():
  pytest.importorskip("reasoning_gym")
  # A misspelt dataset: one line naming task.name, the name, and the close matches.
  [line] = _problems(_cfg(name="reasoning_gym:basic_arithmatic+reasoning_gym:leg_counting"))
  assert line.startswith("config.task.name: no reasoning-gym dataset 'basic_arithmatic'"), line
  assert "close matches: reasoning_gym:basic_arithmetic" in line
  # Malformed JSON, and JSON that is not an object.
  [line] = _problems(_cfg(rg_config='{"leg_counting": {"max_animals": 3}'))
  assert line.startswith("config.task.rg_config: must be '' or a JSON object") and \
      """got '{"leg_counting": {"max_animals": 3}'""" in line, line
  [line] = _problems(_cfg(rg_config="[1, 2]"))
  assert line.startswith("config.task.rg_config:") and "got '[1, 2]'" in line, line
  # An argument the dataset's config class does not take, a value its validate() refuses, a
  # key naming no dataset of task.name, a seed of its own: each one line naming the key.
  problems = _problems(_cfg(rg_config=json.dumps(
      {"basic_arithmetic": {"max_term": 3}, "leg_counting": {"min_animals": 0},
       "leg_countin": {}})))
  assert len(problems) == 3 and all(p.startswith("config.task.rg_config: ") for p in problems)
  text = "\n".join(problems)
  assert "['leg_countin'] name no reasoning-gym dataset" in text
  assert "'basic_arithmetic' rejects {\"max_term\": 3}" in text and "max_term" in text
  assert "'leg_counting' rejects {\"min_animals\": 0}" in text and "min_animals must be" in text
  [line] = _problems(_cfg(rg_config='{"leg_counting": {"seed": 3}}'))
  assert line.startswith("config.task.rg_config: dataset 'leg_counting' sets 'seed'"), line
  # No demonstrations: the warm-up must be off.
  cfg = _cfg()
  cfg.sft.enabled = True
  [line] = _problems(cfg)
  assert line.startswith("config.sft.enabled:"), line


@pytest.mark.reasoning_gym
@pytest.mark.slow  # a whole run (fast-suite time budget)
def test_tiny_run_on_a_mixture_draws_and_scores_both_datasets(tmp_path):
  pytest.importorskip("reasoning_gym")
  run_dir = tmp_path / "run"
  proc = _train([
      f"--config.task.name={ARITH}+{LEGS}", f"--config.task.rg_config={json.dumps(RG_CONFIG)}",
      "--config.task.weights=1,1", "--config.sft.enabled=false",
      "--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
      "--config.rollout.max_prompt_len=640", "--config.rollout.max_new_tokens=8",
      "--config.rollout.num_prompts=8", "--config.rollout.group_size=2",
      "--config.task.val_size=16", "--config.task.dev_size=8", "--config.val.batch_size=32",
      "--config.train.steps=3", "--config.val.every=3", f"--config.run_dir={run_dir}"],
      tmp_path, {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for name in (ARITH, LEGS):
    # Each row reports its dataset's score: a finite mean means rows of that dataset were
    # drawn and graded by its scorer in that step.
    scores = [r.get(f"env/metadata/{name}/score") for r in rl]
    assert any(s is not None and 0.0 <= s <= 1.0 for s in scores), (name, scores)
  for r in rl:
    assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["reward/format"] <= 1.0
  val = [r for r in rows if r["phase"] == "val"]
  assert [r["step"] for r in val] == [0, 3]
  for r in val:  # a mixture's validation reports each task
    for name in (ARITH, LEGS):
      assert 0.0 <= r[f"val/{name}/accuracy"] <= 1.0, r


def test_naming_a_reasoning_gym_task_without_the_package_is_a_config_error():
  # `None` in sys.modules makes `import reasoning_gym` fail as if it were not installed.
  code = ("import sys; sys.modules['reasoning_gym'] = None\n"
          "from jaxrl import config\n"
          "from jaxrl.recipes.default import get_config\n"
          "cfg = get_config(); cfg.task.name = 'add+reasoning_gym:leg_counting'\n"
          "try:\n  config.validate(cfg, 1)\n"
          "except config.ConfigError as e:\n  print(e)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines() == [
      "config.task.name: task 'reasoning_gym:leg_counting' needs the reasoning-gym package, "
      "which is not installed: pip install -e \".[reasoning-gym]\""], proc.stdout
