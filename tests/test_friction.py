"""A first custom workload's friction (issue 22): prompts that do not fit stop the run up front
(or, from a stream, once the skipped share is known) naming the budget and the longest prompt;
the chat-template error names the real config key; the `math` grader keeps math-verify quiet;
the console leaves out validation that did not run and reports generation throughput."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import types
import warnings

import jax
import numpy as np
import pytest

from jaxrl.runtime import compile_cache, host_memory

from jaxrl import config

from jaxrl.observe import metrics, profiling
from jaxrl.recipes.default import get_config
from jaxrl.data.sources import CheckedSource, RowProblem, TooManySkipped
from jaxrl.envs.base import Task
from jaxrl.models import ModelConfig
from fake_sources import ListSource  # tests/ is on sys.path


class Stream(ListSource):
  """A source that cannot list its training rows ahead (no train split)."""

  def split(self, name):
    if name == "train":
      raise KeyError(name)
    return super().split(name)


def _check(task):
  n = len(task.prompt)
  return RowProblem("too_long", f"{n} > 3", n) if n > 3 else None


def _rows(prompts, split="train"):
  return [Task("add", p, {}, f"{split}/{i}") for i, p in enumerate(prompts)]


def _hint(report):
  size, uid, _ = report.worst["too_long"]
  return f"longest {size} at {uid}"


def test_scan_counts_a_split_up_front_and_names_the_longest_row():
  # 3 of 4 train rows are over 3 characters; the longest, "abcdefg" (7), is row 2.
  src = ListSource(_rows(["ab", "abcd", "abcdefg", "abcde"]), _rows(["a", "b"], "val"))
  checked = CheckedSource(src, _check, max_skipped_frac=0.5, hint=_hint)
  report = checked.scan("train")
  assert (report.rows, report.skipped, report.worst["too_long"][:2]) == (
      4, {"too_long": 3}, (7, "train/2"))
  assert checked.skipped == {}  # a scan is not a skip event (data/skipped/* counts draws)
  error = checked.too_many(report)  # 75% > 50%
  assert isinstance(error, TooManySkipped) and str(error) == (
      "3 of 4 train rows (75%) would be skipped (too_long: 3), over data.max_skipped_frac=0.5: "
      "longest 7 at train/2; or set data.max_skipped_frac=1 to train on the rest")
  assert CheckedSource(src, _check, max_skipped_frac=0.75).too_many(report) is None  # not over
  checked.split("val")
  assert checked.note() == ("data: 3 of 4 train rows (75%) skipped (too_long: 3): longest 7 "
                            "at train/2")
  # A source that lists no train rows cannot be scanned; its draws are judged instead.
  assert CheckedSource(Stream(_rows(["ab"])), _check).scan("train") is None


def test_a_stream_stops_once_its_skipped_share_over_enough_draws_is_over_the_bar():
  # Half of the rows are too long: every draw of 8 good rows costs ~16 draws.
  src = Stream(_rows(["ab", "abcdef"]))
  checked = CheckedSource(src, _check, max_skipped_frac=0.3, min_draws=100, hint=_hint)
  rng = np.random.default_rng(0)
  checked.sample(rng, 8)  # under min_draws: no verdict yet
  assert 0 < checked.draws.rows < 100
  with pytest.raises(TooManySkipped, match=r"of \d+ training draws \(\d+%\) skipped "
                                           r"\(too_long: \d+\), over data.max_skipped_frac=0.3: "
                                           r"longest 6 at train/1"):
    for _ in range(20):
      checked.sample(rng, 8)
  assert checked.draws.rows >= 100 and checked.draws.frac > 0.3
  # A split that was scanned was judged up front: its draws never stop the run.
  listed = CheckedSource(ListSource(_rows(["ab", "abcdef"])), _check, max_skipped_frac=0.3,
                         min_draws=10)
  listed.scan("train")
  for _ in range(10):
    listed.sample(rng, 8)


def _train(args, cwd, log_compiles="1"):
  env = {**os.environ, "JAX_LOG_COMPILES": log_compiles}
  return subprocess.run([sys.executable, "-m", "jaxrl.train", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def _math_file(path, short, long):
  with open(path, "w") as f:
    for i in range(short):
      f.write(json.dumps({"question": f"{i}+1", "answer": f"#### {i + 1}"}) + "\n")
    for i in range(long):
      f.write(json.dumps({"question": f"What is {i} plus {i} in total?",
                          "answer": f"#### {2 * i}"}) + "\n")


def test_prompts_that_do_not_fit_stop_the_run_before_anything_is_created(tmp_path):
  # The user's case: a custom task whose prompts are mostly over rollout.max_prompt_len = 6.
  data = tmp_path / "data.jsonl"
  _math_file(data, short=4, long=16)  # "0+1" fits; "What is 15 plus 15 in total?" is 28 chars
  run_dir = tmp_path / "run"
  proc = _train(["--config.task.name=math", f"--config.task.path={data}",
                 "--config.sft.enabled=false", f"--config.run_dir={run_dir}"], tmp_path)
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out
  lines = [line for line in out.splitlines() if line.startswith("jaxrl: ")]
  assert len(lines) == 1, out  # one line, no traceback
  # 18 train rows (2 of 20 held out for val); the longest prompt is "What is 1x plus 1x in
  # total?", 28 characters = 28 tokens of the character tokenizer.
  assert "train rows" in lines[0] and "would be skipped (too_long: " in lines[0], out
  assert "over data.max_skipped_frac=0.1" in lines[0], out
  assert "the longest prompt has 28 tokens (row 'math/train/" in lines[0], out
  assert "over rollout.max_prompt_len=6" in lines[0], out
  assert "Traceback" not in out and "Compiling" not in out, out
  assert not run_dir.exists()


def test_chat_template_errors_name_the_config_keys(tmp_path):
  from jaxrl.data.hf_tokenizer import ChatTemplateError, HFTokenizer

  from hf_fixtures import llama_files  # tests/ is on sys.path

  path = llama_files(tmp_path / "base")
  cfg_path = os.path.join(path, "tokenizer_config.json")
  with open(cfg_path) as f:
    config = json.load(f)
  with open(cfg_path, "w") as f:  # a base model: no chat template anywhere
    json.dump({k: v for k, v in config.items() if k != "chat_template"}, f)
  with pytest.raises(ChatTemplateError) as info:
    HFTokenizer.from_dir(path, use_chat_template=True)
  assert "set tokenizer.chat_template=false" in str(info.value)
  assert "use_chat_template" not in str(info.value)  # an argument, not a key a user can set
  with pytest.raises(ChatTemplateError) as info:
    HFTokenizer.from_dir(path, use_chat_template=False, system_prompt="Be brief.")
  assert "tokenizer.system_prompt needs a chat template (tokenizer.chat_template is false)" in \
      str(info.value)


def test_math_grader_keeps_math_verify_quiet(caplog, capsys):
  math_verify = pytest.importorskip("math_verify")
  from jaxrl.envs.mathqa import MathEnvironment

  # math-verify warns once per process that its timeout is off (on any thread but the main
  # one); re-arm that warning so this test sees it whatever ran before.
  for module in (math_verify.parser, math_verify.grader):
    module.TIMEOUT_WARNING_SHOWN = False
  env = MathEnvironment(use_math_verify=True)
  got = []

  def grade():  # as the rollout worker does: off the main thread, so without a timeout
    got.extend(env.equal(g, p) for g, p in [("1024", "2^{10}"), ("2", "\\sqrt{4}"),
                                             ("5", "x+"), ("18", "42"), ("1024", "2^{10}")])

  with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG):
    warnings.simplefilter("always")
    worker = threading.Thread(target=grade)
    worker.start()
    worker.join()
  assert got == [True, True, False, False, True]
  assert caught == [] and caplog.records == []
  assert capsys.readouterr().err == ""
  # Only our calls are quiet: math-verify called directly still logs its warning.
  math_verify.parser.TIMEOUT_WARNING_SHOWN = False
  with caplog.at_level(logging.WARNING):
    worker = threading.Thread(target=lambda: math_verify.parse("1", parsing_timeout=None))
    worker.start()
    worker.join()
  assert any("Timeout is disabled" in r.getMessage() for r in caplog.records)


def test_integer_answers_the_fallback_rejects_skip_math_verify():
  # GSM8K's wrong answers are mostly integers: exact either way, so no symbolic parse; a
  # percent or a decimal still goes to math-verify (50% is 1/2 there, not here).
  from jaxrl.envs.mathqa import both_integers

  assert both_integers("18", "42") and both_integers("-3", "1,000")
  assert not both_integers("1/2", "50%") and not both_integers("12", "12.5")
  assert not both_integers("1", "1" * 16)  # past float64's exact integers


ROW = {"reward": 0.25, "perf/step_time_s": 0.5, "perf/gen_tokens_per_s": 1234.4,
       "train/skipped_updates": 0}


def test_progress_line_leaves_out_validation_that_did_not_run():
  assert metrics.rl_progress_text(ROW) == "reward 0.250 | 0.50 s/step | gen 1234 tok/s"
  assert metrics.rl_progress_text(ROW, float("nan")) == metrics.rl_progress_text(ROW)
  assert metrics.rl_progress_text({**ROW, "train/skipped_updates": 2}, 0.5, 7) == (
      "reward 0.250 | val 0.500 | 0.50 s/step | gen 1234 tok/s | 2 skipped | 7 prompts skipped")
  assert metrics.rl_progress_text(ROW, skipped_prompts=1).endswith(" | 1 prompt skipped")


def test_summary_says_what_validation_measured():
  s = {"rl/steps": 4, "val/accuracy_before_rl": 0.25, "val/accuracy_after_rl": 0.5}
  assert metrics.accuracy_summary(s) == (
      "held-out accuracy: 0.250 before RL -> 0.500 after 4 RL steps (+0.250)")
  nan = float("nan")
  assert metrics.accuracy_summary({**s, "val/accuracy_before_rl": nan}) == (
      "held-out accuracy: 0.500 after RL (no pass before it: val.at_start=false)")
  off = metrics.accuracy_summary({**s, "val/accuracy_before_rl": nan,
                                  "val/accuracy_after_rl": nan})
  assert "validation was off" in off and "nan" not in off


def test_gen_tokens_per_s_is_over_generation_time_not_the_step():
  cfg = get_config()
  mesh = types.SimpleNamespace(devices=np.array(jax.devices()[:1]))
  parts = types.SimpleNamespace(cfg=cfg, model_cfg=ModelConfig(16, 32, 2, 4, 2, 16, 64),
                                mesh=mesh)
  perf = profiling.StepPerf(parts, {"w": np.zeros(3)})
  perf.begin(1)
  perf.lap("train")
  # 3 rows of 4 + 6 + 2 = 12 completion tokens generated in 0.25 s: 48 tok/s, whatever the
  # trainer's step took (with lag > 0 generation overlaps training).
  item = types.SimpleNamespace(meta=types.SimpleNamespace(lengths=np.array([4, 6, 2])),
                               sample_time_s=0.25)
  m = perf.metrics(item)
  assert m["perf/gen_tokens_per_s"] == pytest.approx(48.0)
  assert m["perf/rollout_s"] == 0.25
  perf.close()


@pytest.mark.slow  # a whole tiny run through the CLI (~40 s on 2 busy cores)
def test_a_run_with_validation_off_prints_no_nan(tmp_path):
  run_dir = tmp_path / "run"
  proc = _train(["--config.model.d_model=32", "--config.model.head_dim=16",
                 "--config.model.mlp_dim=64", "--config.sft.enabled=false",
                 "--config.train.steps=3", "--config.log_every=1", "--config.val.every=100",
                 "--config.val.at_start=false", "--config.val.at_end=false",
                 "--config.task.dev_size=64", "--config.task.val_size=64",
                 "--config.val.batch_size=64", "--config.rollout.num_prompts=4",
                 f"--config.run_dir={run_dir}"], tmp_path, log_compiles="0")
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  progress = [line for line in proc.stdout.splitlines() if "s/step" in line]
  assert len(progress) == 3 and all("gen " in line and " tok/s" in line for line in progress), out
  assert "nan" not in proc.stdout and " val " not in proc.stdout, out
  assert "held-out accuracy: not measured (validation was off" in proc.stdout, out


def test_a_user_error_on_the_rollout_thread_is_one_line():
  from jaxrl.cli import train
  from jaxrl.pipeline import WorkerFailed

  failed = WorkerFailed("rollout worker failed: TooManySkipped: ...\n--- worker traceback ---\n")
  failed.__cause__ = TooManySkipped("300 of 512 training draws (59%) skipped (too_long: 300)")
  assert train.user_message(failed) == (
      "jaxrl: 300 of 512 training draws (59%) skipped (too_long: 300)")
  bug = WorkerFailed("rollout worker failed: KeyError")
  bug.__cause__ = KeyError("bug")
  assert train.user_message(bug) is None  # a bug keeps its traceback


class _HalfTooLong:
  """The `add` rows as a stream (no train split to scan): every 2nd draw's prompt is tripled,
  over rollout.max_prompt_len."""

  def __init__(self, source):
    self.source, self.name, self.alphabet, self.n = source, source.name, source.alphabet, 0

  def split(self, name):
    if name == "train":
      raise KeyError(name)
    return self.source.split(name)

  def sample(self, rng, n):
    out = []
    for t in self.source.sample(rng, n):
      self.n += 1
      out.append(Task(t.env, t.prompt * 3, t.data, t.uid + "-long") if self.n % 2 else t)
    return out


@pytest.mark.slow  # RL steps of 64 prompts (~30 s on 2 busy cores)
def test_a_stream_that_skips_too_much_stops_training(tmp_path):
  import io

  from jaxrl import config as config_lib

  from jaxrl.run import loop
  from jaxrl.run import parts as parts_lib
  from jaxrl.run.topology import Topology

  from jaxrl.cli import train

  cfg = get_config()
  cfg.model.d_model, cfg.model.head_dim, cfg.model.mlp_dim = 32, 16, 64
  cfg.sft.enabled = False
  cfg.train.steps, cfg.rollout.num_prompts = 5, 64  # ~128 draws a batch: over 256 at batch 2
  cfg.val.at_start = cfg.val.at_end = False
  cfg.val.every = 100
  cfg.task.dev_size = cfg.task.val_size = cfg.val.batch_size = 16
  parts, params = parts_lib.build_parts(cfg, config_lib.validate(cfg, jax.device_count()),
                                        source=_HalfTooLong(parts_lib.task_source(cfg)))
  assert parts.source.scanned.get("train") is None and parts.source.note() is None
  out = metrics.MetricsWriter(str(tmp_path))
  with pytest.raises(Exception) as info:
    loop.rl(parts, params, Topology.of(parts), loop.RunIO(out, metrics.Progress(stream=io.StringIO())))
  out.close()
  message = train.user_message(info.value)
  assert message is not None and "\n" not in message, info.value
  assert message.startswith("jaxrl: ") and "training draws" in message, message
  assert "over data.max_skipped_frac=0.1: the longest prompt has 18 tokens" in message, message
  assert "over rollout.max_prompt_len=6" in message
  assert len([r for r in out.rows if r["phase"] == "rl"]) < cfg.train.steps


# --- the persistent compilation cache (jaxrl.runtime.compile_cache) --------------------------------------

def test_compile_cache_directory_is_resolved_from_the_setting():

  assert compile_cache.resolve("") is None  # off
  assert compile_cache.resolve("auto", {"JAX_COMPILATION_CACHE_DIR": "/ci/xla"}) == "/ci/xla"
  assert compile_cache.resolve("auto", {"XDG_CACHE_HOME": "/xdg"}) == "/xdg/jaxrl/xla"
  home = os.path.expanduser("~")
  assert compile_cache.resolve("auto", {}) == os.path.join(home, ".cache", "jaxrl", "xla")
  assert compile_cache.resolve("~/c", {}) == os.path.join(home, "c")


_COMPILE_ONE = """
import sys, warnings
warnings.simplefilter("error")
import jax, jax.numpy as jnp
from jaxrl.runtime import compile_cache
setting = sys.argv[1]
if setting != "-":
  compile_cache.enable(setting)
else:  # a plain JAX program on $JAX_COMPILATION_CACHE_DIR: JAX's own defaults, no eviction
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
print(float(jax.jit(lambda x: jnp.sin(x) * float(sys.argv[2]))(1.0)))
"""


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_a_cache_directory_another_jax_program_writes_to_stays_usable(tmp_path):
  # JAX's eviction (a max size) reads an access-time file per entry that a writer without eviction
  # never makes: with eviction on beside such entries, every write warned and cached nothing.
  shared = tmp_path / "xla"
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(shared), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": ""}

  def compile_one(setting, k, **extra):
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ONE, setting, str(k)],
                          env={**env, **extra}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Error writing persistent compilation cache" not in proc.stderr, proc.stderr[-2000:]
    return {p.name for p in shared.iterdir()}

  plain = compile_one("-", 2)  # an entry without an access-time file
  assert plain and not any(n.endswith("-atime") for n in plain)
  compile_one("auto", 3)  # jaxrl on JAX's directory: JAX's size policy
  assert compile_cache.from_environment("auto", env)
  assert not compile_cache.from_environment(str(shared), env)
  after = compile_one(str(shared), 4)  # jaxrl's own policy (eviction) on that same directory
  entries = {n[: -len("-cache")] for n in after if n.endswith("-cache")}
  assert len(entries) >= 3 and {f"{e}-atime" for e in entries} <= after


def test_an_unusable_compile_cache_directory_is_a_config_error(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  cfg = get_config()
  cfg.compile_cache = str(a_file / "cache")
  with pytest.raises(config.ConfigError) as info:
    config.validate(cfg, 8)
  (problem,) = [p for p in info.value.problems if "compile_cache" in p]
  assert f"{a_file} is not a directory" in problem, problem
  cfg.compile_cache = str(tmp_path / "new" / "cache")  # created when the run starts
  config.validate(cfg, 8)
  assert not (tmp_path / "new").exists()  # validation creates nothing


def test_cpu_opt_level_goes_into_xla_flags_unless_they_name_one():
  flag = compile_cache.OPT_LEVEL_FLAG
  assert compile_cache.xla_flags_with_opt_level("", 1) == f"{flag}=1"
  assert (compile_cache.xla_flags_with_opt_level("--xla_cpu_max_isa=AVX2", 2)
          == f"--xla_cpu_max_isa=AVX2 {flag}=2")
  assert compile_cache.xla_flags_with_opt_level(f"{flag}=3", 1) is None  # the user's wins
  assert compile_cache.xla_flags_with_opt_level("", -1) is None  # XLA's default
  # Only where JAX can run on nothing but the CPU: an explicit platform list decides.
  assert compile_cache.cpu_only({"JAX_PLATFORMS": "cpu"})
  assert not compile_cache.cpu_only({"JAX_PLATFORMS": "cuda,cpu"})
  assert not compile_cache.cpu_only({"JAX_PLATFORMS": "tpu"})


def test_cpu_opt_level_is_range_checked():
  cfg = get_config()
  assert cfg.xla_cpu_opt_level == 1
  cfg.xla_cpu_opt_level = 4
  with pytest.raises(config.ConfigError) as info:
    config.validate(cfg, 8)
  assert any("config.xla_cpu_opt_level" in p and "[-1, 3]" in p for p in info.value.problems), \
      info.value.problems


def test_cpu_fusion_emitters_off_goes_into_xla_flags_unless_they_name_it():
  flag = compile_cache.FUSION_EMITTERS_FLAG
  assert compile_cache.xla_flags_with_fusion_emitters("", False) == f"{flag}=false"
  assert (compile_cache.xla_flags_with_fusion_emitters("--xla_cpu_max_isa=AVX2", False)
          == f"--xla_cpu_max_isa=AVX2 {flag}=false")
  assert compile_cache.xla_flags_with_fusion_emitters(f"{flag}=true", False) is None  # user's
  assert compile_cache.xla_flags_with_fusion_emitters("", True) is None  # XLA's default
  assert get_config().xla_cpu_fusion_emitters is False
  # Set only where the installed XLA defines the flag (it aborts on one it does not know).
  assert compile_cache.xla_knows_flag(compile_cache.OPT_LEVEL_FLAG)
  assert compile_cache.xla_knows_flag(flag)  # jaxlib 0.10's XLA has it
  assert not compile_cache.xla_knows_flag("--xla_cpu_no_such_flag_anywhere")
  assert not compile_cache.xla_knows_flag("--xla_cpu_use_fusion")  # a prefix is not the flag


def test_process_keys_are_bools_from_the_command_line():
  cfg = config.parse_overrides(get_config(), ["--config.xla_cpu_fusion_emitters=true",
                                              "--config.host_malloc_tuning=0"])
  assert cfg.xla_cpu_fusion_emitters is True and cfg.host_malloc_tuning is False
  with pytest.raises(config.ConfigError) as info:
    config.parse_overrides(get_config(), ["--config.xla_cpu_fusion_emitters=off"])
  assert any("xla_cpu_fusion_emitters" in p and "expected bool" in p
             for p in info.value.problems), info.value.problems


def test_host_malloc_tuning_yields_to_the_users_settings():
  assert get_config().host_malloc_tuning is True
  for env in ({"MALLOC_MMAP_THRESHOLD_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
              {"MALLOC_TOP_PAD_": "1"}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
    assert host_memory.user_tuned(env)
    assert host_memory.keep_freed(env=env) is False  # nothing set: the user's settings stand
  assert not host_memory.user_tuned({"GLIBC_TUNABLES": "glibc.rtld.nns=2"})
  # On glibc the thresholds are set (mallopt accepted both); elsewhere nothing happens.
  import ctypes
  try:
    glibc = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
  except OSError:
    glibc = False
  assert host_memory.keep_freed(env={}) is (glibc and sys.platform.startswith("linux"))


@pytest.mark.slow  # two whole tiny runs through the CLI (~60 s on 2 busy cores)
def test_a_second_run_loads_every_program_from_the_compile_cache(tmp_path):
  cache = tmp_path / "xla"
  args = ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
          "--config.sft.max_steps=10", "--config.train.steps=3", "--config.val.every=100",
          "--config.task.dev_size=64", "--config.task.val_size=64", "--config.val.batch_size=64",
          "--config.rollout.num_prompts=4", f"--config.compile_cache={cache}"]
  entries = []
  for i in range(2):
    proc = _train([*args, f"--config.run_dir={tmp_path / f'run{i}'}"], tmp_path,
                  log_compiles="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first RL step done" in proc.stdout and str(cache) in proc.stdout, proc.stdout
    with open(tmp_path / f"run{i}" / "summary.json") as f:
      assert json.load(f)["perf/first_rl_step_s"] > 0
    entries.append(sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache")))
  assert len(entries[0]) > 10  # every program of the run, however small
  assert entries[1] == entries[0]  # the second run found every one of them: nothing new


def test_adam_eps_reaches_the_optimizer():
  # One AdamW update of a parameter whose gradient is g: m = (1 - b1) g, v = (1 - b2) g^2, with
  # bias correction the step is lr * g / (|g| + eps). For g = 1e-6, lr = 1: eps 1e-8 moves it
  # by 0.990, eps 1e-6 by 0.5.
  from jaxrl.learner.step import make_optimizer

  for eps, want in ((1e-8, 1e-6 / (1e-6 + 1e-8)), (1e-6, 0.5)):
    opt = make_optimizer(1.0, eps=eps, grad_clip=1e9)
    params = {"w": jax.numpy.zeros(())}
    updates, _ = opt.update({"w": jax.numpy.asarray(1e-6)}, opt.init(params), params)
    np.testing.assert_allclose(float(updates["w"]), -want, rtol=1e-5)
