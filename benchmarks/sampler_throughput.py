"""Sampler throughput: jaxrl's KV-cache sampler vs Hugging Face `generate`, side by side.

Prints ONE JSON object on stdout (progress goes to stderr). For each case it reports the first
call's wall time (compile + one run), the median generated tokens/s over the timed calls, and,
when `torch` and `transformers` are importable (the `parity` extra), the same for Hugging Face
`generate` on the same architecture and sizes with the KV cache on. Timed jaxrl and HF calls
alternate, so both see the same machine load; `ratio` is the median of the per-pair ratios.

Every row generates exactly `new_tokens` tokens: jaxrl gets `eos_id = vocab_size` (an id that is
never sampled), HF gets `min_new_tokens = max_new_tokens` and no EOS.

On a GPU (JAX's default backend `gpu`) the HF side runs on CUDA too (`--hf-device auto`), each
call ending in `torch.cuda.synchronize()`, as jaxrl's ends in `block_until_ready`.

`--dtypes float32,bfloat16` runs every case once per dtype, both sides in it: jaxrl with params
and compute in that dtype (the sampler of `rollout.dtype`; log-probs stay float32), HF with the
model cast to it (`torch_dtype`). A case's bfloat16 result is keyed "<case> bfloat16"; with both
dtypes, `bf16_over_f32` gives each side's speed-up (median of per-call ratios, calls of one side
paired in order) and the two jaxrl / HF ratios.

  PYTHONPATH=. python benchmarks/sampler_throughput.py [--cases default,qwen] [--repeats 5]
  PYTHONPATH=. python benchmarks/sampler_throughput.py --dtypes float32,bfloat16
  PYTHONPATH=. python benchmarks/sampler_throughput.py --quick   # smoke test, tiny sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# torch's OpenMP workers spin-wait at barriers by default; on a 2-core machine shared with other
# jobs a descheduled spinner makes every op wait for a time slice (measured: a 0.4M-param
# forward 4 ms -> 280 ms with 2 threads). Passive waiting removes that; it must be set before
# torch is imported. Override from the environment to compare.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.recipes.default import get_config
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import abstract_model, init_model
from jaxrl.rollout.static_sampler import make_sampler

DEFAULT_VOCAB = 14  # the `add` task's CharTokenizer: 12 characters + pad + EOS


def log(*a):
  print(*a, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Case:
  name: str
  model: ModelConfig
  prompts: int  # P
  group: int  # G samples per prompt; rows = P * G
  prompt_len: int  # Lp (left-padded)
  new_tokens: int  # N
  hf_arch: str  # "llama" or "qwen2"


def make_cases(quick: bool, qwen_new_tokens: int = 16) -> dict[str, Case]:
  default_model = ModelConfig.from_config(get_config().model, DEFAULT_VOCAB)
  qwen_model = ModelConfig.qwen2_5_0_5b(scan_layers=True)
  if quick:
    qwen_model = dataclasses.replace(qwen_model, num_layers=2, vocab_size=4096, mlp_dim=1024)
    return {
        "default": Case("default", default_model, 2, 2, 16, 8, "llama"),
        "qwen": Case("qwen2.5-0.5b-shape (quick: 2 layers, vocab 4096, mlp 1024)", qwen_model,
                     2, 1, 16, 4, "qwen2"),
    }
  return {
      "default": Case("default", default_model, 8, 8, 16, 128, "llama"),
      "qwen": Case("qwen2.5-0.5b-shape", qwen_model, 4, 1, 16, qwen_new_tokens, "qwen2"),
  }


def make_prompts(case: Case, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Random left-padded prompts: lengths in [Lp/2, Lp], ids in [2, V) (no pad / EOS)."""
  rng = np.random.default_rng(seed)
  P, Lp, V = case.prompts, case.prompt_len, case.model.vocab_size
  lens = rng.integers(max(1, Lp // 2), Lp + 1, size=P)
  lens[0] = Lp  # at least one full-length prompt
  tokens = np.zeros((P, Lp), np.int32)
  valid = np.zeros((P, Lp), bool)
  for i, n in enumerate(lens):
    tokens[i, Lp - n:] = rng.integers(2, V, size=n)
    valid[i, Lp - n:] = True
  return tokens, valid


# ---- jaxrl ---------------------------------------------------------------------------------------

def random_params(cfg: ModelConfig, seed: int = 0):
  """(graphdef, params) with `init_model`'s distributions (norms 1, biases 0, weights
  N(0, init_std)). Small models use `init_model` itself; for large ones its eager threefry draws
  take ~20 s per 0.5B parameters on this CPU, so numpy draws them instead (values do not affect
  timings)."""
  graphdef, abstract = abstract_model(cfg)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  if n < 50_000_000:
    return init_model(cfg, seed)
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    if "norm" in name:
      a = np.ones(x.shape, np.float32)
    elif name in ("bq", "bk", "bv"):
      a = np.zeros(x.shape, np.float32)
    else:
      a = rng.standard_normal(x.shape, dtype=np.float32)
      a *= cfg.init_std
    return jnp.asarray(a, x.dtype)

  return graphdef, jax.tree_util.tree_map_with_path(leaf, abstract)


class JaxRunner:

  def __init__(self, case: Case, prompts, valid):
    t0 = time.perf_counter()
    self.graphdef, self.params = random_params(case.model, seed=0)
    jax.block_until_ready(self.params)
    self.init_s = time.perf_counter() - t0
    self.generate = make_sampler(self.graphdef, num_samples=case.group,
                                 max_new_tokens=case.new_tokens,
                                 eos_id=case.model.vocab_size,  # never sampled: no early stop
                                 pad_id=0)
    self.prompts = jnp.asarray(prompts)
    self.valid = jnp.asarray(valid)
    self.rows = case.prompts * case.group
    self.request_ids = jnp.arange(self.rows, dtype=jnp.int32)
    self.calls = 0

  def __call__(self):
    self.calls += 1
    out = self.generate(self.params, self.prompts, self.valid, jax.random.key(self.calls),
                        self.request_ids, 1.0, top_k=0, top_p=1.0)
    jax.block_until_ready(out)
    return out


# ---- Hugging Face --------------------------------------------------------------------------------

def hf_unavailable_reason() -> str | None:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except Exception as e:  # ImportError, or a broken install
    return (f"torch/transformers not importable ({type(e).__name__}: {e}); install the parity "
            "extra: pip install torch==2.13.0 transformers")
  return None


class HFRunner:

  def __init__(self, case: Case, prompts, valid, threads: int, device: str = "cpu"):
    import torch
    import transformers

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case.model.dtype]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = case.model
    common = dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_dim,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                  num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                  rms_norm_eps=m.rms_eps, tie_word_embeddings=m.tie_embeddings,
                  max_position_embeddings=max(4096, case.prompt_len + case.new_tokens),
                  hidden_act="silu", pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                  initializer_range=m.init_std)
    if case.hf_arch == "llama":
      assert not m.qkv_bias and not m.qk_norm
      config = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
      cls = transformers.LlamaForCausalLM
    else:
      assert m.qkv_bias and not m.qk_norm  # Qwen2 always has q/k/v bias
      config = transformers.Qwen2Config(use_sliding_window=False, **common)
      cls = transformers.Qwen2ForCausalLM
    t0 = time.perf_counter()
    # what from_pretrained(torch_dtype=dtype) gives
    self.model = cls(config).to(dtype).to(device).eval()
    self.init_s = time.perf_counter() - t0
    self.torch = torch
    self.case = case
    self.device = device
    self.input_ids = torch.from_numpy(prompts.astype(np.int64)).to(device)
    self.attention_mask = torch.from_numpy(valid.astype(np.int64)).to(device)
    self.attn_impl = getattr(self.model.config, "_attn_implementation", None)
    self.params = sum(p.numel() for p in self.model.parameters())

  def __call__(self):
    c = self.case
    with self.torch.no_grad():
      out = self.model.generate(
          input_ids=self.input_ids, attention_mask=self.attention_mask, do_sample=True,
          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=c.new_tokens,
          min_new_tokens=c.new_tokens, num_return_sequences=c.group, use_cache=True,
          pad_token_id=0, eos_token_id=None)
    if self.device != "cpu":
      self.torch.cuda.synchronize()
    new = out.shape[1] - c.prompt_len
    assert out.shape[0] == c.prompts * c.group and new == c.new_tokens, out.shape
    return out


# ---- timing --------------------------------------------------------------------------------------

def timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def summarize(first_s: float, times: list[float], tokens: int) -> dict:
  med = statistics.median(times)
  return {
      "first_call_s": round(first_s, 3),
      "compile_s_est": round(max(first_s - med, 0.0), 3),  # first call minus a steady call
      "median_call_s": round(med, 4),
      "call_s": [round(t, 4) for t in times],
      "tokens_per_s": round(tokens / med, 1),
      "tokens_per_s_all": [round(tokens / t, 1) for t in times],
  }


def run_case(case: Case, repeats: int, hf_reason: str | None, threads: int,
             dtype: str = "float32", hf_device: str = "cpu") -> dict:
  case = dataclasses.replace(case, model=dataclasses.replace(case.model, param_dtype=dtype,
                                                             dtype=dtype))
  prompts, valid = make_prompts(case)
  rows = case.prompts * case.group
  tokens = rows * case.new_tokens
  m = case.model
  log(f"[{case.name}] rows={rows} (P={case.prompts} x G={case.group}) Lp={case.prompt_len} "
      f"N={case.new_tokens}")
  jx = JaxRunner(case, prompts, valid)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jx.params))
  log(f"[{case.name}] jaxrl init {jx.init_s:.1f}s, {n_params / 1e6:.1f}M params; compiling")
  jax_first = timed(jx)
  out = jx()
  assert bool(out.mask.all()), "some row stopped early: eos_id was sampled"
  log(f"[{case.name}] jaxrl first call {jax_first:.2f}s")

  hf = None
  if hf_reason is None:
    hf = HFRunner(case, prompts, valid, threads, hf_device)
    log(f"[{case.name}] HF init {hf.init_s:.1f}s ({hf.params / 1e6:.1f}M params, "
        f"attn={hf.attn_impl}); first call")
    hf_first = timed(hf)
    log(f"[{case.name}] HF first call {hf_first:.2f}s")

  jt, ht = [], []
  for r in range(repeats):  # alternate so both see the same machine load
    jt.append(timed(jx))
    if hf is not None:
      ht.append(timed(hf))
    log(f"[{case.name}] repeat {r + 1}/{repeats}: jaxrl {jt[-1]:.3f}s"
        + (f", HF {ht[-1]:.3f}s" if hf is not None else ""))

  result = {
      "model": {k: getattr(m, k) for k in ("vocab_size", "d_model", "num_layers", "num_heads",
                                           "num_kv_heads", "head_dim", "mlp_dim", "qkv_bias",
                                           "tie_embeddings", "scan_layers", "param_dtype",
                                           "dtype")},
      "params_millions": round(n_params / 1e6, 2),
      "prompts": case.prompts,
      "samples_per_prompt": case.group,
      "rows": rows,
      "prompt_len": case.prompt_len,
      "new_tokens": case.new_tokens,
      "generated_tokens_per_call": tokens,
      "temperature": 1.0,
      "jaxrl": {"init_s": round(jx.init_s, 2), **summarize(jax_first, jt, tokens)},
  }
  if hf is None:
    result["hf"] = None
    result["hf_reason"] = hf_reason
  else:
    result["hf"] = {"class": type(hf.model).__name__, "attn_implementation": hf.attn_impl,
                    "device": hf.device,
                    "params_millions": round(hf.params / 1e6, 2), "init_s": round(hf.init_s, 2),
                    **summarize(hf_first, ht, tokens)}
    pair = [h / j for j, h in zip(jt, ht)]  # (tokens/jt) / (tokens/ht)
    result["ratio_jaxrl_over_hf"] = round(statistics.median(pair), 2)
    result["ratio_per_pair"] = [round(x, 2) for x in pair]
    result["target_3x_met"] = result["ratio_jaxrl_over_hf"] >= 3.0
    del hf
  del jx
  return result


def dtype_speedups(f32: dict, bf16: dict) -> dict:
  """Each side's bfloat16 speed-up over float32 (median of per-call ratios, the i-th timed call
  of one dtype against the i-th of the other: the two dtypes run one after the other, so these
  see more drift in machine load than the jaxrl / HF ratios, whose calls alternate)."""
  out = {}
  for side in ("jaxrl", "hf"):
    if f32.get(side) and bf16.get(side):
      pair = [a / b for a, b in zip(f32[side]["call_s"], bf16[side]["call_s"])]
      out[f"{side}_speedup"] = round(statistics.median(pair), 2)
  for name, r in (("float32", f32), ("bfloat16", bf16)):
    if "ratio_jaxrl_over_hf" in r:
      out[f"ratio_jaxrl_over_hf_{name}"] = r["ratio_jaxrl_over_hf"]
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="default,qwen", help="comma list of: default, qwen")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls per side (>= 3)")
  ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
  ap.add_argument("--qwen-new-tokens", type=int, default=16,
                  help="new tokens per row in the 0.5B case (16 keeps it under ~3 min here)")
  ap.add_argument("--torch-threads", type=int, default=2)
  ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face even if installed")
  ap.add_argument("--hf-device", default="auto",
                  help="where HF runs: cpu, cuda, or auto (cuda when JAX's backend is gpu)")
  ap.add_argument("--dtypes", default="float32",
                  help="comma list of: float32, bfloat16 (params and compute, both sides)")
  args = ap.parse_args()
  if args.repeats < 1:
    ap.error("--repeats must be >= 1")
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
    ap.error(f"--dtypes: a comma list of float32, bfloat16; got {args.dtypes!r}")
  t_start = time.perf_counter()

  cases = make_cases(args.quick, args.qwen_new_tokens)
  names = [c.strip() for c in args.cases.split(",") if c.strip()]
  for n in names:
    if n not in cases:
      ap.error(f"unknown case {n!r}; choose from {sorted(cases)}")
  hf_reason = "disabled by --no-hf" if args.no_hf else hf_unavailable_reason()
  if hf_reason:
    log(f"HF comparison off: {hf_reason}")
  hf_device = args.hf_device
  if hf_device == "auto":
    hf_device = "cuda" if jax.default_backend() == "gpu" else "cpu"
  if hf_device not in ("cpu", "cuda"):
    ap.error(f"--hf-device: cpu, cuda or auto; got {args.hf_device!r}")

  versions = {"jax": jax.__version__, "python": platform.python_version()}
  if hf_reason is None:
    import torch
    import transformers
    versions.update(torch=torch.__version__, transformers=transformers.__version__)
    if hf_device == "cuda" and not torch.cuda.is_available():
      ap.error("--hf-device cuda: torch sees no CUDA device")
  report = {
      "benchmark": "sampler_throughput",
      "quick": args.quick,
      "repeats": args.repeats,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "jax_backend": jax.default_backend(),
                  "jax_device": jax.devices()[0].device_kind, "hf_device": hf_device,
                  "torch_threads": args.torch_threads,
                  "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                  "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
      "versions": versions,
      "target": "jaxrl tokens/s >= 3x HF transformers generate tokens/s",
      "cases": {},
  }
  report["dtypes"] = dtypes
  for n in names:
    c = cases[n]
    by_dtype = {}
    for d in dtypes:
      key = c.name if d == "float32" else f"{c.name} {d}"
      by_dtype[d] = report["cases"][key] = run_case(c, args.repeats, hf_reason,
                                                    args.torch_threads, d, hf_device)
    if "float32" in by_dtype and "bfloat16" in by_dtype:
      report["cases"][f"{c.name} bf16_over_f32"] = dtype_speedups(by_dtype["float32"],
                                                                   by_dtype["bfloat16"])
  report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
