"""pyproject's extras install with any pip: names spelled so that the pip a fresh Python 3.11 venv
ships (23.2.1) finds them, install hints that work from a clone, upper bounds on the packages
that change under jaxrl, and a missing `hf` extra as one `jaxrl:` line."""

import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
  PROJECT = tomllib.load(f)["project"]
EXTRAS = PROJECT["optional-dependencies"]
# `pip install -e ".[a,b]"` or `pip install ".[a]"` as written in code, docs and CI.
HINT = re.compile(r"""pip install[^\n"']*?["']?\.\[([A-Za-z0-9_,.\- ]+)\]""")


def _hinted_extras():
  files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, ".ci", "run"),
           *glob.glob(os.path.join(ROOT, "docs", "*.md")),
           *glob.glob(os.path.join(ROOT, "jaxrl", "**", "*.py"), recursive=True),
           *glob.glob(os.path.join(ROOT, "scripts", "**", "*"), recursive=True)]
  out = {}
  for path in files:
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      for match in HINT.finditer(f.read()):
        for name in match.group(1).split(","):
          out.setdefault(name.strip(), os.path.relpath(path, ROOT))
  return out


def test_extra_names_are_spelled_as_every_pip_matches_them():
  # setuptools >= 77 writes Provides-Extra normalised (lower case, runs of -_. as one '-'); pip
  # 23.2.1 compares the requested name, lower-cased, with it as written. A name that is its own
  # normal form is found by both.
  for name in EXTRAS:
    assert name == re.sub(r"[-_.]+", "-", name).lower(), f"extra {name!r} is not normalised"


def test_every_install_hint_names_an_extra_by_its_spelling():
  hinted = _hinted_extras()
  assert {"hf", "math", "reasoning-gym"} <= set(hinted), hinted  # the scan finds the hints
  unknown = {n: where for n, where in hinted.items() if n not in EXTRAS}
  assert not unknown, f"install hints naming no extra (spelled so): {unknown}"


def test_no_hint_names_an_unpublished_package():
  for path in glob.glob(os.path.join(ROOT, "jaxrl", "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    assert not re.search(r"pip install [\"']?jaxrl\[", text), path


def test_packages_that_change_under_jaxrl_have_upper_bounds():
  reqs = [Requirement(r) for r in PROJECT["dependencies"]]
  reqs += [Requirement(r) for rs in EXTRAS.values() for r in rs]
  for req in reqs:
    if req.name in ("jax", "transformers", "peft", "trl", "torch"):
      assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), str(req)
  jax = next(r for r in reqs if r.name == "jax")
  # The bound admits the jax this suite runs on (the CPU runs: 0.10.2).
  installed = importlib.metadata.version("jax")
  assert jax.specifier.contains(installed), (str(jax), installed)
  assert not jax.specifier.contains("0.12.0")


def test_cuda_extra_is_the_cuda13_plugin_and_chex_is_gone():
  assert [Requirement(r).extras for r in EXTRAS["cuda"]] == [{"cuda13"}]
  assert not any(Requirement(r).name == "chex" for r in PROJECT["dependencies"])
  for path in glob.glob(os.path.join(ROOT, "jaxrl", "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      assert not re.search(r"^\s*(import|from) chex\b", f.read(), re.M), path


def test_missing_hf_extra_is_one_line(tmp_path):
  code = ("import sys; sys.modules['tokenizers'] = None\n"
          f"sys.argv = ['jaxrl-train', '--config.model.hf_path={tmp_path}',\n"
          f"            '--config.sft.enabled=false', '--config.run_dir={tmp_path}/run']\n"
          "from jaxrl.train import run\nrun()\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      "jaxrl: config.model.hf_path: a Hugging Face model needs the hf extra (tokenizers not "
      "installed): pip install -e \".[hf]\""], proc.stderr
  assert not (tmp_path / "run").exists()


def test_missing_optional_module_at_run_time_names_its_extra():
  from jaxrl.cli import common

  e = ModuleNotFoundError("No module named 'safetensors'", name="safetensors")
  assert common.user_message(e) == (
      'jaxrl: safetensors is not installed (the hf extra): pip install -e ".[hf]"')
  assert common.user_message(ModuleNotFoundError("x", name="nothing_of_ours")) is None


def _bundled_pip_venv(tmp_path):
  python = shutil.which("python3.11")
  if python is None:
    pytest.skip("no python3.11 on PATH")
  venv = tmp_path / "venv"
  subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
  pip = str(venv / "bin" / "pip")
  version = subprocess.run([pip, "--version"], capture_output=True, text=True).stdout.split()[1]
  return pip, version


@pytest.mark.slow
def test_bundled_pip_of_a_fresh_venv_finds_every_extra(tmp_path):
  """A fresh `python3.11 -m venv` (its bundled pip, not upgraded) finds each extra by the
  spelling hints and docs use: pip's own report of the editable install lists it among the
  extras it provides. The underscore spelling, which that pip misses, is the control: with the
  dependencies resolved it warns "does not provide the extra" for it and not for ours."""
  pip, version = _bundled_pip_venv(tmp_path)
  hinted = sorted(set(_hinted_extras()) | set(EXTRAS))
  report = tmp_path / "report.json"
  proc = subprocess.run([pip, "install", "--dry-run", "--no-deps", "--report", str(report),
                         "-e", f".[{','.join(hinted)}]"], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (item,) = json.loads(report.read_text())["install"]
  provided = item["metadata"]["provides_extra"]
  # pip 23.2 matches the lower-cased request against Provides-Extra as written.
  missing = [n for n in hinted if n.lower() not in provided]
  assert not missing, (version, missing, provided)
  assert "reasoning_gym" not in provided  # the spelling old pips miss is not what it writes
  # The warning itself, with dependencies resolved (light extras only: no torch or CUDA).
  light = [n for n in ("hf", "math", "tensorboard", "reasoning-gym") if n in EXTRAS]
  for extras, warned in ((light, False), (["reasoning_gym"], True)):
    proc = subprocess.run([pip, "install", "--dry-run", "-e", f".[{','.join(extras)}]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert ("does not provide the extra" in out) == warned, (version, extras, out[-3000:])
    if not warned:
      assert "reasoning-gym-" in out or "reasoning_gym-" in out, out[-2000:]
