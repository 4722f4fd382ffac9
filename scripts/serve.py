#!/usr/bin/env python3
"""Serve a jaxrl model over gRPC with JetStream (google-jetstream 0.2.2, the `jetstream` extra).

    python scripts/serve.py --hf_path models/Qwen2.5-0.5B-Instruct --port 9000
    python scripts/serve.py --run_dir runs/qwen-gsm8k --step 200 --chat --port 9000

The model is either a Hugging Face directory (`--hf_path`: config.json, safetensors, tokenizer
files) or a checkpoint of a jaxrl run started from one (`--run_dir`, latest step unless
`--step`): the run's `hf_base/` copy of the starting directory gives the architecture and the
tokenizer, the checkpoint the weights. It is wrapped in `jaxrl.serving.jetstream_engine.
JaxrlJetStreamEngine` (jaxrl's slot engine behind JetStream's Engine API) and served by
JetStream's orchestrator and gRPC server (`jetstream.core.server_lib`, service
`jetstream_proto.Orchestrator`, methods `Decode` and `HealthCheck`) on `--host:--port`.

Requests (`jetstream.core.proto.jetstream_pb2.DecodeRequest`) carry text (encoded by the
model's tokenizer: raw text by default, one user turn through the chat template with `--chat`)
or token ids (used verbatim), and `max_tokens` (capped by `--max_new_tokens`). Responses stream
the generated token ids and their text; the end token is not streamed. Sampling is the same for
every request (`--temperature 0`, the default, is greedy).

Every program is compiled before the port opens (prefill per prompt-length bucket, insert,
generate), so a broken model fails here with a traceback rather than inside the server's threads
(where JetStream kills the process). "serving on HOST:PORT" is printed once the server accepts
requests. SIGTERM or SIGINT stops it (the driver threads, then the gRPC server) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="scripts/serve.py", description=__doc__,
      epilog="gRPC service jetstream_proto.Orchestrator (Decode, HealthCheck); clients: "
             "jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub. Needs the jetstream "
             "extra: scripts/install_jetstream.sh.",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--hf_path", help="a Hugging Face model directory (Llama / Qwen2 / Qwen3: "
                   "config.json, model.safetensors, tokenizer.json)")
  src.add_argument("--run_dir", help="a jaxrl run directory started from a Hugging Face model "
                   "(holds config.json, hf_base/ and checkpoints/)")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step of --run_dir (default: the latest)")
  p.add_argument("--host", default="127.0.0.1",
                 help="address to bind (default: %(default)s; 0.0.0.0 or :: for all)")
  p.add_argument("--port", type=int, default=9000, help="gRPC port (default: %(default)s)")
  p.add_argument("--slots", type=int, default=8,
                 help="concurrent requests, i.e. decode slots (default: %(default)s)")
  p.add_argument("--max_prompt_len", type=int, default=256,
                 help="longest prompt in tokens, rounded up to JetStream's next bucket "
                      "(16, 32, ..., 32768); longer prompts keep their last tokens "
                      "(default: %(default)s)")
  p.add_argument("--max_new_tokens", type=int, default=256,
                 help="most tokens generated per request; a request's max_tokens can lower it "
                      "(default: %(default)s)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature; 0: greedy (default: %(default)s)")
  p.add_argument("--top_k", type=int, default=0,
                 help="top-k sampling; 0: off (default: %(default)s)")
  p.add_argument("--top_p", type=float, default=1.0,
                 help="nucleus sampling; 1: off (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="sampling seed; request r draws with fold_in(key(seed), r) "
                      "(default: %(default)s)")
  p.add_argument("--chat", action="store_true",
                 help="encode text prompts as one user turn through the model's chat template "
                      "(with --run_dir: and the run's system prompt)")
  p.add_argument("--param_dtype", default=None, choices=["float32", "bfloat16", "float16"],
                 help="parameter dtype (default: the checkpoint's)")
  p.add_argument("--threads", type=int, default=None,
                 help="gRPC handler threads (default: max(slots, 64))")
  p.add_argument("--log_level", default="WARNING",
                 help="Python logging level; INFO logs every JetStream generate step "
                      "(default: %(default)s)")
  return p.parse_args(argv)


def load_hf_dir(path: str, param_dtype: str | None, chat: bool):
  """-> (graphdef, params, tokenizer) of a Hugging Face model directory."""
  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.models.hf_checkpoint import load_hf

  _, graphdef, params = load_hf(path, param_dtype=param_dtype)
  # Without --chat only `encode` is used, so a directory without a template serves too.
  return graphdef, params, HFTokenizer.from_dir(path, use_chat_template=True if chat else None)


def load_run(run_dir: str, step: int | None, param_dtype: str | None, chat: bool):
  """-> (graphdef, params, tokenizer, step) of a checkpoint of a run started from a Hugging
  Face model; only the policy parameters are restored, onto one device."""
  import jax

  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.cli.export import METADATA_DIR, restore_run
  from jaxrl.models import abstract_model

  run_cfg, _, cfg, graphdef, step, params = restore_run(run_dir, step)
  base = os.path.join(run_dir, METADATA_DIR)
  if param_dtype is not None and param_dtype != cfg.param_dtype:
    import dataclasses

    cfg = dataclasses.replace(cfg, param_dtype=param_dtype, dtype=param_dtype)
    graphdef, _ = abstract_model(cfg)
    params = jax.tree.map(lambda x: x.astype(param_dtype), params)
  tok_cfg = run_cfg.get("tokenizer", {})
  options = {}
  if chat:
    options = dict(use_chat_template=True,
                   system_prompt=tok_cfg.get("system_prompt") or None)
  return graphdef, params, HFTokenizer.from_dir(base, **options), step


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(),
                      format="%(asctime)s %(name)s %(levelname)s %(message)s")
  try:
    from jaxrl.serving.jetstream_engine import JaxrlJetStreamEngine, run_server
  except ImportError as e:
    print(f"serve.py: JetStream is not installed ({e}); run scripts/install_jetstream.sh",
          file=sys.stderr)
    return 2

  t0 = time.time()
  try:
    if args.hf_path:
      graphdef, params, tokenizer = load_hf_dir(args.hf_path, args.param_dtype, args.chat)
      source = args.hf_path
    else:
      graphdef, params, tokenizer, step = load_run(args.run_dir, args.step, args.param_dtype,
                                                   args.chat)
      source = f"{args.run_dir} step {step}"
  except (FileNotFoundError, ValueError, NotImplementedError) as e:
    print(f"serve.py: {e}", file=sys.stderr)
    return 1
  engine = JaxrlJetStreamEngine(graphdef, params, tokenizer, num_slots=args.slots,
                                max_prompt_len=args.max_prompt_len,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                chat=args.chat)
  engine.warmup()
  print(f"serve.py: loaded and compiled {source} in {time.time() - t0:.1f} s", flush=True)

  stop = threading.Event()
  # Handlers only set the event: stopping the server from inside a signal handler would run
  # its thread joins on whatever frame the signal interrupted.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  server = run_server(engine, host=args.host, port=args.port, threads=args.threads)
  print(f"serve.py: serving on {args.host}:{args.port} ({args.slots} slots, max_prompt_len "
        f"{engine.max_prefill_length}, max_new_tokens {args.max_new_tokens})", flush=True)
  while not stop.wait(1.0):
    pass
  print("serve.py: stopping", flush=True)
  server.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())
