"""Errors a user can cause end as `jaxrl: <message>` naming the key, file or line, a non-zero
exit and no traceback, before anything is compiled or created; `--config.debug=true` and
`JAXRL_DEBUG=1` show the traceback.

Every case runs `python -m jaxrl.train` as a user would. The runs are started together by one
module fixture (each is mostly interpreter and JAX start-up), and each case then checks its own.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import save_file

import hf_fixtures
from test_cli import _train

NO_SFT = "--config.sft.enabled=false"
ROW = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}
GOOD = json.dumps(ROW).encode() + b"\n"
LATIN1 = b'{"question": "caf\xe9?", "answer": "#### 1"}\n'  # "café" saved as Latin-1


def _rows(path: pathlib.Path, n: int = 12) -> str:
  path.write_text("".join(json.dumps(ROW) + "\n" for _ in range(n)))
  return str(path)


def _math(path: pathlib.Path, *extra: str) -> list[str]:
  return [NO_SFT, "--config.task.name=math", f"--config.task.path={path}", *extra]


def _lines(path: pathlib.Path, *lines: bytes) -> pathlib.Path:
  path.write_bytes(b"".join(lines))
  return path


def _recipe(text: str):
  def setup(d: pathlib.Path) -> list[str]:
    (d / "recipe.py").write_text(text)
    return ["--config", "recipe.py"]
  return setup


def _hf_dir(d: pathlib.Path) -> pathlib.Path:
  """A model directory whose tokenizer and config.json are fine and whose weights end early."""
  model = d / "model"
  hf_fixtures.qwen_files(model)
  (model / "config.json").write_text(json.dumps({
      "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
      "vocab_size": 300}))
  weights = model / "model.safetensors"
  save_file({"model.embed_tokens.weight": np.zeros((300, 32), np.float32)}, str(weights))
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) - 1000])  # a download cut short
  return model


# name -> (setup(case dir) -> CLI args, fragments stderr must contain). The case directory is the
# working directory; every case runs with --config.run_dir=<case dir>/run unless it names one.
CASES = {
    # The command line itself.
    "unknown_flag": (lambda d: ["--steps=3"],
                     ["jaxrl: Unknown command line flag 'steps'", "--config.key=value"]),
    "stray_argument": (lambda d: ["configs/default.py"],
                       ["jaxrl: unexpected arguments ['configs/default.py']"]),
    "config_without_file": (lambda d: ["--config"], ["jaxrl: Missing value for flag --config"]),
    # Recipe files (--config).
    "config_file_missing": (lambda d: ["--config=nope.py"],
                            ["jaxrl: config file nope.py: no such file"]),
    "config_file_without_get_config": (
        _recipe("from jaxrl.recipes.default import get_config as base\n\n"
                "def get_cofig():\n  return base()\n"),
        ["jaxrl: config file recipe.py: defines no get_config()", "get_cofig"]),
    "config_file_syntax_error": (
        _recipe("from jaxrl.recipes.default import get_config as base\n\n"
                "def get_config(:\n  return base()\n"),
        ["jaxrl: config file recipe.py: syntax error at line 3"]),
    "config_file_raises": (
        _recipe("from jaxrl.recipes.default import get_config as base\n\n"
                "def get_config():\n  c = base()\n  c.train.steps = {}[\"steps\"]\n  return c\n"),
        ["jaxrl: config file recipe.py: get_config() raised KeyError at line 5",
         "'steps'"]),
    # A recipe written before jaxrl's modules moved into folders by role.
    "config_file_imports_a_moved_module": (
        _recipe("from jaxrl.configs.default import get_config\n"),
        ["jaxrl: config file recipe.py: raised ModuleNotFoundError at line 1",
         "(jaxrl.configs is now jaxrl.recipes)"]),
    # The run directory.
    "run_dir_is_a_file": (
        lambda d: [f"--config.run_dir={_lines(d / 'taken', b'x')}"],
        ["config.run_dir: ", "taken is a file, not a directory"]),
    "run_dir_under_a_file": (
        lambda d: [f"--config.run_dir={_lines(d / 'taken', b'x')}/run"],
        ["config.run_dir: ", "cannot be created: ", "taken is a file"]),
    # Resuming from a directory that holds no checkpoint.
    "resume_without_checkpoint": (
        lambda d: [f"--config.resume={(d / 'empty').mkdir() or d / 'empty'}"],
        ["config.resume: ", "empty holds no checkpoint"]),
    # Values that fail deep in JAX or in the numerics.
    "seed_too_large": (lambda d: [f"--config.seed={2**63}"],
                       ["config.seed: must be <= 4294967295", f"got {2**63}"]),
    "rollout_temperature_too_small": (lambda d: ["--config.rollout.temperature=1e-30"],
                                      ["config.rollout.temperature: must be >= 0.0001",
                                       "got 1e-30"]),
    "val_temperature_too_small": (lambda d: ["--config.val.temperature=1e-6"],
                                  ["config.val.temperature: must be 0 (greedy) or >= 0.0001"]),
    # Sizes that cannot fit in memory on any machine.
    "max_new_tokens_too_large": (
        lambda d: [f"--config.rollout.max_new_tokens={10**12}"],
        ["config.rollout.max_new_tokens: a batch cannot fit in memory", "1,024 rows",
         "1,000,000,000,006 tokens", "GiB"]),
    "num_prompts_too_large": (
        lambda d: [f"--config.rollout.num_prompts={10**12}"],
        ["config.rollout.num_prompts: a batch cannot fit in memory", "8,000,000,000,000 rows",
         "GiB"]),
    # Task data files, named with the line.
    "jsonl_not_utf8": (
        lambda d: _math(_lines(d / "data.jsonl", GOOD, LATIN1)),
        ["config.task.path: ", "data.jsonl line 2: not UTF-8 text (byte 0xe9 at column 18)"]),
    "jsonl_malformed_row": (
        lambda d: _math(_lines(d / "data.jsonl", GOOD, GOOD, b'{"question": "2 + 2?",\n')),
        ["config.task.path: ", "data.jsonl line 3: invalid JSON"]),
    "jsonl_empty_row": (
        lambda d: _math(_lines(d / "data.jsonl", GOOD, b"{}\n")),
        ["config.task.path: ", "data.jsonl line 2: missing field 'question'"]),
    "jsonl_empty_file": (
        lambda d: _math(_lines(d / "data.jsonl")),
        ["config.task.path: ", "data.jsonl: no rows"]),
    "jsonl_bad_val_file": (
        lambda d: _math(pathlib.Path(_rows(d / "train.jsonl")),
                        f"--config.task.val_path={_lines(d / 'val.jsonl', GOOD, b'[1]')}"),
        ["config.task.val_path: ", "val.jsonl line 2: expected a JSON object, got list"]),
    # Model files: a truncated safetensors file is named before the model is built.
    "safetensors_truncated": (
        lambda d: [NO_SFT, f"--config.model.hf_path={_hf_dir(d)}"],
        ["config.model.hf_path: ", "model.safetensors: truncated"]),
}

# Cases run with the traceback asked for: (name of the failing case, extra args, environment).
DEBUG = {
    "debug_override": ("config_file_missing", ["--config.debug=true"], {}),
    "debug_environment": ("seed_too_large", [], {"JAXRL_DEBUG": "1"}),
}

if os.geteuid() != 0:  # root writes anywhere, as the run would
  def _read_only(d: pathlib.Path) -> list[str]:
    (d / "ro").mkdir()
    (d / "ro").chmod(0o555)
    return [f"--config.run_dir={d}/ro/run"]

  CASES["run_dir_read_only"] = (_read_only, ["config.run_dir: ", "ro is not writable"])


def _run(args: list[str], cwd: pathlib.Path, env: dict[str, str]):
  """The finished process; a run that is still going after a minute has not failed up front
  (it is training), which its test reports."""
  try:
    return _train(args, cwd, env, timeout=60)
  except subprocess.TimeoutExpired as e:
    return e


def _finished(proc):
  if isinstance(proc, subprocess.TimeoutExpired):
    pytest.fail(f"still running after {proc.timeout:.0f} s instead of failing up front:\n"
                f"{proc.stdout}\n{proc.stderr}")
  return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """name -> (case directory, files there before the run, completed process)."""
  base = tmp_path_factory.mktemp("user_errors")
  jobs = {**{n: (n, [], {}) for n in CASES}, **DEBUG}
  started = {}
  with ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1)) as pool:
    for name, (case, extra, env) in jobs.items():
      d = base / name
      d.mkdir()
      args = CASES[case][0](d)
      if not any(a.startswith("--config.run_dir=") for a in args):
        args.append(f"--config.run_dir={d / 'run'}")
      before = sorted(p.relative_to(d) for p in d.rglob("*"))
      started[name] = (d, before, pool.submit(_run, [*args, *extra], d, env))
  yield {name: (d, before, job.result()) for name, (d, before, job) in started.items()}
  for name in started:  # let tmp_path clean-up remove the read-only case
    if (base / name / "ro").exists():
      (base / name / "ro").chmod(0o755)


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_error_is_one_line_and_creates_nothing(runs, name):
  d, before, proc = runs[name]
  proc = _finished(proc)
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out
  assert "Traceback" not in proc.stderr, proc.stderr
  assert any(line.startswith("jaxrl: ") for line in proc.stderr.splitlines()), proc.stderr
  for fragment in CASES[name][1]:
    assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
  # Validation comes before any compilation (JAX_LOG_COMPILES=1 would log one).
  assert "Compiling" not in out and "Finished tracing" not in out, out
  # Nothing was created: no run directory, no ./runs, no file in the case directory.
  assert sorted(p.relative_to(d) for p in d.rglob("*")) == before


@pytest.mark.parametrize("name", sorted(DEBUG))
def test_debug_shows_the_traceback(runs, name):
  _, _, proc = runs[name]
  proc = _finished(proc)
  assert proc.returncode != 0
  assert "Traceback (most recent call last)" in proc.stderr, proc.stderr
  error = {"config_file_missing": "RecipeError", "seed_too_large": "ConfigError"}
  assert error[DEBUG[name][0]] in proc.stderr, proc.stderr


def test_read_only_run_dir_is_named(tmp_path, monkeypatch):
  # The CLI case above needs a user that permissions stop (root writes anywhere); here the
  # permission check itself answers no.
  from jaxrl.config import ConfigError, parse_overrides, validate
  from jaxrl.recipes.default import get_config

  (tmp_path / "ro").mkdir()
  monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith("ro"))
  for run_dir, expected in ((tmp_path / "ro", "ro is not writable"),
                            (tmp_path / "ro" / "run", "cannot be created: ")):
    with pytest.raises(ConfigError) as e:
      validate(parse_overrides(get_config(), [f"--config.run_dir={run_dir}"]), 1)
    assert [p.split(": ")[0] for p in e.value.problems] == ["config.run_dir"]
    assert expected in e.value.problems[0] and "ro" in e.value.problems[0]


def test_user_errors_keep_their_builtin_classes_and_print_one_line():
  from jaxrl.cli import train
  from jaxrl.config import ConfigError, RecipeError
  from jaxrl.data.hf_files import HFTokenizerError
  from jaxrl.data.sources import BadRow
  from jaxrl.core.errors import DataFileError, UserError
  from jaxrl.models.hf_checkpoint import HFCheckpointError, UnsupportedModelError

  for cls in (ConfigError, RecipeError, HFTokenizerError, BadRow, DataFileError,
              HFCheckpointError):
    assert issubclass(cls, UserError) and issubclass(cls, ValueError), cls
  assert issubclass(UnsupportedModelError, NotImplementedError)
  assert train.user_message(DataFileError("d.jsonl line 3: invalid JSON")) == \
      "jaxrl: d.jsonl line 3: invalid JSON"
  assert train.user_message(ConfigError(["config.seed: bad"])) == "jaxrl: config.seed: bad"
  assert train.user_message(ConfigError(["config.seed: bad", "config.name: bad"])) == (
      "jaxrl: invalid config\n2 problems found in config:\nconfig.seed: bad\nconfig.name: bad")
  denied = PermissionError(13, "Permission denied", "/data/run/metrics.jsonl")
  assert train.user_message(denied) == "jaxrl: /data/run/metrics.jsonl: Permission denied"
  assert train.user_message(OSError(28, "No space left on device", "/data/run")) == \
      "jaxrl: /data/run: No space left on device"
  assert train.user_message(FileNotFoundError("resume path 'x' does not exist")) == \
      "jaxrl: resume path 'x' does not exist"
  assert train.user_message(MemoryError()).startswith("jaxrl: out of host memory")
  assert train.user_message(KeyError("bug")) is None  # a bug keeps its traceback


@pytest.mark.slow
def test_run_time_user_error_on_the_rollout_thread_is_one_line(tmp_path):
  """Dynamic sampling that cannot fill a batch fails on the rollout thread before the first
  update, while the train step still compiles on its own thread: one `jaxrl:` line naming the
  keys, exit status 1, and no traceback or abort from a thread left inside XLA at exit. A tol of
  1.0 keeps no group: exact-match rewards lie in [0, 1], so max - min never exceeds it."""
  proc = _train(["--config.sft.enabled=false", "--config.dynamic_sampling.enabled=true",
                 "--config.dynamic_sampling.tol=1.0", "--config.dynamic_sampling.max_gen_batches=1",
                 "--config.rollout.num_prompts=8", "--config.train.steps=2",
                 f"--config.run_dir={tmp_path}/run"], tmp_path, timeout=300)
  err = proc.stderr
  assert proc.returncode == 1, (proc.returncode, err)
  assert "jaxrl: only 0 of 8 groups had reward variance" in err, err
  assert "dynamic_sampling.max_gen_batches" in err, err
  assert "Traceback" not in err and "Fatal Python error" not in err, err
