"""One command-line style across train, evaluate, export and plot: snake_case long flags, `--run`
for a run directory, errors as one line `jaxrl: ...` (exit status 1), and `--debug` (or
`JAXRL_DEBUG=1`, or `--config.debug=true` where a config is read) for the traceback."""

import re
import subprocess
import sys

import pytest

from jaxrl.core.errors import UserError
from jaxrl.evaluate import main as evaluate_main
from jaxrl.export import main as export_main
from jaxrl.plot import main as plot_main

COMMANDS = ["jaxrl.train", "jaxrl.evaluate", "jaxrl.export", "jaxrl.plot"]


def _help(module):
  proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout


@pytest.mark.parametrize("module", COMMANDS)
def test_help_lists_snake_case_flags_with_debug(module):
  text = _help(module)
  flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_.-]*", text))
  assert "--debug" in flags, text
  hyphenated = sorted(f for f in flags if "-" in f[2:] and not f.startswith("--config."))
  assert not hyphenated, f"{module}: flags not in snake_case: {hyphenated}"
  if module != "jaxrl.train":
    assert "--run" in flags, text


@pytest.mark.parametrize("main", [evaluate_main, export_main, plot_main],
                         ids=["evaluate", "export", "plot"])
def test_a_bad_flag_is_one_jaxrl_line(main, capsys):
  with pytest.raises(SystemExit) as e:
    main(["--run", "x", "--out", "o", "--no_such_flag"])
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and err.startswith("jaxrl: "), err
  assert "--no_such_flag" in err


@pytest.mark.parametrize("main", [evaluate_main, export_main, plot_main],
                         ids=["evaluate", "export", "plot"])
def test_a_missing_run_is_one_jaxrl_line_and_debug_raises(main, tmp_path, capsys, monkeypatch):
  args = ["--run", str(tmp_path / "nope")] + (["--out", str(tmp_path / "o")]
                                              if main is export_main else [])
  assert main(args) == 1
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and err.startswith("jaxrl: ") and "nope" in err, err
  with pytest.raises((UserError, OSError)):
    main([*args, "--debug"])
  monkeypatch.setenv("JAXRL_DEBUG", "1")
  with pytest.raises((UserError, OSError)):
    main(args)


def test_evaluate_honours_config_debug(tmp_path, capsys):
  args = ["--run", str(tmp_path)]
  assert evaluate_main(args) == 1
  with pytest.raises(UserError, match="is not a jaxrl run directory"):
    evaluate_main([*args, "--config.debug=true"])


def test_export_run_dir_is_a_deprecated_spelling_of_run(tmp_path, capsys):
  assert export_main(["--run_dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "jaxrl: --run_dir is deprecated; use --run", err
  assert len(err) == 2 and err[1].startswith("jaxrl: ") and "nope" in err[1], err


def test_evaluate_batch_size_old_spelling_is_deprecated(tmp_path, capsys):
  assert evaluate_main(["--run", str(tmp_path), "--batch-size", "8"]) == 1
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "jaxrl: --batch-size is deprecated; use --batch_size", err
  assert len(err) == 2 and "not a jaxrl run directory" in err[1], err
