"""`engram serve [MODEL]`: the OpenAI-compatible server (FastAPI + uvicorn).

MODEL is a preset name (default: the built-in ``tiny``) or a checkpoint directory. The model loads on the
engine thread after the port is open, so /health answers 503 until it is ready. SIGTERM (or Ctrl-C) stops
accepting connections, lets in-flight streams finish, then exits.
"""
from __future__ import annotations

import argparse
import sys

HELP = "serve a model over the OpenAI API (default: the built-in tiny model)"

EXAMPLES = """examples:
  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "prompt": "The tables are", "max_tokens": 16, "temperature": 0}}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://{host}:{port}/v1', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='The tables are', max_tokens=16).choices[0].text)"
"""


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by serve, generate and bench: model, tier, dtype, --engram-config."""
    p.add_argument("model", nargs="?", default="tiny", help="preset (tiny, small, 4b-like, 8b-like) or checkpoint dir")
    p.add_argument("--tier", choices=["gpu", "host", "disk"], default="gpu",
                   help="where Engram tables live (gpu: device memory, or RAM without CUDA)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--engram-config", default=None, metavar="JSON",
                   help='runtime options, e.g. \'{"cpu_offload": true}\' (= tier host), cache_rows, io, queue_depth')
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step, at most")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step, at most")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: MODEL)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond --max-num-seqs before new ones get 503 + Retry-After")
    p.add_argument("--log-level", default="info")


def build_llm_factory(args: argparse.Namespace):
    """A zero-argument function that loads the model as the command line says (runs on the engine thread)."""
    from engram.server.app import parse_engram_config

    options = parse_engram_config(args.engram_config)
    engine_options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "max_model_len": args.max_model_len}

    def build():
        from engram.engine.llm import LLM

        return LLM(model=args.model, tier=args.tier, dtype=args.dtype, engram_config=options, **engine_options)

    return build


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from engram.server.app import build_app

    try:
        build = build_llm_factory(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model)
                                      else args.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(build, name, args.tier, args.max_num_seqs, args.max_waiting)
    print(f"engram: serving {name!r} on http://{args.host}:{args.port} (GET /health turns 200 when loaded)\n"
          + EXAMPLES.format(host=args.host, port=args.port, model=name), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=60)
    return 0
