"""A LoRA run out to Hugging Face: `python -m jaxrl.export --adapter` (a PEFT adapter directory),
`--merged` and a plain export (the base with the adapters folded in), and what export refuses.

Most tests build a LoRA run directory through public APIs, with no training: a tiny random
Qwen2 or Llama checkpoint in Hugging Face format (`save_hf`, or `transformers` itself for the
parity tests), a run config from the LoRA recipe, `hf_base/` as the trainer writes it, and one
checkpoint whose train state holds random adapters with non-zero B (`params`) on a frozen base
(`frozen`), as a LoRA run saves it. The parity tests (the `parity` extra: torch, transformers,
peft) load the adapter with `peft.PeftModel.from_pretrained` onto the `transformers` model and
the merged export with `AutoModelForCausalLM`, and compare logits with jaxrl's LoRA model. A slow
test exports a real 3-step run of the LoRA recipe.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")

from jaxrl.runtime import checkpoint  # noqa: E402

from jaxrl import config as config_lib

from jaxrl.cli import export
from jaxrl.recipes import llama3_2_1b_gsm8k_lora, qwen2_5_0_5b_gsm8k_lora  # noqa: E402
from jaxrl.models import ModelConfig, abstract_model  # noqa: E402
from jaxrl.models import lora as lora_lib  # noqa: E402
from jaxrl.models.hf_checkpoint import load_hf, save_hf  # noqa: E402
from jaxrl.core.types import TrainState  # noqa: E402

RANK, ALPHA = 4, 8.0
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# LoRA target -> Hugging Face module of layer i, PEFT's target module name.
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
# family -> (LoRA recipe, architecture, jaxrl model fields, transformers config fields)
FAMILIES = {
  "qwen2": (qwen2_5_0_5b_gsm8k_lora, "Qwen2ForCausalLM",
            dict(rope_theta=1e6, qkv_bias=True, tie_embeddings=True),
            ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6))),
  "llama": (llama3_2_1b_gsm8k_lora, "LlamaForCausalLM", dict(rope_theta=5e5),
            ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=5e5))),
}
DIMS = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96)
VOCAB = 97
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 11)).astype(np.int32)


def _numpy_like(abstract, seed: int, fill):
  """Arrays of `abstract`'s shapes and dtypes, `fill(name, rng, shape)` each (numpy: no compile)."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray(fill(jax.tree_util.keystr(path), rng, x.shape), x.dtype),
      abstract)


def _jaxrl_model_dir(path, family: str) -> str:
  """A tiny random checkpoint of `family` in Hugging Face format, written by jaxrl."""
  _, arch, fields, _ = FAMILIES[family]
  cfg = ModelConfig(vocab_size=VOCAB, **DIMS, **fields)
  params = _numpy_like(abstract_model(cfg)[1], 1, lambda name, rng, shape: (
      1 + 0.1 * rng.standard_normal(shape) if "norm" in name else
      0.1 * rng.standard_normal(shape)))
  save_hf(str(path), cfg, params, architecture=arch)
  return str(path)


def _torch_model_dir(path, family: str, seed: int = 0):
  """A tiny random `transformers` model of `family` (norms and biases perturbed) and the
  directory it is saved in."""
  from hf_fixtures import random_hf_model  # tests/ is on sys.path

  _, arch, _, (config_cls, extra) = FAMILIES[family]
  model = random_hf_model(config_cls, arch, seed, hidden_size=DIMS["d_model"],
                          num_hidden_layers=DIMS["num_layers"],
                          num_attention_heads=DIMS["num_heads"],
                          num_key_value_heads=DIMS["num_kv_heads"],
                          intermediate_size=DIMS["mlp_dim"], vocab_size=VOCAB, rms_norm_eps=1e-6,
                          **extra)
  model.save_pretrained(str(path), safe_serialization=True)
  return model, str(path)


def _run_config(family: str, model_dir: str, rank: int = RANK, **lora):
  cfg = FAMILIES[family][0].get_config()
  cfg.model.hf_path = model_dir
  cfg.model.dtype = "float32"
  cfg.model.lora.rank = rank
  cfg.model.lora.alpha = ALPHA
  for k, v in lora.items():
    setattr(cfg.model.lora, k, v)
  return cfg


def _random_adapters(lora_cfg: ModelConfig, seed: int) -> nnx.State:
  """Adapters of `lora_cfg` with A and B random: they change the model's output as trained ones
  do (B is zero at init)."""
  return _numpy_like(lora_lib.abstract_adapters(lora_cfg), seed, lambda name, rng, shape: (
      rng.uniform(-1, 1, shape) / np.sqrt(shape[-2]) if "lora_a" in name else
      0.2 * rng.standard_normal(shape)))


def _write_run(run_dir, cfg, base, adapters, *, step: int = 3, warmup_steps: int = 0) -> str:
  """A run directory as a run of `cfg` leaves it (config.json, hf_base/, one checkpoint of
  `step`), its train state holding `adapters` on the frozen `base` (None: no LoRA, `base` is
  the trained model)."""
  run_dir = str(run_dir)
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(cfg), f, indent=2)
  export.copy_metadata(cfg.model.hf_path, os.path.join(run_dir, export.METADATA_DIR))
  state = TrainState(params=base if adapters is None else adapters, opt_state={},
                     step=jnp.int32(step), frozen=None if adapters is None else base)
  with checkpoint.Checkpointer(checkpoint.checkpoint_dir(run_dir), async_save=False) as ckpt:
    ckpt.save(step, {"train": state}, {"step": step, "warmup": {"sft/steps": warmup_steps}})
  return run_dir


def _lora_run(tmp_path, family: str, model_dir: str, *, seed: int = 0, **kw):
  """(run_dir, run config, LoRA model config, base params, adapters) of a LoRA run of `family`
  on the model in `model_dir`."""
  cfg = _run_config(family, model_dir, **{k: kw.pop(k) for k in ("dropout", "targets")
                                          if k in kw})
  model_cfg, _, base = load_hf(model_dir, param_dtype="float32")
  lora_cfg = lora_lib.with_lora(model_cfg, cfg.model.lora)
  adapters = _random_adapters(lora_cfg, seed)
  run_dir = _write_run(tmp_path / f"run-{family}", cfg, base, adapters, **kw)
  return run_dir, cfg, lora_cfg, base, adapters


@functools.cache
def _forward(model_cfg: ModelConfig):
  """A jitted `(params, tokens) -> logits` of `model_cfg` (one compile per config)."""
  graphdef, _ = abstract_model(model_cfg)

  @jax.jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    hidden, _ = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool))
    return model.logits(hidden)

  return run


def _logits(model_cfg: ModelConfig, params, tokens=TOKENS) -> np.ndarray:
  return np.asarray(_forward(model_cfg)(params, jnp.asarray(tokens)))


def _read_adapter(path: str) -> tuple[dict, dict]:
  from safetensors.numpy import load_file

  with open(os.path.join(path, export.ADAPTER_CONFIG_FILE)) as f:
    config = json.load(f)
  return config, load_file(os.path.join(path, export.ADAPTER_WEIGHTS_FILE))


def _export(capsys, *argv) -> tuple[int, str]:
  rc = export.main([str(a) for a in argv])
  return rc, capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Fast: files, names, shapes, values, refusals (no torch)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_export_names_shapes_values_and_config(tmp_path, family, capsys):
  model_dir = _jaxrl_model_dir(tmp_path / "hf", family)
  run_dir, _, lora_cfg, _, adapters = _lora_run(tmp_path, family, model_dir, dropout=0.05)
  out = tmp_path / "adapter"
  rc, err = _export(capsys, "--run", run_dir, "--out", out, "--adapter")
  assert rc == 0, err
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  config, tensors = _read_adapter(str(out))

  assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
  assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.05)
  assert isinstance(config["lora_alpha"], int)
  assert config["target_modules"] == [MODULES[t].split(".")[1] for t in TARGETS]
  assert config["base_model_name_or_path"] == model_dir
  assert config["bias"] == "none" and config["fan_in_fan_out"] is False
  assert config["use_rslora"] is False and config["use_dora"] is False
  assert config["modules_to_save"] is None and config["layers_to_transform"] is None

  D, H, K, Dh, F = (DIMS[k] for k in ("d_model", "num_heads", "num_kv_heads", "head_dim",
                                      "mlp_dim"))
  dims = {"q": (D, H * Dh), "k": (D, K * Dh), "v": (D, K * Dh), "o": (H * Dh, D),
          "gate": (D, F), "up": (D, F), "down": (F, D)}
  expected = {}
  for i in range(DIMS["num_layers"]):
    for t in TARGETS:
      name = f"base_model.model.model.layers.{i}.{MODULES[t]}"
      din, dout = dims[t]
      expected[f"{name}.lora_A.weight"] = (RANK, din)
      expected[f"{name}.lora_B.weight"] = (dout, RANK)
      a = np.asarray(adapters[f"lora_{t}"]["lora_a"][...])
      b = np.asarray(adapters[f"lora_{t}"]["lora_b"][...])
      np.testing.assert_array_equal(tensors[f"{name}.lora_A.weight"], a[i].T)
      np.testing.assert_array_equal(tensors[f"{name}.lora_B.weight"], b[i].T)
      assert np.abs(b[i]).max() > 0.1  # non-trivial adapters
  assert {k: v.shape for k, v in tensors.items()} == expected
  assert all(v.dtype == np.float32 for v in tensors.values())
  assert lora_cfg.lora_targets == TARGETS

  # A hub id instead of the local path, for a model card or `AutoPeftModelForCausalLM`.
  rc, err = _export(capsys, "--run", run_dir, "--out", tmp_path / "a2", "--adapter",
                    "--base_model", "Qwen/Qwen2.5-0.5B-Instruct")
  assert rc == 0, err
  assert _read_adapter(str(tmp_path / "a2"))[0]["base_model_name_or_path"] == \
      "Qwen/Qwen2.5-0.5B-Instruct"


def test_adapter_export_of_some_targets_only(tmp_path, capsys):
  model_dir = _jaxrl_model_dir(tmp_path / "hf", "llama")
  run_dir, *_ = _lora_run(tmp_path, "llama", model_dir, targets="q,v,down")
  rc, err = _export(capsys, "--run", run_dir, "--out", tmp_path / "a", "--adapter")
  assert rc == 0, err
  config, tensors = _read_adapter(str(tmp_path / "a"))
  assert config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
  assert sorted({k.split(".")[-3] for k in tensors}) == ["down_proj", "q_proj", "v_proj"]
  assert len(tensors) == 2 * 3 * DIMS["num_layers"]


def test_plain_and_merged_exports_are_the_merged_model(tmp_path, capsys):
  model_dir = _jaxrl_model_dir(tmp_path / "hf", "qwen2")
  run_dir, _, lora_cfg, base, adapters = _lora_run(tmp_path, "qwen2", model_dir)
  want = lora_lib.merged_weights(lora_cfg, base, adapters)
  lora_logits = _logits(lora_cfg, lora_lib.join(base, adapters))
  base_cfg = lora_lib.base_config(lora_cfg)
  # The adapters change the model measurably.
  assert np.abs(lora_logits - _logits(base_cfg, base)).max() > 1e-2
  for flag in ((), ("--merged",)):
    out = tmp_path / f"out{len(flag)}"
    rc, err = _export(capsys, "--run", run_dir, "--out", out, *flag)
    assert rc == 0, err
    assert not os.path.exists(out / export.ADAPTER_CONFIG_FILE)
    cfg, _, got = load_hf(str(out))
    assert cfg == load_hf(model_dir)[0]
    for name in ("wq", "wo", "w_gate", "w_down", "embed"):
      np.testing.assert_allclose(np.asarray(got[name][...]), np.asarray(want[name][...]),
                                 atol=1e-6, rtol=0)
    assert np.abs(np.asarray(got["wq"][...]) - np.asarray(base["wq"][...])).max() > 1e-3
    # The merged model computes what the LoRA model does.
    np.testing.assert_allclose(_logits(cfg, got), lora_logits, atol=1e-4, rtol=0)
  # `restore_run` (also what scripts/serve.py serves) gives the merged model too.
  _, _, cfg, _, step, params = export.restore_run(run_dir)
  assert step == 3 and cfg == dataclasses.replace(load_hf(model_dir)[0], scan_layers=True)
  np.testing.assert_allclose(np.asarray(params["w_up"][...]), np.asarray(want["w_up"][...]),
                             atol=1e-6, rtol=0)


def test_export_refusals_are_one_line(tmp_path, capsys):
  model_dir = _jaxrl_model_dir(tmp_path / "hf", "qwen2")
  # A run without LoRA: --adapter and --merged refused, a plain export as before.
  cfg = _run_config("qwen2", model_dir, rank=0)
  _, _, base = load_hf(model_dir)
  full = _write_run(tmp_path / "full", cfg, base, None)
  for flag in ("--adapter", "--merged"):
    rc, err = _export(capsys, "--run", full, "--out", tmp_path / "x", flag)
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("jaxrl: ") and "no LoRA adapters" in err
    assert "model.lora.rank is 0" in err and f"without {flag}" in err
  assert not os.path.exists(tmp_path / "x")
  rc, err = _export(capsys, "--run", full, "--out", tmp_path / "plain")
  assert rc == 0, err
  np.testing.assert_array_equal(np.asarray(load_hf(str(tmp_path / "plain"))[2]["wk"][...]),
                                np.asarray(base["wk"][...]))

  # A LoRA run whose warm-up trained the base: no adapter (its base is not the starting model);
  # the merged model is fine.
  run_dir, *_ = _lora_run(tmp_path, "qwen2", model_dir, warmup_steps=20)
  rc, err = _export(capsys, "--run", run_dir, "--out", tmp_path / "y", "--adapter")
  assert rc == 1 and err.count("\n") == 1, err
  assert "warm-up trained the base model (20 steps)" in err and "--merged" in err
  assert not os.path.exists(tmp_path / "y")
  assert _export(capsys, "--run", run_dir, "--out", tmp_path / "m", "--merged")[0] == 0

  # A run directory that is not one, or a step that is not there.
  rc, err = _export(capsys, "--run", tmp_path / "nope", "--out", tmp_path / "z", "--adapter")
  assert rc == 1 and "is not a jaxrl run directory" in err and err.count("\n") == 1
  rc, err = _export(capsys, "--run", run_dir, "--out", tmp_path / "z", "--merged",
                    "--step", "7")
  assert rc == 1 and "no checkpoint of step 7" in err and err.count("\n") == 1

  # A config.json that does not match the checkpoint (e.g. edited rank).
  with open(os.path.join(run_dir, "config.json")) as f:
    saved = json.load(f)
  saved["model"]["lora"]["rank"] = 8
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(saved, f)
  rc, err = _export(capsys, "--run", run_dir, "--out", tmp_path / "z", "--merged")
  assert rc == 1 and err.startswith("jaxrl: checkpoint 3 of ") and err.count("\n") == 1
  assert "does not hold the model its config.json describes" in err

  # Flags that do not go together: one line naming them, exit status 1.
  for argv in (["--adapter", "--merged"], ["--base_model", "m"], ["--merged", "--base_model", "m"]):
    with pytest.raises(SystemExit) as e:
      export.main(["--run", run_dir, "--out", str(tmp_path / "z"), *argv])
    assert e.value.code == 1
  err = capsys.readouterr().err
  assert "not allowed with argument" in err and all(
      line.startswith("jaxrl: python -m jaxrl.export: ") for line in err.splitlines()), err


def test_restore_fields_reads_named_fields_only(tmp_path):
  model_dir = _jaxrl_model_dir(tmp_path / "hf", "llama")
  run_dir, _, lora_cfg, base, adapters = _lora_run(tmp_path, "llama", model_dir)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = lambda s: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), s)
  with checkpoint.Checkpointer(checkpoint.checkpoint_dir(run_dir), read_only=True) as reader:
    step, got = reader.restore_fields(None, {"params": target(adapters), "frozen": target(base)})
    assert step == 3 and sorted(got) == ["frozen", "params"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got["params"], adapters)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got["frozen"], base)
    with pytest.raises((ValueError, TypeError)):  # saved as None
      reader.restore_fields(3, {"ref_params": target(base)})


def test_lora_recipes_are_the_full_recipes_with_adapters(tmp_path):
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from hf_fixtures import llama_files, qwen_files  # tests/ is on sys.path
  from jaxrl.recipes import llama3_2_1b_gsm8k, qwen2_5_0_5b_gsm8k

  data = tmp_path / "gsm8k.jsonl"
  data.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
  for lora, full, family, files in ((qwen2_5_0_5b_gsm8k_lora, qwen2_5_0_5b_gsm8k, "qwen2",
                                     qwen_files),
                                    (llama3_2_1b_gsm8k_lora, llama3_2_1b_gsm8k, "llama",
                                     llama_files)):
    a, b = config_lib.to_dict(lora.get_config()), config_lib.to_dict(full.get_config())
    assert a["name"] == b["name"] + "_lora"
    la, lb = a["model"].pop("lora"), b["model"].pop("lora")
    assert lb["rank"] == 0
    assert (la["rank"], la["alpha"], la["targets"]) == (16, 32.0, "q,k,v,o,gate,up,down")
    assert la["learning_rate"] == pytest.approx(10 * b["train"]["learning_rate"])
    a.pop("name"), b.pop("name")
    assert a == b
    # With the model and data files there, the recipe validates as it is.
    cfg = lora.get_config()
    cfg.model.hf_path = _jaxrl_model_dir(files(tmp_path / family), family)
    cfg.task.path = cfg.task.val_path = str(data)
    cfg.run_dir = str(tmp_path / "run")
    config_lib.validate(cfg, 8)


# ------------------------------------------------------------------------------------------
# Parity with peft and transformers


@pytest.mark.parity
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_adapter_and_merged_export_match_jaxrl_logits(tmp_path, family, capsys):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")

  hf_model, model_dir = _torch_model_dir(tmp_path / "hf", family)
  run_dir, _, lora_cfg, base, adapters = _lora_run(tmp_path, family, model_dir)
  tokens = torch.from_numpy(TOKENS.astype(np.int64))

  def hf_logits(model):
    with torch.no_grad():
      return model(tokens).logits.float().numpy()

  expected = _logits(lora_cfg, lora_lib.join(base, adapters))
  # jaxrl's base is the transformers model, and the adapters change its logits measurably.
  base_logits = hf_logits(hf_model)
  np.testing.assert_allclose(_logits(lora_lib.base_config(lora_cfg), base), base_logits,
                             atol=1e-4, rtol=0)
  moved = np.abs(expected - base_logits).max()
  assert moved > 1e-2, moved

  adapter_dir = tmp_path / "adapter"
  rc, err = _export(capsys, "--run", run_dir, "--out", adapter_dir, "--adapter")
  assert rc == 0, err
  load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32).eval()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    peft_model = peft.PeftModel.from_pretrained(load(model_dir), str(adapter_dir)).eval()
  # No adapter key PEFT expected was missing, none in the file went unused.
  assert not [w for w in caught if "key" in str(w.message).lower()], \
      [str(w.message) for w in caught]
  # PEFT's own names and shapes for this config are exactly the file's, and it loaded them all.
  _, tensors = _read_adapter(str(adapter_dir))
  fresh = peft.get_peft_model(load(model_dir), peft.LoraConfig.from_pretrained(str(adapter_dir)))
  own = peft.get_peft_model_state_dict(fresh)
  assert {k: tuple(v.shape) for k, v in own.items()} == \
      {k: v.shape for k, v in tensors.items()}
  loaded = peft.get_peft_model_state_dict(peft_model)
  for k, v in tensors.items():
    np.testing.assert_array_equal(loaded[k].numpy(), v)
  scaling = peft_model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]
  assert scaling == ALPHA / RANK
  got = hf_logits(peft_model)
  peft_err = np.abs(got - expected).max()
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)

  merged_dir = tmp_path / "merged"
  rc, err = _export(capsys, "--run", run_dir, "--out", merged_dir, "--merged")
  assert rc == 0, err
  merged = load(str(merged_dir))
  assert type(merged).__name__ == FAMILIES[family][1]
  got = hf_logits(merged)
  print(f"{family}: adapters move the logits by {moved:.3g}; max |peft - jaxrl| = "
        f"{peft_err:.3g}, max |merged export - jaxrl| = {np.abs(got - expected).max():.3g}")
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
  # PEFT's own merge agrees with jaxrl's.
  np.testing.assert_allclose(hf_logits(peft_model.merge_and_unload()), expected, atol=1e-4,
                             rtol=0)


# ------------------------------------------------------------------------------------------
# A real run of the LoRA recipe


@pytest.mark.slow
def test_lora_recipe_run_exports_adapter_and_merged_model(tmp_path, capsys):
  from test_hf_recipe import _jsonl, _model_dir  # tests/ is on sys.path
  from jaxrl.run import driver

  model_dir, _ = _model_dir(tmp_path, "qwen2")
  run_dir = tmp_path / "run"
  cfg = qwen2_5_0_5b_gsm8k_lora.get_config()
  problems: list[str] = []
  cfg = config_lib.parse_overrides(cfg, [
      f"--config.model.hf_path={model_dir}", f"--config.task.path={_jsonl(tmp_path)}",
      "--config.task.val_path=", f"--config.run_dir={run_dir}", "--config.model.dtype=float32",
      "--config.model.lora.rank=4", "--config.model.lora.learning_rate=1e-2",
      "--config.rollout.num_prompts=2", "--config.rollout.group_size=4",
      "--config.rollout.max_new_tokens=12", "--config.train.microbatch_tokens=512",
      "--config.train.steps=3", "--config.train.warmup_steps=0", "--config.val.every=3",
      "--config.val.at_start=false", "--config.val.batch_size=8", "--config.checkpoint.every=3",
      "--config.checkpoint.async_save=false",
      # Every reward of a random model is 0: an entropy bonus gives the updates a gradient.
      "--config.loss.entropy_coef=0.01"], problems)
  assert not problems, problems
  driver.run(cfg, str(run_dir), config_lib.validate(cfg, jax.device_count()))

  _, _, lora_cfg, step, adapters, base, _ = export.restore_lora(str(run_dir))
  assert step == 3 and lora_cfg.lora_rank == 4 and lora_cfg.lora_targets == TARGETS
  # Trained: B moved off zero.
  assert min(float(jnp.abs(adapters[f"lora_{t}"]["lora_b"][...]).max()) for t in TARGETS) > 0
  _, _, start = load_hf(model_dir)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               base, start)  # the base stayed the starting model

  assert _export(capsys, "--run", run_dir, "--out", tmp_path / "adapter", "--adapter")[0] == 0
  config, tensors = _read_adapter(str(tmp_path / "adapter"))
  assert (config["r"], config["lora_alpha"]) == (4, 32)
  np.testing.assert_array_equal(
      tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"],
      np.asarray(adapters["lora_down"]["lora_b"][...])[1].T)
  assert _export(capsys, "--run", run_dir, "--out", tmp_path / "merged")[0] == 0
  _, _, merged = load_hf(str(tmp_path / "merged"))
  want = lora_lib.merged_weights(lora_cfg, base, adapters)
  for name in lora_lib.WEIGHTS.values():
    np.testing.assert_allclose(np.asarray(merged[name][...]), np.asarray(want[name][...]),
                               atol=1e-6, rtol=0)
