"""Time to the first streamed token on the standalone OpenAI-compatible server.

    python benchmarks/openai_load.py make-model runs/tiny-qwen      # a tiny random model
    python benchmarks/openai_stream.py --hf runs/tiny-qwen [--requests 20] [--max_tokens 128]

Starts `python -m jaxrl.serve --openai --hf DIR --port 0` as a child process (as
`openai_load.py run` does), then sends `--requests` streamed chat completions one after another
with the `openai` client (temperature 1) and times, per request, the first event that carries a
token (`token_ids`) and the whole stream. Printed as JSON: the medians and maxima of both, the
median completion length, and their ratio (first token / whole reply; 1.0 when the reply is sent
only once its row has ended).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from openai_load import PROMPTS, start_server


def measure(url: str, model: str, requests: int, max_tokens: int) -> dict:
  import openai

  client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
  client.chat.completions.create(model=model, max_tokens=max_tokens,  # warm-up, not timed
                                 messages=[{"role": "user", "content": PROMPTS[0]}])
  first, total, lengths = [], [], []
  for i in range(requests):
    t0, t_first, n = time.monotonic(), None, 0
    for chunk in client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=1.0, stream=True,
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]):
      got = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
      if got:
        n += len(got)
        if t_first is None:
          t_first = time.monotonic() - t0
    total.append(time.monotonic() - t0)
    first.append(t_first if t_first is not None else total[-1])
    lengths.append(n)
  med = statistics.median
  return {"requests": requests, "max_tokens": max_tokens, "median_tokens": med(lengths),
          "first_token_s": {"p50": round(med(first), 4), "max": round(max(first), 4)},
          "whole_reply_s": {"p50": round(med(total), 4), "max": round(max(total), 4)},
          "first_over_whole_p50": round(med(f / t for f, t in zip(first, total)), 3)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hf", required=True, help="a Hugging Face model directory to serve")
  p.add_argument("--requests", type=int, default=20)
  p.add_argument("--max_tokens", type=int, default=128)
  p.add_argument("--num_slots", type=int, default=8)
  p.add_argument("--max_prompt_len", type=int, default=64)
  args = p.parse_args(argv)
  args.max_new_tokens = args.max_tokens
  proc, url, model = start_server(args)
  try:
    print(json.dumps(measure(url, model, args.requests, args.max_tokens), indent=1))
  finally:
    proc.terminate()
    proc.wait(30)
  return 0


if __name__ == "__main__":
  sys.exit(main())
