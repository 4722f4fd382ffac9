"""docs/tasks.md's custom-task recipe (the README's "Your own task" links it), run as written:
recipe file trains through `python -m jaxrl.train --config my_recipe.py`, and its reward
components are logged per step."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from test_cli import _train

TASKS_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tasks.md"


def _recipe() -> str:
  blocks = [b for b in re.findall(r"```python\n(.*?)```", TASKS_DOC.read_text(), re.S)
            if b.startswith("# my_recipe.py")]
  assert len(blocks) == 1, blocks
  return blocks[0]


@pytest.mark.slow  # a whole run (fast-suite time budget)
def test_readme_custom_task_recipe_trains(tmp_path):
  (tmp_path / "my_recipe.py").write_text(_recipe())
  run_dir = tmp_path / "run"
  proc = _train(["--config", "my_recipe.py", "--config.train.steps=3", "--config.val.every=3",
                 "--config.model.num_layers=1", f"--config.run_dir={run_dir}"], tmp_path,
                {"JAX_LOG_COMPILES": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for r in rl:
    # The components are the environment's, averaged over the step's rows: exact <= letters,
    # and the reward is exact + 0.3 * (letters without exact).
    assert 0.0 <= r["reward/exact"] <= r["reward/letters"] <= 1.0
    assert abs(r["reward"] - (r["reward/exact"] + 0.3 * (r["reward/letters"] -
                                                          r["reward/exact"]))) < 1e-5, r
  val = [r for r in rows if r["phase"] == "val"]
  assert [r["step"] for r in val] == [0, 3] and all(0 <= r["val/accuracy"] <= 1 for r in val)
  assert json.loads((run_dir / "config.json").read_text())["task"]["name"] == "reverse"


def test_unregistered_task_names_the_registered_ones(tmp_path):
  proc = _train(["--config.task.name=reverse", f"--config.run_dir={tmp_path / 'run'}"], tmp_path)
  out = proc.stdout + proc.stderr
  # The message lists every built-in task the registry holds, word_math included.
  assert proc.returncode != 0 and "config.task.name: must be one of ['add', 'countdown', " \
      "'guess', 'math', 'word_math']" in out and "got 'reverse'" in out, out
  assert not (tmp_path / "run").exists()
