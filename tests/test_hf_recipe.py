"""The real-model recipes (`configs/qwen2_5_0_5b_gsm8k.py`, `configs/llama3_2_1b_gsm8k.py`) end to
end on tiny random checkpoints.

A Qwen2-architecture model (q/k/v bias, tied embeddings) or a Llama one (untied, Llama-3 rope
scaling), with scanned layers, is initialised at random and written in Hugging Face format with
`save_hf`, next to a byte-level BPE tokenizer with the family's real chat template and two EOS
ids, plus a 16-row GSM8K-format JSONL. The recipe, with
only its sizes overridden, runs 3 GRPO steps at its own lag of 1 on an 8-device fsdp mesh; then
`python -m jaxrl.export` writes the last checkpoint back in Hugging Face format.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from hf_fixtures import llama_files, qwen_files  # noqa: E402  (tests/ is on sys.path)
from jaxrl import config as config_lib  # noqa: E402
from jaxrl.cli import export
from jaxrl.run import driver
from jaxrl.recipes import (llama3_2_1b_gsm8k, llama3_2_1b_gsm8k_lora,  # noqa: E402
                           qwen2_5_0_5b_gsm8k, qwen2_5_0_5b_gsm8k_lora, qwen2_5_7b_gsm8k)
from jaxrl.data.hf_tokenizer import HFTokenizer  # noqa: E402
from jaxrl.run.parts import build_parts, make_tokenizer  # noqa: E402
from jaxrl.models import ModelConfig, init_model  # noqa: E402
from jaxrl.models.hf_checkpoint import load_hf, save_hf  # noqa: E402

QUESTIONS = [(f"Tom has {a} apples and buys {b} more. How many apples does he have?",
              f"He has {a} + {b} = {a + b} apples.\n#### {a + b}") for a, b in
             [(3, 4), (10, 5), (7, 8), (12, 30), (2, 2), (9, 1), (6, 6), (20, 22), (5, 3),
              (11, 11), (4, 9), (8, 8), (13, 2), (1, 1), (15, 5), (30, 12)]]


# family -> (recipe, tokenizer files, architecture, model fields, first token of every prompt)
FAMILIES = {
  "qwen2": (qwen2_5_0_5b_gsm8k, qwen_files, "Qwen2ForCausalLM",
            dict(rope_theta=1e6, qkv_bias=True, tie_embeddings=True), "<|im_start|>"),
  "llama3": (llama3_2_1b_gsm8k, llama_files, "LlamaForCausalLM",
             dict(rope_theta=5e5, rope_scaling="llama3", rope_factor=8.0,
                  rope_original_max_positions=64), "<|begin_of_text|>"),
}


def _model_dir(tmp_path, family="qwen2") -> tuple[str, ModelConfig]:
  _, files, arch, fields, _ = FAMILIES[family]
  path = files(tmp_path / f"tiny-{family}")
  vocab = HFTokenizer.from_dir(path).vocab_size
  cfg = ModelConfig(vocab_size=vocab + 13, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, scan_layers=True, **fields)
  _, params = init_model(cfg, seed=0)
  save_hf(path, cfg, params, architecture=arch)
  return path, cfg


def _jsonl(tmp_path) -> str:
  path = tmp_path / "gsm8k.jsonl"
  path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
  return str(path)


def _recipe(model_dir, data, run_dir, family="qwen2"):
  cfg = FAMILIES[family][0].get_config()
  problems: list[str] = []
  cfg = config_lib.parse_overrides(cfg, [
      f"--config.model.hf_path={model_dir}", f"--config.task.path={data}",
      "--config.task.val_path=", f"--config.run_dir={run_dir}", "--config.model.dtype=float32",
      "--config.rollout.num_prompts=2", "--config.rollout.group_size=4",
      "--config.rollout.max_new_tokens=12", "--config.train.microbatch_tokens=512",
      "--config.train.steps=3", "--config.train.learning_rate=1e-3", "--config.val.every=3",
      "--config.val.batch_size=8", "--config.checkpoint.every=3",
      "--config.checkpoint.async_save=false",
      # A random model never answers GSM8K, so every reward is 0 and every advantage too; an
      # entropy bonus gives the 3 updates a gradient to show up in the exported weights.
      "--config.loss.entropy_coef=0.01"], problems)
  assert not problems, problems
  return cfg


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recipe_runs_three_grpo_steps_and_exports(tmp_path, family):
  model_dir, model_cfg = _model_dir(tmp_path, family)
  run_dir = tmp_path / "run"
  cfg = _recipe(model_dir, _jsonl(tmp_path), run_dir, family)
  mesh = config_lib.validate(cfg, jax.device_count())
  assert (mesh.data, mesh.fsdp, mesh.tensor) == (1, 8, 1)
  summary = driver.run(cfg, str(run_dir), mesh)

  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) for r in rl)
  # The recipe's own lag of 1: step 1 trains on rollouts made before any update.
  assert [r["staleness/first_token/max"] for r in rl] == [0, 1, 1]
  # Prompts go through the chat template, with the model's two EOS ids.
  tok = make_tokenizer(cfg, source=None)
  start_id = tok.encode(FAMILIES[family][4], add_special_tokens=False)
  assert tok.encode_prompt("Q")[:len(start_id)] == start_id and len(tok.eos_ids) == 2
  assert sorted(r["step"] for r in rows if r["phase"] == "val") == [0, 3]
  assert summary["rl/steps"] == 3

  out_dir = tmp_path / "exported"
  assert export.main(["--run", str(run_dir), "--out", str(out_dir)]) == 0
  # The exported weights are the trained ones: they moved away from the starting checkpoint.
  _, _, start = load_hf(model_dir)
  cfg2, _, trained = load_hf(str(out_dir))
  assert cfg2 == model_cfg.__class__(**{**model_cfg.__dict__, "scan_layers": False})
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) -
                                                                   np.asarray(b)).max()),
                                       start, trained))
  assert max(diffs) > 1e-4
  # ... and exactly the checkpoint's.
  from jaxrl.runtime import checkpoint
  reader = checkpoint.Checkpointer(checkpoint.checkpoint_dir(str(run_dir)), read_only=True)
  step, saved = reader.restore_params(None, trained)
  reader.close()
  assert step == 3
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               saved, trained)
  # Everything but the weights is the starting model's, tokenizer and chat template included.
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert (out_dir / name).read_bytes() == open(os.path.join(model_dir, name), "rb").read()
  assert HFTokenizer.from_dir(str(out_dir)).eos_ids == HFTokenizer.from_dir(model_dir).eos_ids


def test_recipes_name_missing_files_before_building_anything(tmp_path):
  for recipe in (qwen2_5_0_5b_gsm8k, llama3_2_1b_gsm8k, qwen2_5_0_5b_gsm8k_lora,
                 llama3_2_1b_gsm8k_lora, qwen2_5_7b_gsm8k):
    cfg = recipe.get_config()
    cfg.model.hf_path = str(tmp_path / "no-model")
    cfg.task.path = str(tmp_path / "no-train.jsonl")
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.validate(cfg, 8)
    text = str(e.value)
    assert "config.model.hf_path: no directory" in text and "no-model" in text
    assert "config.task.path: no file" in text
    assert "config.task.val_path: no file" in text  # data/gsm8k/test.jsonl is not here


def test_hf_path_rejects_architecture_keys_and_warmup(tmp_path):
  model_dir, _ = _model_dir(tmp_path)
  cfg = _recipe(model_dir, _jsonl(tmp_path), tmp_path / "run")
  cfg.model.num_layers = 4
  cfg.sft.enabled = True
  cfg.task.name = "add"
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert [p.split(":")[0] for p in e.value.problems] == ["config.model.num_layers",
                                                         "config.sft.enabled"]
  assert "character-tokenizer ids" in e.value.problems[1]


def test_broken_model_directory_is_a_config_error_naming_the_file(tmp_path):
  from safetensors.numpy import load_file, save_file

  model_dir, _ = _model_dir(tmp_path)
  cfg = _recipe(model_dir, _jsonl(tmp_path), tmp_path / "run")
  mesh = config_lib.validate(cfg, jax.device_count())
  weights = os.path.join(model_dir, "model.safetensors")
  tensors = load_file(weights)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, weights)
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.hf_path: .*model\.safetensors: "
                     r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
    build_parts(cfg, mesh)

  path = os.path.join(model_dir, "tokenizer_config.json")
  with open(path) as f:
    tok_cfg = json.load(f)
  tok_cfg["eos_token"] = "<|no-such-token|>"
  with open(path, "w") as f:
    json.dump(tok_cfg, f)
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.hf_path: .*tokenizer_config"):
    build_parts(cfg, mesh)


@pytest.mark.slow
def test_a_hugging_face_teacher_distils_and_a_foreign_one_is_refused(tmp_path):
  # The teacher is the student's own starting checkpoint: before the first update the two
  # score every sampled token alike, so the first step's sampled reverse KL is 0.
  model_dir, _ = _model_dir(tmp_path, "qwen2")
  run_dir = tmp_path / "run"
  cfg = _recipe(model_dir, _jsonl(tmp_path), run_dir)
  cfg.distill.teacher = model_dir
  cfg.distill.reward_weight = 1.0
  cfg.train.steps = 2
  cfg.val.every, cfg.checkpoint.every = 2, 2
  mesh = config_lib.validate(cfg, jax.device_count())
  driver.run(cfg, str(run_dir), mesh)
  rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["phase"] == "rl"]
  assert len(rl) == 2 and all(np.isfinite(r["distill/reverse_kl"]) for r in rl)
  assert abs(rl[0]["distill/reverse_kl"]) < 1e-4, rl[0]["distill/reverse_kl"]

  # A Llama-family teacher has another tokenizer and vocabulary: refused by name.
  llama_dir, _ = _model_dir(tmp_path, "llama3")
  cfg.distill.teacher = llama_dir
  with pytest.raises(config_lib.ConfigError) as e:
    build_parts(cfg, config_lib.validate(cfg, jax.device_count()))
  assert "config.distill.teacher" in str(e.value) and "vocabulary" in str(e.value)
