"""Load on the standalone OpenAI-compatible server: N concurrent clients for T seconds.

    python benchmarks/openai_load.py make-model runs/tiny-qwen      # a tiny random model
    python benchmarks/openai_load.py run --hf runs/tiny-qwen [--clients 64] [--seconds 60]
    python benchmarks/openai_load.py run --hf runs/tiny-qwen --quick  # 8 clients, 10 s
    python benchmarks/openai_load.py run --url http://host:port/v1 --model NAME  # any server

`run --hf` starts `python -m jaxrl.serve --openai --hf DIR --port 0` as a child process, waits for
it to listen, then runs the clients (the `openai` package's `AsyncOpenAI`, one event loop): each
sends chat completions back to back until the time is up. When the time is up no new request is
sent and the ones in flight are awaited (up to `--grace` seconds). Printed as JSON:

- `requests` sent, `ok`, `errors` (an exception or a non-2xx status, with the first few
  messages), `lost` (sent but neither answered nor failed by the end of the grace period);
- latency p50/p99/max in seconds, completion tokens/s and requests/s over the measured window;
- the server's resident memory (`/proc/<pid>/status`): after warm-up, at the end, its peak
  (`VmHWM`), and the peak over the second half of the run next to the first half's (bounded
  memory: the two halves match when nothing accumulates per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["What is 12 + 30? The answer is 42.", "Use the calculator tool to add numbers.",
          "The quick brown fox jumps over the lazy dog.", "0 1 2 3 4 5 6 7 8 9 + - * / = ( )"]
PROMPTS = [f"What is {a} + {b}?" for a in range(10) for b in range(10)]


def make_model(path: str, seed: int = 0) -> str:
  """A tiny random Qwen2-style model with a byte-level BPE tokenizer and a ChatML template, in
  Hugging Face files."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from jaxrl.models import ModelConfig, init_model
  from jaxrl.models.hf_checkpoint import save_hf

  os.makedirs(path, exist_ok=True)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
      vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok.add_special_tokens(specials)
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
            "chat_template": CHATML, "added_tokens_decoder": {
                str(tok.token_to_id(s)): {"content": s, "special": True} for s in specials}}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  vocab = tok.get_vocab_size(with_added_tokens=True)
  cfg = ModelConfig(vocab_size=vocab, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, qkv_bias=True, tie_embeddings=True)
  save_hf(path, cfg, init_model(cfg, seed=seed)[1], architecture="Qwen2ForCausalLM")
  return path


def rss(pid: int) -> dict[str, int]:
  """VmRSS and VmHWM (peak) of a process, in bytes."""
  out = {}
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      m = re.match(r"(VmRSS|VmHWM):\s+(\d+) kB", line)
      if m:
        out[m.group(1)] = int(m.group(2)) * 1024
  return out


def start_server(args) -> tuple[subprocess.Popen, str, str]:
  cmd = [sys.executable, "-m", "jaxrl.serve", "--openai", "--hf", args.hf, "--port", "0",
         "--num_slots", str(args.num_slots), "--max_prompt_len", str(args.max_prompt_len),
         "--max_new_tokens", str(args.max_new_tokens), "--model", "bench"]
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:
    lines.append(line)
    m = re.search(r"at (http://\S+/v1)", line)
    if m:
      # Keep draining stderr so the child never blocks on a full pipe.
      threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
      return proc, m.group(1), "bench"
  raise RuntimeError(f"the server did not start ({' '.join(cmd)}):\n{''.join(lines)}")


async def load(url: str, model: str, clients: int, seconds: float, grace: float,
               max_tokens: int, on_half=None) -> dict:
  import openai

  client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                              timeout=seconds + grace)
  stats = {"sent": 0, "ok": 0, "errors": 0, "tokens": 0, "latency": [], "messages": []}
  t0 = time.monotonic()
  end = t0 + seconds

  async def one_client(c: int):
    i = c
    while time.monotonic() < end:
      stats["sent"] += 1
      t = time.monotonic()
      try:
        r = await client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=1.0,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        stats["ok"] += 1
        stats["tokens"] += r.usage.completion_tokens
        stats["latency"].append(time.monotonic() - t)
      except Exception as e:  # noqa: BLE001  (counted and reported)
        stats["errors"] += 1
        if len(stats["messages"]) < 5:
          stats["messages"].append(f"{type(e).__name__}: {e}")
      i += clients

  async def halfway():
    await asyncio.sleep(seconds / 2)
    if on_half:
      on_half()

  tasks = [asyncio.create_task(one_client(c)) for c in range(clients)]
  half = asyncio.create_task(halfway())
  done, pending = await asyncio.wait(tasks, timeout=seconds + grace)
  for t in pending:
    t.cancel()
  half.cancel()
  wall = time.monotonic() - t0
  lat = sorted(stats["latency"])
  q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None
  return {"clients": clients, "seconds": seconds, "requests": stats["sent"], "ok": stats["ok"],
          "errors": stats["errors"], "error_messages": stats["messages"],
          "lost": stats["sent"] - stats["ok"] - stats["errors"],
          "latency_p50_s": q(0.5), "latency_p99_s": q(0.99), "latency_max_s": lat[-1] if lat
          else None, "completion_tokens_per_s": stats["tokens"] / wall,
          "requests_per_s": stats["ok"] / wall, "wall_s": wall}


def run(args) -> dict:
  if args.quick:
    args.clients, args.seconds = 8, 10.0
  proc = None
  if args.url:
    url, model = args.url, args.model
  else:
    proc, url, model = start_server(args)
  try:
    mem: dict[str, object] = {}
    if proc:
      mem["after_warmup"] = rss(proc.pid)["VmRSS"]
      peaks = []

      def sample():  # the highest VmRSS seen in each half of the run
        while proc.poll() is None and not stop.is_set():
          peaks.append(rss(proc.pid)["VmRSS"])
          time.sleep(0.25)

      stop = threading.Event()
      sampler = threading.Thread(target=sample, daemon=True)
      sampler.start()
      split = []
      result = asyncio.run(load(url, model, args.clients, args.seconds, args.grace,
                                args.max_tokens, on_half=lambda: split.append(len(peaks))))
      stop.set()
      sampler.join()
      k = split[0] if split else len(peaks) // 2
      m = rss(proc.pid)
      mem.update(end=m["VmRSS"], peak=m["VmHWM"], first_half_peak=max(peaks[:k] or [0]),
                 second_half_peak=max(peaks[k:] or [0]))
    else:
      result = asyncio.run(load(url, model, args.clients, args.seconds, args.grace,
                                args.max_tokens))
    result["server_rss_bytes"] = mem
    result["server_alive"] = proc.poll() is None if proc else None
    result["settings"] = {k: getattr(args, k) for k in ("num_slots", "max_prompt_len",
                                                        "max_new_tokens", "max_tokens")}
    return result
  finally:
    if proc is not None:
      proc.terminate()
      proc.wait(30)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/openai_load.py")
  sub = p.add_subparsers(dest="cmd", required=True)
  m = sub.add_parser("make-model", help="write a tiny random Qwen2-style model directory")
  m.add_argument("path")
  r = sub.add_parser("run", help="load a server with concurrent clients")
  src = r.add_mutually_exclusive_group(required=True)
  src.add_argument("--hf", help="serve this Hugging Face directory with python -m jaxrl.serve")
  src.add_argument("--url", help="a running server's base URL (.../v1)")
  r.add_argument("--model", default="bench", help="model name with --url")
  r.add_argument("--clients", type=int, default=64)
  r.add_argument("--seconds", type=float, default=60.0)
  r.add_argument("--quick", action="store_true", help="8 clients for 10 s")
  r.add_argument("--grace", type=float, default=60.0, help="seconds to await requests in flight")
  r.add_argument("--num_slots", type=int, default=16)
  r.add_argument("--max_prompt_len", type=int, default=64)
  r.add_argument("--max_new_tokens", type=int, default=32)
  r.add_argument("--max_tokens", type=int, default=32, help="each request's max_tokens")
  r.add_argument("--out", default=None, help="also write the JSON here")
  args = p.parse_args(argv)
  if args.cmd == "make-model":
    print(make_model(args.path))
    return 0
  result = run(args)
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0 if result["errors"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
  sys.exit(main())
