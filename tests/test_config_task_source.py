"""The task-source protocol (`jaxrl.data.sources.TaskSource`): a source of the user's own that
lacks part of it is named in one `jaxrl:` line when its task is registered (a class's methods) or
its source built (before the run writes anything), not an AttributeError deep in the run."""

import subprocess
import sys
import textwrap

import pytest

from jaxrl.data.sources import (
  SOURCE_ATTRIBUTES,
  TaskSource,
  TaskSourceError,
  check_source,
  source_problems,
)
from jaxrl.envs import registry
from jaxrl.recipes.default import get_config

# A wrapper that re-tags another task's rows: it forwards split and sample but not alphabet.
WRAPPER = textwrap.dedent("""\
    from jaxrl.envs import make_source, register
    from jaxrl.envs.arithmetic import AddEnvironment
    from jaxrl.recipes.default import get_config as base

    class ReTagged:
      def __init__(self, inner):
        self.inner, self.name = inner, "retag"
      def split(self, name):
        return self.inner.split(name)
      def sample(self, rng, n):
        return self.inner.sample(rng, n)

    @register("retag", source=lambda cfg: ReTagged(make_source("add", cfg)))
    class ReTagEnvironment(AddEnvironment):
      pass

    def get_config():
      c = base()
      c.task.name = "retag"
      c.sft.enabled = False
      return c
""")


def test_protocol_lists_what_the_run_reads():
  assert [a for a, _ in SOURCE_ATTRIBUTES] == ["name", "alphabet", "split", "sample"]
  cfg = get_config()
  source = registry.make_source("add", cfg)  # a built-in source passes
  assert isinstance(source, TaskSource) and source_problems(source) == []


def test_source_missing_alphabet_is_named():
  class NoAlphabet:
    name = "x"

    def split(self, name):
      return []

    def sample(self, rng, n):
      return []

  assert source_problems(NoAlphabet()) == ["alphabet"]
  with pytest.raises(TaskSourceError) as e:
    check_source("x", NoAlphabet())
  assert str(e.value).startswith("task 'x': its source NoAlphabet has no alphabet; a task source")
  assert "\n" not in str(e.value)


def test_registering_a_source_class_without_its_methods_is_refused():
  class Half:
    name, alphabet = "half", "0123456789"

    def split(self, name):
      return []

  with pytest.raises(ValueError, match=r"task 'half_task': source Half has no sample"):
    registry.register("half_task", source=Half)(type("HalfEnvironment", (), {}))
  assert "half_task" not in registry.TASKS


def test_cli_names_the_missing_attribute_before_writing(tmp_path):
  (tmp_path / "retag.py").write_text(WRAPPER)
  run_dir = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config", "retag.py",
                         f"--config.run_dir={run_dir}"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "jaxrl: task 'retag': its source ReTagged has no alphabet; a task source has name and "
      "alphabet (str), split(name) and sample(rng, n) (jaxrl.data.sources.TaskSource)"]
  assert not run_dir.exists()
