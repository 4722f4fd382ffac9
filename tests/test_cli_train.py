"""`python -m jaxrl.train` as a command: the dry run (`--print_config`) prints the config and its
plan without compiling or creating anything; the `jaxrl-train` console script is the same
command (same output, errors and exit status); `--debug` shows the traceback."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

# Runs `python -m jaxrl.train` with jax.monitoring listening for compile events; prints the
# events last (the command ends in sys.exit, which runs atexit).
WATCHED = textwrap.dedent("""\
    import atexit, sys
    import jax, jax.monitoring
    events = []
    jax.monitoring.register_event_duration_secs_listener(lambda name, *a, **k: events.append(name))
    atexit.register(lambda: print("COMPILE EVENTS", [e for e in events if "compile" in e]))
    if sys.argv[1] == "--jit":
      jax.jit(lambda x: x + 1)(1)
      sys.exit(0)
    from jaxrl.train import run
    sys.argv[0] = "jaxrl-train"
    run()
""")


def _watched(tmp_path, *args):
  script = tmp_path / "watched.py"
  script.write_text(WATCHED)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)


def test_the_watch_sees_a_compilation(tmp_path):
  # The listener the dry-run test relies on does report a compilation when one happens.
  proc = _watched(tmp_path, "--jit")
  assert "backend_compile" in proc.stdout, proc.stdout + proc.stderr


def test_dry_run_prints_config_and_plan_without_compiling_or_creating(tmp_path):
  run_dir = tmp_path / "run"
  proc = _watched(tmp_path, "--print_config", "--config.train.steps=7",
                  "--config.rollout.num_prompts=64", f"--config.run_dir={run_dir}")
  out = proc.stdout
  assert proc.returncode == 0, proc.stderr
  assert "COMPILE EVENTS []" in out, out
  assert not run_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["watched.py"]
  assert "--config.train.steps=7  (default 600)" in out
  assert "--config.rollout.group_size=8\n" in out  # every key, changed or not
  # The plan: 64 prompts x 8 samples = 512 rows of 6 + 4 tokens; with shared prompts a group
  # is 6 + 8 x 4 = 38 tokens, and the fewest micro-batches keeping 64 / m groups x 38 tokens
  # within 2048 is m = 2 (32 x 38 = 1216; 64 x 38 = 2432 is over).
  assert "train mesh: data 1 x fsdp 1 x tensor 1" in out, out
  assert "64 prompts x 8 samples = 512 rows of 6 + 4 tokens" in out, out
  assert "2 micro-batch(es) of 256 rows per shard" in out, out
  assert "memory plan per device" in out, out


def test_dry_run_of_a_bad_config_is_the_config_error(tmp_path):
  proc = _watched(tmp_path, "--print_config", "--config.train.steps=0")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      "jaxrl: config.train.steps: must be >= 1 (0 would run no RL step), got 0"], proc.stderr


def _console_script():
  path = os.path.join(os.path.dirname(sys.executable), "jaxrl-train")
  if not os.path.exists(path):
    path = shutil.which("jaxrl-train")
  if path is None:
    pytest.skip("jaxrl-train is not installed (pip install -e .)")
  return path


@pytest.mark.parametrize("args", [
    ["--help"], ["-h"], ["--helpfull"], ["--no_such_flag"], ["--config.train.steps=0"],
    ["--config.trian.steps=3", "--config.seed=-1"], ["stray"],
    ["--config", "/nonexistent/recipe.py"]],
    ids=["help", "h", "helpfull", "unknown-flag", "one-problem", "two-problems", "stray-arg", "no-recipe"])
def test_console_script_is_the_module(tmp_path, args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  a = subprocess.run([sys.executable, "-m", "jaxrl.train", *args], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=120)
  b = subprocess.run([_console_script(), *args], cwd=tmp_path, env=env, capture_output=True,
                     text=True, timeout=120)
  assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
  assert a.returncode == (0 if args[0] in ("--help", "-h", "--helpfull") else 1)
  if a.returncode:
    assert a.stderr.startswith("jaxrl: ") and "Traceback" not in a.stderr, a.stderr
  assert list(tmp_path.iterdir()) == []


def test_debug_flag_shows_the_traceback(tmp_path):
  args = [sys.executable, "-m", "jaxrl.train", "--config", str(tmp_path / "missing.py")]
  quiet = subprocess.run(args, capture_output=True, text=True, timeout=120)
  loud = subprocess.run([*args, "--debug"], capture_output=True, text=True, timeout=120)
  assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
  assert loud.returncode == 1 and "Traceback" in loud.stderr and "RecipeError" in loud.stderr


def test_recipe_returning_a_plain_dict_is_one_line(tmp_path):
  (tmp_path / "plain.py").write_text(
      "def get_config():\n  return {'seed': 1, 'train': {'steps': 3}}\n")
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config", "plain.py"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "jaxrl: config file plain.py: get_config() returned a plain dict without "), lines
  assert "start from jaxrl.recipes.default.get_config()" in lines[0]
  # A whole config as a dict (e.g. a saved config.json's) is still a config.
  (tmp_path / "whole.py").write_text(
      "from jaxrl.recipes.default import get_config as base\n"
      "def get_config():\n  c = base().to_dict()\n  c['train']['steps'] = 3\n  return c\n")
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config", "whole.py",
                         "--print_config"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "--config.train.steps=3  (default 600)" in proc.stdout
