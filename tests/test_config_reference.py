"""The config reference (`jaxrl.config.reference`): `--help` lists every key of default.py with
its default, allowed values and meaning; docs/config.md is its generated Markdown and must not
be stale; every numeric key has a range rule."""

import ast
import os
import subprocess
import sys

import pytest

from jaxrl.config import reference
from jaxrl.config.schema import RULES, flatten, is_section
from jaxrl.recipes import default as default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEAVES = {k: v for k, v in flatten(default_config.get_config()).items() if not is_section(v)}


def _train(*args, env=None):
  return subprocess.run([sys.executable, "-m", "jaxrl.train", *args], capture_output=True,
                        text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_zero_and_names_every_key_with_its_default(flag):
  proc = _train(flag)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  for key, value in LEAVES.items():
    # The default as it is typed on the command line (a string in double quotes).
    want = f"--config.{key}=" + (("true" if value else "false") if isinstance(value, bool)
                                 else f'"{value}"' if isinstance(value, str) else repr(value))
    assert any(line.strip() == want for line in lines), f"{want} not in --help"
  assert "--print_config" in proc.stdout and "--debug" in proc.stdout


def test_help_shows_a_rule_and_a_comment_from_their_sources():
  out = _train("--help").stdout
  block = out.split("--config.rollout.group_size=8", 1)[1].split("--config.", 1)[0]
  # The comment on default.py's line, and the requirement of its rule in RULES.
  assert "samples per prompt" in block and ">= 2" in block, block


def test_every_key_has_a_help_line():
  helps = reference.help_texts()
  missing = [k for k in LEAVES if not helps.get(k, "").strip()]
  assert not missing, f"keys of default.py without a comment: {missing}"


def test_help_comes_from_the_line_or_the_lines_above():
  source = ("def get_config():\n  c = ConfigDict()\n  # first line\n  # second line\n"
            "  c.a = 1\n  c.b = 2  # trailing\n\n  # not attached\n\n  c.d = 3\n")
  helps = reference.help_texts(source)
  assert helps == {"a": "first line second line", "b": "trailing", "d": ""}


def test_docs_config_md_is_generated_and_current():
  with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
    text = f.read()
  assert text == reference.markdown() + "\n", (
      "docs/config.md is stale: python -m jaxrl.config.reference --markdown > docs/config.md")
  for key in LEAVES:
    assert f"| `{key}` |" in text, key


def _numeric_keys():
  return [k for k, v in LEAVES.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def test_every_numeric_key_has_a_range_rule():
  ruled = {k for k, _ in RULES}
  missing = [k for k in _numeric_keys() if k not in ruled]
  assert not missing, f"numeric keys of default.py without a rule in RULES: {missing}"
  assert len(_numeric_keys()) > 100  # the walk saw the schema, not an empty config


def test_every_default_passes_its_own_rules():
  bad = [(k, req) for k, (pred, req) in RULES if k in LEAVES and not pred(LEAVES[k])]
  assert not bad, bad


def test_default_py_sets_every_key_once():
  with open(reference.SOURCE, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  assert set(reference.help_texts()) >= set(LEAVES)
  assert len([n for n in ast.walk(tree) if isinstance(n, ast.Assign)]) >= len(LEAVES)
