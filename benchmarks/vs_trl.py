"""jaxrl vs TRL's `GRPOTrainer` on TRL's own kind of workload (issue 22), side by side on the CPU.

Both trainers start from the same files: a tiny `Qwen2ForCausalLM` (vocab 16, d 128, 2 layers,
4/2 heads, SwiGLU 512, tied embeddings, f32, initialised after `torch.manual_seed(0)`) saved with
`save_pretrained`, next to a 16-token character-level `tokenizer.json` (`<pad> <bos> <eos> 0-9 + =
-`, `<bos>` prepended by the post-processor, left padding) that transformers loads as a
`PreTrainedTokenizerFast` and jaxrl as its `HFTokenizer`. The task is 512 prompts `"{a}+{b}="`
(a, b from `random.Random(1234).randint(0, 99)`) graded by `partial`: the fraction of positions
where the completion's text (before `<eos>`) matches the sum's digits. GRPO: 8 prompts x 8
samples per step at temperature 1, 16 new tokens, DAPO token-mean loss, clip 0.2, group-std
advantages, no KL, AdamW lr 1e-3 constant (0.9, 0.999, 1e-8), clip-norm 1.0, one generation and
one optimiser step per step, 100 steps, f32 on the CPU.

- TRL: TRL 1.16's `GRPOTrainer` in a subprocess of a separate virtualenv (`--trl-python`, default
  ~/trl-venv/bin/python: torch 2.13.0 CPU, trl 1.16.0). A `TrainerCallback` takes each
  step's wall time (`on_step_begin` to `on_step_end`: generation, reward, loss, backward and the
  optimiser step; logging is after it) and the rollout part is timed by wrapping the trainer's
  `_generate_and_score_completions` (generation, decoding, reward, advantages), so
  "train" = step - rollout; TRL has no per-phase timings of its own outside W&B / MLflow.
- jaxrl: its public CLI, `python -m jaxrl.train --config benchmarks/vs_trl_recipe.py
  --config.model.hf_path=<dir> ...` (the recipe registers the task the documented way, README
  "Your own task"), at `rollout.lag` 0 and 1, each with a cold compilation cache (a fresh
  `--config.compile_cache` directory) and warm (the same command again on that directory). Step
  times are its own `perf/step_time_s`, the split its `perf/rollout_s` / `perf/train_s`.

Measured per run, from the outside the same way for both: the whole command's wall time (launch
to exit), the time to the first RL step's end (the moment its "first RL step done" line reaches
this script's pipe; both print one), peak RSS of the process tree (psutil, every 50 ms, summed over
the process and its children) and the kernel's `ru_maxrss` of the process (`os.wait4`); and from
the run's own records: step 1's time, the median step time over steps 2-20 and over steps 21 on
(by then completions have shortened: TRL's shapes follow the longest completion of the batch,
jaxrl's stay fixed), the rollout / train split (medians over the same windows), the time spent
outside steps after the first (per-step logging, the run's end, exit), and the mean `partial`
reward and completion length in characters over the last 10 steps (91-100). The train step's
achieved FLOP/s (`train_step_flops` over its median train time) is set against this machine's
f32 matmul rate, one jitted 2048^3 product timed at the start and the end (`matmul_peak`). Runs alternate
(TRL first in even pairs, jaxrl first in odd ones) so drift in this shared machine's speed does
not favour one side. Prints ONE JSON object on stdout (progress on stderr): every run, medians
over pairs, the jaxrl / TRL ratios against issue 22's targets, the differences between the two
setups, and the exact commands.

  python benchmarks/vs_trl.py                     # 3 pairs x (TRL, jaxrl lag 0/1 cold+warm)
  python benchmarks/vs_trl.py --pairs 1 --lags 0  # one pair, lag 0 only
  python benchmarks/vs_trl.py --quick             # smoke run: 20 steps, 1 pair

One-time setup of the TRL side (its own virtualenv, so the project's stays as it is):

  python3.11 -m venv ~/trl-venv
  ~/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0 numpy psutil
  ~/trl-venv/bin/pip install -e ".[hf]"      # or: pip install -e ".[trl]" into any venv

The script itself runs under the project's Python (jaxrl, psutil); it calls itself under the TRL
Python for the model files (`make-model`) and for each TRL run (`trl-worker`), and never imports
torch, transformers or jax in the measuring process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(HERE, "vs_trl_recipe.py")
# TRL's venv: $JAXRL_TRL_PYTHON, else ~/trl-venv (the setup above); --trl-python overrides both.
DEFAULT_TRL_PYTHON = os.environ.get("JAXRL_TRL_PYTHON") or os.path.expanduser(
    "~/trl-venv/bin/python")

# The workload (issue 22). Ids follow this order: <pad> 0, <bos> 1, <eos> 2, "0".."9" 3..12, ...
TOKENS = ["<pad>", "<bos>", "<eos>", *"0123456789", "+", "=", "-"]
SPECIAL = TOKENS[:3]
NUM_PROMPTS, PROMPT_SEED = 512, 1234
MODEL = dict(vocab_size=16, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
             rms_norm_eps=1e-6, rope_theta=1e4)
# One GRPO step: P prompts x G samples, one generation and one optimiser step.
GRPO = dict(prompts=8, group_size=8, max_new_tokens=16, temperature=1.0, epsilon=0.2, lr=1e-3,
            betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0, adv_eps=1e-4)
MAX_PROMPT_TOKENS = 1 + len("99+99=")  # <bos> and the longest prompt: jaxrl's fixed prompt width
FIRST_STEP_LINE = "first RL step done"  # printed by both sides (jaxrl.run.driver; the TRL worker)
STEP_WINDOW = (2, 20)  # steps whose median is the per-step time (step 1 compiles / warms up)
# Steps after it: completions have shortened by then, which TRL's padded-to-the-longest shapes
# follow and jaxrl's fixed shapes do not.
LATE_FROM = 21
TARGETS = {"step_time": 0.6, "wall_warm": 0.7, "wall_cold": 1.0, "peak_rss": 1.1,
           "flops_fraction": 0.5}
PEAK_MATMUL_N = 2048  # the one large f32 matmul that stands for this machine's peak


def train_step_flops(params: int, share_prompts: bool = True) -> dict:
  """FLOPs of one jaxrl train step on this workload by issue 22's formula: 6 x params x tokens
  (forward and backward of every weight once per position), plus causal attention.

  Positions are those the step computes: with `train.share_prompts` (the recipe's default) each
  group's 7-token prompt once and its 8 completions of 16 tokens, 8 x 7 + 64 x 16 = 1,080; else
  64 x (7 + 16) = 1,472. Attention per layer and position: q.k and p.v over the positions it sees,
  2 x 2 x (heads x head_dim) FLOPs per key forward, x 3 with the backward. It counts the work the
  step must do, not what it happens to do (a separate log-prob pass, padding), so a step that
  wastes work scores lower.
  """
  p, g, n = GRPO["prompts"], GRPO["group_size"], GRPO["max_new_tokens"]
  lp = MAX_PROMPT_TOKENS
  rows = p * g
  positions = p * lp + rows * n if share_prompts else rows * (lp + n)
  # Keys each position attends to (itself included): prompt i sees i keys, completion j sees
  # lp + j.
  prompt_keys = sum(range(1, lp + 1)) * (p if share_prompts else rows)
  completion_keys = rows * sum(lp + j for j in range(1, n + 1))
  width = MODEL["hidden_size"]  # heads x head_dim = 4 x 32
  attention = 3 * 2 * 2 * width * (prompt_keys + completion_keys) * MODEL["num_hidden_layers"]
  dense = 6 * params * positions
  return {"positions": positions, "dense_flops": dense, "attention_flops": attention,
          "flops": dense + attention,
          "formula": "6 x params x positions + 12 x (heads x head_dim) x attended keys x layers"}


def matmul_peak(n: int = PEAK_MATMUL_N, runs: int = 7) -> dict:
  """This machine's f32 matmul rate as JAX reaches it: one jitted n x n x n product, the best
  and the median of `runs` timed calls after one warm-up (run under the jaxrl Python)."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, b))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - t0)
  flops = 2 * n ** 3
  return {"n": n, "flops": flops, "best_s": min(times), "median_s": statistics.median(times),
          "gflops_best": flops / min(times) / 1e9,
          "gflops_median": flops / statistics.median(times) / 1e9,
          "jax": jax.__version__, "backend": jax.default_backend()}


def measure_peak(args) -> dict:
  """`matmul_peak` in a fresh jaxrl-Python process (this process never imports jax)."""
  cmd = [args.jaxrl_python, os.path.abspath(__file__), "matmul-peak"]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if done.returncode != 0:
    return {"error": done.stderr[-2000:], "command": shlex.join(cmd)}
  return json.loads(done.stdout.strip().splitlines()[-1]) | {"command": shlex.join(cmd)}


def log(*a):
  print(*a, file=sys.stderr, flush=True)


# -- the task, shared by both sides (plain Python: the TRL worker must not import jax) ----------

def make_prompts() -> list[tuple[str, str]]:
  """The 512 (prompt, answer) rows: `"{a}+{b}="` and `str(a + b)`, a, b uniform in 0..99."""
  rng = random.Random(PROMPT_SEED)
  rows = []
  for _ in range(NUM_PROMPTS):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    rows.append((f"{a}+{b}=", str(a + b)))
  return rows


def partial(completion: str, answer: str) -> float:
  """Positions where the completion's text matches the answer's, over the longer of the two:
  "57" for "57" is 1, "5" or "58" is 0.5, "570" is 2/3, "" is 0."""
  hits = sum(c == a for c, a in zip(completion, answer))
  return hits / max(len(completion), len(answer), 1)


# -- model files (run under the TRL Python: torch, transformers, tokenizers) --------------------

def make_model(out_dir: str) -> dict:
  """Writes the tokenizer and the f32 Qwen2 model into `out_dir`; returns what was written."""
  import torch
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

  vocab = {t: i for i, t in enumerate(TOKENS)}
  # WordLevel needs an unknown token; the vocabulary has none, and every prompt character is in
  # it, so <pad> stands in (never produced by the prompts).
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  # Every character is its own word; decoding concatenates (no spaces between characters).
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(SPECIAL)
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                     special_tokens=[("<bos>", vocab["<bos>"])])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>", padding_side="left",
                                 clean_up_tokenization_spaces=False)
  fast.save_pretrained(out_dir)
  torch.manual_seed(0)
  model = Qwen2ForCausalLM(Qwen2Config(**MODEL)).to(torch.float32)
  model.save_pretrained(out_dir, safe_serialization=True)
  n_params = sum(p.numel() for p in model.parameters())
  check = fast("12+34=")["input_ids"]
  return {"dir": out_dir, "files": sorted(os.listdir(out_dir)), "params": n_params,
          "encode('12+34=')": check,
          "decode": fast.decode(check + [2, 0], skip_special_tokens=True)}


# -- the TRL side (run under the TRL Python) -----------------------------------------------------

def step_timer(callback_base, started: float, on_step=None):
  """A TRL `TrainerCallback` (`callback_base`: transformers' class, from the TRL venv) timing
  each optimiser step, `on_step_begin` to `on_step_end` (generation included: GRPO generates
  inside `training_step`), into `.times`. The first step's end is printed as `FIRST_STEP_LINE`
  (seconds since `started`, a `time.time()`); `on_step(timer)` runs after each step."""

  class StepTimes(callback_base):
    def __init__(self):
      self.begin, self.times, self.first_done = None, [], None

    def on_step_begin(self, args, state, control, **kw):
      self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      self.times.append(time.perf_counter() - self.begin)
      if self.first_done is None:
        self.first_done = time.time()
        print(f"{FIRST_STEP_LINE} {self.first_done - started:.1f} s after start", flush=True)
      if on_step is not None:
        on_step(self)

  return StepTimes()


def time_rollouts(trainer) -> list[float]:
  """Wraps `trainer._generate_and_score_completions` (generation, decoding, reward, advantages:
  TRL's rollout part of a step); returns the list each call's seconds are appended to."""
  times: list[float] = []
  generate = trainer._generate_and_score_completions

  def timed_generate(*a, **kw):
    t0 = time.perf_counter()
    out = generate(*a, **kw)
    times.append(time.perf_counter() - t0)
    return out

  trainer._generate_and_score_completions = timed_generate
  return times


def trl_worker(model_dir: str, out_file: str, steps: int, seed: int) -> None:
  """One TRL GRPO run; writes per-step times, rollout times, rewards and TRL's own logs as JSON."""
  started = time.time()
  import datasets
  import torch
  import transformers
  import trl
  from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

  rows = make_prompts()
  answers = dict(rows)
  per_call: list[dict] = []  # one entry per reward call = per generation = per step

  def partial_reward(prompts, completions, **kwargs):
    rewards = [partial(c, answers[p]) for p, c in zip(prompts, completions)]
    per_call.append({"reward": sum(rewards) / len(rewards),
                     "chars": sum(map(len, completions)) / len(completions)})
    return rewards

  dataset = datasets.Dataset.from_list([{"prompt": p} for p, _ in rows])
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  output_dir = os.path.join(os.path.dirname(out_file), "trl-output")
  args = trl.GRPOConfig(
      output_dir=output_dir, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
      seed=seed, max_steps=steps,
      per_device_train_batch_size=GRPO["prompts"] * GRPO["group_size"],  # completions per step
      gradient_accumulation_steps=1, num_generations=GRPO["group_size"], num_iterations=1,
      max_completion_length=GRPO["max_new_tokens"], temperature=GRPO["temperature"], top_p=1.0,
      top_k=0, min_p=None, repetition_penalty=1.0,
      loss_type="dapo", epsilon=GRPO["epsilon"], epsilon_high=GRPO["epsilon"],
      scale_rewards="group", beta=0.0, mask_truncated_completions=False,
      learning_rate=GRPO["lr"], lr_scheduler_type="constant", warmup_steps=0,
      adam_beta1=GRPO["betas"][0], adam_beta2=GRPO["betas"][1], adam_epsilon=GRPO["adam_eps"],
      weight_decay=0.0, max_grad_norm=GRPO["grad_clip"],
      # TRL's own defaults are bf16=True and gradient_checkpointing=True: the workload is f32
      # without recomputation on both sides.
      bf16=False, fp16=False, gradient_checkpointing=False)
  timer = step_timer(TrainerCallback, started)
  trainer = trl.GRPOTrainer(model=model, reward_funcs=partial_reward, args=args,
                            train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
  rollout_s = time_rollouts(trainer)
  t0 = time.perf_counter()
  trainer.train()
  train_s = time.perf_counter() - t0
  history = [h for h in trainer.state.log_history if "reward" in h]
  result = {
      "step_time_s": timer.times, "rollout_s": rollout_s, "per_call": per_call,
      "log_history": history, "train_call_s": train_s, "first_step_done_unix": timer.first_done,
      "started_unix": started,
      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                   "trl": trl.__version__, "datasets": datasets.__version__},
      "threads": torch.get_num_threads(), "optim": str(trainer.args.optim),
      "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                        else trainer.optimizer).__name__,
      "eos_token_ids": list(trainer.eos_token_ids),
  }
  with open(out_file, "w") as f:
    json.dump(result, f)


# -- running and measuring one command -----------------------------------------------------------

def run_measured(cmd: list[str], env: dict, log_path: str) -> dict:
  """Runs `cmd`; returns its wall time, exit code, peak RSS of its process tree (psutil, every
  50 ms), `ru_maxrss` of the process (os.wait4) and when the "first RL step done" line arrived.
  stdout and stderr go to `log_path` (stdout lines also kept for parsing)."""
  import psutil

  lines: list[str] = []
  first_line_at = []
  load = os.getloadavg()[0]
  with open(log_path, "w") as err:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                            bufsize=1)

    def read():
      for line in proc.stdout:
        if not first_line_at and FIRST_STEP_LINE in line:
          first_line_at.append(time.perf_counter() - t0)
        lines.append(line)
        err.write(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak, ps = 0, psutil.Process(proc.pid)
    status = None
    while status is None:
      try:
        tree = [ps] + ps.children(recursive=True)
        rss = 0
        for p in tree:
          try:
            rss += p.memory_info().rss
          except psutil.Error:
            pass
        peak = max(peak, rss)
      except psutil.Error:
        pass
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
      if pid == 0:
        status = None
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=10)
  return {"wall_s": wall, "returncode": proc.returncode, "load_avg_1m": load,
          "peak_rss_tree_mib": peak / 2**20, "ru_maxrss_mib": usage.ru_maxrss / 1024,
          "first_step_done_s": (first_line_at or [None])[0],
          "stdout": lines}


def median(xs):
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def window(xs: list, lo: int, hi: int) -> list:
  """Entries of 1-based steps lo..hi of a per-step list."""
  return xs[lo - 1:hi]


def step_stats(step: list[float], rollout: list[float], train: list[float], wall: float,
               first_done: float | None) -> dict:
  """Per-step numbers of one run from its per-step times (seconds, step 1 first): step 1, the
  medians over `STEP_WINDOW` and from `LATE_FROM` on, the sum of steps 2.., and what the whole
  run spent outside steps after the first one ended (per-step logging, the end of the run, exit):
  wall - first step done - steps 2.."""
  late = slice(LATE_FROM - 1, None)
  rest = sum(step[1:])
  return {
      "steps": len(step), "step1_s": step[0] if step else None,
      "step_median_s": median(window(step, *STEP_WINDOW)),
      "rollout_median_s": median(window(rollout, *STEP_WINDOW)),
      "train_median_s": median(window(train, *STEP_WINDOW)),
      "step_late_median_s": median(step[late]), "rollout_late_median_s": median(rollout[late]),
      "train_late_median_s": median(train[late]), "steps_after_first_s": rest,
      "outside_steps_s": None if first_done is None else wall - first_done - rest}


def tail_window(steps: int) -> tuple[int, int]:
  """The last 10 steps (91-100 of 100)."""
  return max(1, steps - 9), steps


# The TRL process's environment on top of this one's: offline, and torch's OpenMP threads
# waiting passively (by default they spin in their barriers, which on this shared 2-core machine
# made small forwards up to ~70x slower: benchmarks/README.md, sampler). Passive is the setting
# that favours TRL here.
TRL_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}


def trl_run(args, model_dir: str, work: str, tag: str, seed: int) -> dict:
  out_file = os.path.join(work, f"{tag}.json")
  cmd = [args.trl_python, os.path.abspath(__file__), "trl-worker", "--model", model_dir,
         "--out", out_file, "--steps", str(args.steps), "--seed", str(seed)]
  m = run_measured(cmd, dict(os.environ, **TRL_ENV), os.path.join(work, f"{tag}.log"))
  shown = " ".join(f"{k}={v}" for k, v in TRL_ENV.items())
  out = {"side": "trl", "tag": tag, "seed": seed, "command": f"{shown} {shlex.join(cmd)}",
         **{k: v for k, v in m.items() if k != "stdout"}}
  if m["returncode"] != 0 or not os.path.exists(out_file):
    out["error"] = "".join(open(os.path.join(work, f"{tag}.log")).readlines()[-30:])
    return out
  r = json.load(open(out_file))
  times, rollout = r["step_time_s"], r["rollout_s"]
  train = [s - g for s, g in zip(times, rollout)]
  lo, hi = tail_window(args.steps)
  calls = r["per_call"]
  out.update(step_stats(times, rollout, train, m["wall_s"], m["first_step_done_s"]))
  out.update({
      "reward_last10": statistics.fmean(c["reward"] for c in window(calls, lo, hi)),
      "chars_last10": statistics.fmean(c["chars"] for c in window(calls, lo, hi)),
      "tokens_last10": statistics.fmean(h["completions/mean_length"]
                                        for h in window(r["log_history"], lo, hi)),
      "trl_logged_reward_last10": statistics.fmean(h["reward"]
                                                   for h in window(r["log_history"], lo, hi)),
      "trainer_train_s": r["train_call_s"], "versions": r["versions"],
      "torch_threads": r["threads"],
      "optim": r["optim"], "optimizer": r["optimizer"], "eos_token_ids": r["eos_token_ids"]})
  return out


def jaxrl_command(args, model_dir: str, run_dir: str, cache: str, lag: int,
                  seed: int) -> list[str]:
  # At lag 0 nothing on this workload reads the sampler's log-probs (no correction, no rollout
  # KL, the PPO ratio is against the trainer's own), and TRL does not keep them: jaxrl is told
  # so. At lag 1 the ratio is taken against them (loss.ratio_base=auto), so they stay on.
  logprobs = [] if lag else ["--config.rollout.logprobs=false"]
  return [args.jaxrl_python, "-m", "jaxrl.train", "--config", RECIPE,
          f"--config.model.hf_path={model_dir}", f"--config.run_dir={run_dir}",
          f"--config.compile_cache={cache}", f"--config.rollout.lag={lag}",
          f"--config.train.steps={args.steps}", f"--config.seed={seed}", *logprobs]


def jaxrl_run(args, model_dir: str, work: str, tag: str, cache: str, lag: int, seed: int) -> dict:
  run_dir = os.path.join(work, tag)
  cmd = jaxrl_command(args, model_dir, run_dir, cache, lag, seed)
  m = run_measured(cmd, dict(os.environ), os.path.join(work, f"{tag}.log"))
  out = {"side": "jaxrl", "tag": tag, "lag": lag, "seed": seed, "command": shlex.join(cmd),
         **{k: v for k, v in m.items() if k != "stdout"}}
  said = [l for l in m["stdout"] if FIRST_STEP_LINE in l]
  if said:
    out["first_step_done_self_s"] = float(said[0].split(FIRST_STEP_LINE)[1].split()[0])
  metrics = os.path.join(run_dir, "metrics.jsonl")
  if m["returncode"] != 0 or not os.path.exists(metrics):
    out["error"] = "".join(open(os.path.join(work, f"{tag}.log")).readlines()[-30:])
    return out
  rows = [json.loads(l) for l in open(metrics)]
  rl = sorted((r for r in rows if r.get("phase") == "rl"), key=lambda r: r["step"])
  step = [r["perf/step_time_s"] for r in rl]
  lo, hi = tail_window(args.steps)
  tail = window(rl, lo, hi)
  out.update(step_stats(step, [r["perf/rollout_s"] for r in rl], [r["perf/train_s"] for r in rl],
                        m["wall_s"], m["first_step_done_s"]))
  out.update({
      "wait_median_s": median(window([r["perf/wait_s"] for r in rl], *STEP_WINDOW)),
      "reward_last10": statistics.fmean(r["reward"] for r in tail),
      "chars_last10": statistics.fmean(r["env/metadata/chars"] for r in tail),
      "tokens_last10": statistics.fmean(r["completion_len"] for r in tail),
      "staleness_last_step": rl[-1].get("staleness/first_token/max") if rl else None})
  return out


# -- the driver ----------------------------------------------------------------------------------

# What differs between the two setups, beyond the implementations themselves.
DIFFERENCES = [
    "prompt order: TRL walks the 512 prompts in shuffled epochs (RepeatSampler seeded by its "
    "seed; 64 steps per epoch), jaxrl draws each step's 8 prompts with replacement "
    "(jaxrl.data.sources.SplitSource.sample); jaxrl has no epoch sampler",
    "random streams: torch and JAX sample different completions from the same weights, so "
    "rewards differ side to side as well as seed to seed (pair i runs seed + i on both sides)",
    "prompt padding: TRL left-pads each batch to its longest prompt; jaxrl left-pads every "
    f"prompt to rollout.max_prompt_len={MAX_PROMPT_TOKENS} (one fixed shape, compiled once)",
    "train step layout: jaxrl runs each group's prompt once (train.share_prompts, default on; "
    "the same function) in one micro-batch (train.num_microbatches=1); TRL runs the 64 full rows "
    "in one pass (gradient_accumulation_steps=1)",
    "sampler log-probs: TRL generates without them; jaxrl keeps none at lag 0 "
    "(--config.rollout.logprobs=false: nothing reads them there) and keeps them at lag 1, where "
    "the PPO ratio is taken against them, with train/sampler mismatch metrics every step",
    "PPO ratio at lag 0: both take it against the trainer's own log-probs before the update "
    "(ratio 1, num_iterations=1); jaxrl lag 1 (no TRL equivalent: TRL has no forced lag) trains "
    "on rollouts one update old, the ratio and its clip taken against the sampler's log-probs "
    "(loss.ratio_base=auto)",
    "checkpoint: jaxrl cannot turn checkpoints off; checkpoint.every=0 leaves one asynchronous "
    "save at the end, inside its wall time (TRL: save_strategy='no')",
    "jaxrl writes curves.png (matplotlib), summary.json and config.json at the end, inside its "
    "wall time; validation is off on both (jaxrl: val.at_start/at_end false, val.every past the "
    "last step)",
    "optimizer: TRL adamw_torch_fused with adam_epsilon=1e-8; jaxrl optax.adamw with "
    "train.adam_eps=1e-8",
    "TRL defaults overridden to match the workload: bf16=False and gradient_checkpointing=False "
    "(TRL's defaults are True for both), logging_steps=1, report_to='none', save_strategy='no'",
    "TRL's torch runs with OMP_WAIT_POLICY=PASSIVE (see TRL_ENV)",
]


def summarise(runs: list[dict], lags: list[int]) -> dict:
  """Medians over pairs of each side's numbers, the jaxrl / TRL ratios per lag and the targets.

  Per-step numbers (step time, rollout, train) pool jaxrl's cold and warm runs of a lag (the same
  programs run after step 1); wall time, time to the first step, step 1 and peak RSS are judged
  cold and warm separately. A jaxrl run is deterministic given its seed, so its warm run repeats
  the cold run's rewards exactly: the reward is the cold runs' (one per pair, seeds differ).
  """
  keys = ["wall_s", "first_step_done_s", "step1_s", "step_median_s", "rollout_median_s",
          "train_median_s", "step_late_median_s", "rollout_late_median_s", "train_late_median_s",
          "steps_after_first_s", "outside_steps_s", "peak_rss_tree_mib", "ru_maxrss_mib",
          "reward_last10",
          "chars_last10", "tokens_last10", "load_avg_1m"]

  def pick(side, **match):
    return [r for r in runs if r["side"] == side and "error" not in r
            and all(r.get(k) == v for k, v in match.items())]

  def med(rs):
    return {k: median([r.get(k) for r in rs]) for k in keys} | {"runs": len(rs)}

  def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b

  trl = med(pick("trl"))
  table, ratios, targets = {"trl": trl}, {}, {}
  for lag in lags:
    cold = med(pick("jaxrl", lag=lag, cache="cold"))
    warm = med(pick("jaxrl", lag=lag, cache="warm"))
    both = med(pick("jaxrl", lag=lag))
    table[f"jaxrl_lag{lag}_cold"], table[f"jaxrl_lag{lag}_warm"] = cold, warm
    r = {"step_time": ratio(both["step_median_s"], trl["step_median_s"]),
         "rollout": ratio(both["rollout_median_s"], trl["rollout_median_s"]),
         "train": ratio(both["train_median_s"], trl["train_median_s"]),
         "step_time_late": ratio(both["step_late_median_s"], trl["step_late_median_s"]),
         "rollout_late": ratio(both["rollout_late_median_s"], trl["rollout_late_median_s"]),
         "train_late": ratio(both["train_late_median_s"], trl["train_late_median_s"]),
         "step1_cold": ratio(cold["step1_s"], trl["step1_s"]),
         "step1_warm": ratio(warm["step1_s"], trl["step1_s"]),
         "first_step_done_cold": ratio(cold["first_step_done_s"], trl["first_step_done_s"]),
         "first_step_done_warm": ratio(warm["first_step_done_s"], trl["first_step_done_s"]),
         "wall_cold": ratio(cold["wall_s"], trl["wall_s"]),
         "wall_warm": ratio(warm["wall_s"], trl["wall_s"]),
         "peak_rss_cold": ratio(cold["peak_rss_tree_mib"], trl["peak_rss_tree_mib"]),
         "peak_rss_warm": ratio(warm["peak_rss_tree_mib"], trl["peak_rss_tree_mib"]),
         "reward": ratio(cold["reward_last10"], trl["reward_last10"]),
         "reward_minus_trl": None if cold["reward_last10"] is None or trl["reward_last10"] is None
         else cold["reward_last10"] - trl["reward_last10"]}
    ratios[f"lag{lag}"] = r
    t = TARGETS
    targets[f"lag{lag}"] = {
        f"step_time <= {t['step_time']}": _met(r["step_time"], t["step_time"]),
        f"wall_warm <= {t['wall_warm']}": _met(r["wall_warm"], t["wall_warm"]),
        f"wall_cold <= {t['wall_cold']}": _met(r["wall_cold"], t["wall_cold"]),
        f"peak_rss_warm <= {t['peak_rss']}": _met(r["peak_rss_warm"], t["peak_rss"]),
        f"peak_rss_cold <= {t['peak_rss']}": _met(r["peak_rss_cold"], t["peak_rss"]),
        "reward >= TRL": None if r["reward_minus_trl"] is None else r["reward_minus_trl"] >= 0}
  return {"medians": table, "ratios_jaxrl_over_trl": ratios, "targets_met": targets}


def train_flops_report(result: dict, params: int, peaks: list[dict], lags: list[int]) -> dict:
  """The train step's achieved FLOP/s (`train_step_flops` over the median train time of steps
  2-20, cold and warm runs pooled) against the best f32 matmul rate measured at the start and the
  end of this invocation."""
  step = train_step_flops(params)
  rates = [p["gflops_best"] for p in peaks if "gflops_best" in p]
  peak = max(rates) if rates else None
  # Informational: the same median statistic on both sides (the step's median time against the
  # matmul's median call, the better of the two measurements). The target is set against the
  # best call (`fraction_of_peak`).
  medians = [p["gflops_median"] for p in peaks if "gflops_median" in p]
  typical = max(medians) if medians else None
  out = {"per_step": step, "matmul_peak_gflops": peak, "matmul_median_gflops": typical,
         "matmul_runs": peaks}
  for lag in lags:
    ts = [r.get("train_median_s") for r in result["runs"]
          if r["side"] == "jaxrl" and r.get("lag") == lag and "error" not in r]
    t = median(ts)
    if t:
      gflops = step["flops"] / t / 1e9
      out[f"lag{lag}"] = {"train_median_s": t, "gflops": gflops,
                          "fraction_of_peak": None if not peak else gflops / peak,
                          "fraction_of_median_matmul": None if not typical else gflops / typical}
  return out


def _met(value, bar):
  return None if value is None else value <= bar


def machine() -> dict:
  model = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
  except OSError:
    pass
  return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
          "load_avg_at_start": os.getloadavg()}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--pairs", type=int, default=3, help="TRL / jaxrl pairs (medians over them)")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--lags", default="0,1", help="jaxrl rollout.lag values, comma-separated")
  p.add_argument("--seed", type=int, default=0,
                 help="both sides' run seed in pair 0; pair i uses seed + i")
  p.add_argument("--quick", action="store_true", help="smoke run: 20 steps, 1 pair")
  p.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON)
  p.add_argument("--jaxrl-python", default=sys.executable)
  p.add_argument("--keep", default="", help="keep model, logs and run dirs in this directory")
  p.add_argument("--skip-trl", action="store_true", help="jaxrl runs only (debugging)")
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.pairs = 20, 1
  lags = [int(x) for x in args.lags.split(",") if x.strip()]
  work = args.keep or tempfile.mkdtemp(prefix="jaxrl-vs-trl-")
  os.makedirs(work, exist_ok=True)
  model_dir = os.path.join(work, "model")
  make = [args.trl_python, os.path.abspath(__file__), "make-model", model_dir]
  log(f"vs_trl: work dir {work}; writing the model with {args.trl_python}")
  made = subprocess.run(make, cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, HF_HUB_OFFLINE="1"))
  if made.returncode != 0:
    sys.exit(f"vs_trl: make-model failed:\n{made.stdout}{made.stderr}")
  model_info = json.loads(made.stdout.strip().splitlines()[-1])
  log(f"vs_trl: model {model_info['params']:,} params, files {model_info['files']}")
  started = datetime.datetime.now().isoformat(timespec="seconds")
  info = machine()
  runs = []
  peaks = [measure_peak(args)]
  log(f"vs_trl: f32 matmul {PEAK_MATMUL_N}^3: {peaks[0].get('gflops_best', 0):.1f} GFLOP/s best, "
      f"{peaks[0].get('gflops_median', 0):.1f} median")

  def record(r):
    runs.append(r)
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
             if k in ("wall_s", "first_step_done_s", "step1_s", "step_median_s",
                      "peak_rss_tree_mib", "reward_last10", "chars_last10", "error")}
    log(f"vs_trl: {r['tag']}: {json.dumps(brief)}")

  for pair in range(args.pairs):
    seed = args.seed + pair  # both sides; independent samples across pairs
    def trl_part():
      if not args.skip_trl:
        record(trl_run(args, model_dir, work, f"pair{pair}-trl", seed))

    def jaxrl_part():
      for lag in lags:
        cache = os.path.join(work, f"xla-cache-pair{pair}-lag{lag}")  # fresh: cold
        for state in ("cold", "warm"):
          r = jaxrl_run(args, model_dir, work, f"pair{pair}-jaxrl-lag{lag}-{state}", cache, lag,
                        seed)
          r["cache"] = state
          record(r)

    for part in ((trl_part, jaxrl_part) if pair % 2 == 0 else (jaxrl_part, trl_part)):
      part()

  peaks.append(measure_peak(args))
  log(f"vs_trl: f32 matmul {PEAK_MATMUL_N}^3: {peaks[1].get('gflops_best', 0):.1f} GFLOP/s best, "
      f"{peaks[1].get('gflops_median', 0):.1f} median")
  example_jaxrl = jaxrl_command(args, "<model>", "<run_dir>", "<fresh cache dir>", 0, args.seed)
  result = {
      "benchmark": "vs_trl", "date": started, "machine": info,
      "load_avg_at_end": os.getloadavg(),
      "argv": [sys.executable, *sys.argv], "work_dir": work, "model": model_info,
      "workload": {"tokens": TOKENS, "prompts": NUM_PROMPTS, "prompt_seed": PROMPT_SEED,
                   "model": MODEL, "grpo": GRPO, "steps": args.steps},
      "commands": {"make_model": shlex.join(make),
                   "trl": next((r["command"] for r in runs if r["side"] == "trl"), None),
                   "jaxrl": shlex.join(example_jaxrl),
                   "jaxrl_warm": "the same jaxrl command again with the same compile_cache"},
      "step_window": list(STEP_WINDOW), "late_steps_from": LATE_FROM,
      "reward_window": list(tail_window(args.steps)),
      **summarise(runs, lags), "differences": DIFFERENCES, "runs": runs,
  }
  result["train_flops"] = train_flops_report(result, model_info["params"], peaks, lags)
  for lag in lags:
    frac = result["train_flops"].get(f"lag{lag}", {}).get("fraction_of_peak")
    result["targets_met"][f"lag{lag}"][f"train FLOP/s >= {TARGETS['flops_fraction']} x matmul "
                                        f"peak"] = (None if frac is None
                                                    else frac >= TARGETS["flops_fraction"])
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "make-model":
    print(json.dumps(make_model(sys.argv[2])))
  elif len(sys.argv) > 1 and sys.argv[1] == "matmul-peak":
    print(json.dumps(matmul_peak()))
  elif len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
    w = argparse.ArgumentParser()
    w.add_argument("--model", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    a = w.parse_args(sys.argv[2:])
    trl_worker(a.model, a.out, a.steps, a.seed)
  else:
    main()
