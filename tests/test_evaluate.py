"""`python -m jaxrl.evaluate`: a checkpoint evaluated afterwards scores exactly what the run's own
validation logged for it (the same pass on the same params); user errors are one line
`jaxrl: ...`, exit status 1, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxrl import config as config_lib
from jaxrl import recipes
from jaxrl.cli import evaluate
from jaxrl.run import driver
from jaxrl.recipes.default import get_config

from test_profiling import tiny_cfg


def _fails(capsys, argv) -> str:
  """The error line of `python -m jaxrl.evaluate argv` run in-process (exit status 1)."""
  assert evaluate.main(argv) == 1
  err = capsys.readouterr().err
  assert err.startswith("jaxrl: ") and "Traceback" not in err, err
  return err.strip()


def test_not_a_run_directory_is_one_line_without_traceback(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "jaxrl.evaluate", "--run", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"jaxrl: {tmp_path}/config.json is missing: {str(tmp_path)!r} is not a jaxrl run "
      "directory"], proc.stderr


def test_a_run_without_checkpoints(tmp_path, capsys):
  (tmp_path / "config.json").write_text(json.dumps(get_config().to_dict()))
  assert _fails(capsys, ["--run", str(tmp_path)]) == (
      f"jaxrl: no checkpoint in {tmp_path}/checkpoints (a run saves one every checkpoint.every "
      "steps and at its end)")


def test_bad_task_samples_and_keys_are_named_before_building_anything(tmp_path, capsys):
  hf = ["--hf", str(tmp_path)]
  err = _fails(capsys, [*hf, "--task", "add+nope"])
  assert err.startswith("jaxrl: unknown task 'nope'; registered tasks: ") and "add" in err
  assert _fails(capsys, [*hf, "--samples", "4"]) == (
      "jaxrl: 4 samples per prompt need a temperature > 0 (greedy samples of one prompt are all "
      "the same); pass --temperature")
  err = _fails(capsys, [*hf, "--config.val.bach_size=3"])
  assert "config.val.bach_size: unknown key; did you mean config.val.batch_size?" in err


@pytest.mark.slow  # a tiny run with a warm-up, then two evaluations: ~3 min on 2 busy cores
def test_evaluating_a_checkpoint_reproduces_the_runs_validation(tmp_path, capsys):
  run_dir = tmp_path / "run"
  # One-digit addition with a short warm-up at a high rate: enough for a non-zero held-out
  # accuracy (about 0.3), so matching it is not 0 == 0.
  cfg = tiny_cfg(run_dir, task__num_digits=1, sft__enabled=True, sft__max_steps=150,
                 sft__eval_every=25, sft__learning_rate=1e-2, sft__stop_accuracy=0.2,
                 train__steps=2, val__every=1, checkpoint__every=1)
  driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()))
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  val = {r["step"]: r for r in rows if r["phase"] == "val"}
  assert sorted(val) == [1, 2]
  assert not (run_dir / "profile").exists()  # profile.steps = "": no trace
  assert all(r["perf/mfu"] is None for r in rows if r["phase"] == "rl")  # CPU: peak unknown
  capsys.readouterr()

  # The latest checkpoint (step 2), results at the default path.
  assert evaluate.main(["--run", str(run_dir)]) == 0
  out = capsys.readouterr().out
  assert "task  prompts  accuracy    pass@1   avg_len" in out, out
  got = json.loads((run_dir / "eval-2-add-val.json").read_text())
  assert got["step"] == 2 and got["prompts"] == 16 and got["task"] == "add"
  assert got["accuracy"] > 0
  # Exactly the run's own numbers (val/time_s is wall time).
  assert got["accuracy"] == val[2]["val/accuracy"]
  assert got["pass@1"] == val[2]["val/pass@1"]
  assert got["avg_length"] == val[2]["val/avg_length"]
  assert {k: v for k, v in got["metrics"].items() if k != "val/time_s"} == \
      {k: v for k, v in val[2].items() if k.startswith("val/") and k not in
       ("val/time_s", "val/trainer_wait_s")}
  assert got["per_task"] == {"add": {k: got[k] for k in
                                     ("prompts", "accuracy", "pass@1", "avg_length")}}

  # Errors that need the run: a step it did not save, a split the task does not have.
  assert _fails(capsys, ["--run", str(run_dir), "--step", "99"]) == (
      f"jaxrl: no checkpoint of step 99 in {run_dir}/checkpoints (steps: [1, 2])")
  err = _fails(capsys, ["--run", str(run_dir), "--split", "nope"])
  assert err.startswith("jaxrl: no split 'nope': source 'add' has no split 'nope'; known: ")

  # An older step, written where --out says: its own row's numbers.
  out_file = tmp_path / "sub" / "step1.json"
  assert evaluate.main(["--run", str(run_dir), "--step", "1", "--out", str(out_file)]) == 0
  got1 = json.loads(out_file.read_text())
  assert got1["step"] == 1 and got1["accuracy"] == val[1]["val/accuracy"]
  assert os.path.exists(out_file)


@pytest.mark.slow  # builds and compiles a (tiny) Hugging Face model: ~30 s on 2 busy cores
def test_a_hugging_face_directory_on_another_split_with_pass_at_k(tmp_path):
  pytest.importorskip("safetensors")
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from hf_fixtures import qwen_files
  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.models import ModelConfig, init_model
  from jaxrl.models.hf_checkpoint import save_hf

  path = qwen_files(tmp_path / "tiny")
  model = ModelConfig(vocab_size=HFTokenizer.from_dir(path).vocab_size + 13, d_model=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                      rope_theta=1e6, qkv_bias=True, tie_embeddings=True)
  save_hf(path, model, init_model(model, seed=0)[1], architecture="Qwen2ForCausalLM")
  data = tmp_path / "qa.jsonl"
  data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"})
                          + "\n" for a in range(4) for b in range(5)))
  out = tmp_path / "eval.json"
  recipe = os.path.join(os.path.dirname(recipes.__file__), "qwen2_5_0_5b_gsm8k.py")
  assert evaluate.main([
      "--hf", path, "--config", recipe, "--task", "math", "--split", "train", "--samples", "2",
      "--temperature", "1.0", "--batch_size", "8", "--out", str(out),
      f"--config.task.path={data}", "--config.task.val_path=", "--config.model.dtype=float32",
      "--config.rollout.max_new_tokens=8"]) == 0
  got = json.loads(out.read_text())
  # 20 rows, a seeded 10% held out for val: 18 train prompts, 2 samples each; a random model
  # never writes "#### <answer>", and every sample runs to the 8-token budget.
  assert (got["hf"], got["split"], got["prompts"]) == (os.path.abspath(path), "train", 18)
  assert (got["accuracy"], got["pass@2"], got["avg_length"]) == (0.0, 0.0, 8.0)
