"""Serve a run's checkpoint, or a Hugging Face model, over an OpenAI-compatible HTTP API:

    python -m jaxrl.serve --openai --run RUN_DIR [--step N] [--port 8000]
    python -m jaxrl.serve --openai --hf MODEL_DIR [--model NAME] [--max_prompt_len 1024] ...

Any OpenAI client then talks to `http://HOST:PORT/v1` (`/v1/chat/completions`,
`/v1/completions`, `/v1/models`; see `jaxrl.serving.openai` and docs/serving.md). `--run` reads
the policy of checkpoint `--step` (default: the latest) of a run started from a Hugging Face
model, with the tokenizer and chat template the run kept (`<run_dir>/hf_base/`); `--hf` reads a
Hugging Face directory (config.json, *.safetensors, tokenizer files). The served model's name is
`--model` (default: the directory's name).

An error the user can fix ends as one line `jaxrl: ...` with exit status 1 before anything is
compiled; `--debug` or `JAXRL_DEBUG=1` shows its traceback.
"""

from __future__ import annotations

import os
import sys

from jaxrl.cli import common
from jaxrl.core.errors import UserError


def parser() -> common.ArgumentParser:
  p = common.ArgumentParser(prog="python -m jaxrl.serve",
                            description="Serve a jaxrl checkpoint or a Hugging Face model over "
                                        "an OpenAI-compatible HTTP API.")
  p.add_argument("--openai", action="store_true", help="serve the OpenAI-compatible API "
                 "(/v1/chat/completions, /v1/completions, /v1/models)")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--run", help="run directory (a run started from a Hugging Face model)")
  src.add_argument("--hf", help="Hugging Face model directory (config.json, *.safetensors, "
                   "tokenizer files)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step with --run (default: "
                 "the latest)")
  p.add_argument("--model", default=None, help="the model name clients ask for (default: the "
                 "directory's name)")
  p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
  p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
  p.add_argument("--num_slots", type=int, default=8, help="requests decoded at once (default 8)")
  p.add_argument("--max_prompt_len", type=int, default=1024, help="longest prompt in tokens "
                 "(default 1024)")
  p.add_argument("--max_new_tokens", type=int, default=256, help="longest reply in tokens "
                 "(default 256; a request's max_tokens may only lower it)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
  p.add_argument("--dtype", default=None, help="parameter dtype with --hf (default: the "
                 "checkpoint's)")
  return p


def check(args) -> None:
  """Flag problems, before anything is loaded or compiled."""
  if not args.openai:
    raise UserError("python -m jaxrl.serve: name the protocol to serve: --openai")
  if not (args.run or args.hf):
    raise UserError("python -m jaxrl.serve: give --run <run dir> or --hf <model dir>")
  if args.step is not None and not args.run:
    raise UserError("python -m jaxrl.serve: --step needs --run")
  for name in ("num_slots", "max_prompt_len", "max_new_tokens"):
    if getattr(args, name) < 1:
      raise UserError(f"python -m jaxrl.serve: --{name}={getattr(args, name)} must be >= 1")
  if not 0 <= args.port < 65536:
    raise UserError(f"python -m jaxrl.serve: --port={args.port} must be in [0, 65535]")
  path = args.run or args.hf
  if not os.path.isdir(path):
    raise UserError(f"{path} is not a directory")


def load(args):
  """-> (graphdef, params, tokenizer, model name)."""
  from jaxrl.data.hf_tokenizer import HFTokenizer

  if args.hf:
    from jaxrl.models.hf_checkpoint import load_hf

    _, graphdef, params = load_hf(args.hf, param_dtype=args.dtype)
    tok_dir, name = args.hf, args.hf
  else:
    from jaxrl.cli.export import restore_run
    from jaxrl.run.directory import METADATA_DIR

    _, _, _, graphdef, step, params = restore_run(args.run, args.step)
    tok_dir, name = os.path.join(args.run, METADATA_DIR), args.run
    print(f"jaxrl.serve: {args.run} step {step}", file=sys.stderr)
  tok = HFTokenizer.from_dir(tok_dir)
  return graphdef, params, tok, args.model or os.path.basename(os.path.abspath(name))


def build(args):
  """The server `args` describe (loaded and warmed up), not yet serving."""
  check(args)
  from jaxrl.serving.openai import OpenAIServer  # the serve extra

  graphdef, params, tok, name = load(args)
  return OpenAIServer(graphdef, params, tok, model=name, num_slots=args.num_slots,
                      max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                      seed=args.seed)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser().parse_args(argv)
  debug = common.debug_requested(args.debug)
  try:
    server = build(args).start(args.host, args.port)
    print(f"jaxrl.serve: serving {server.model!r} at {server.url}", file=sys.stderr, flush=True)
    server.wait()
  except Exception as e:
    message = None if debug else common.user_message(e)
    if message is None:
      raise
    print(message, file=sys.stderr)
    return 1
  return 0
