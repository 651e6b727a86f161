"""`engram serve [MODEL]`: the OpenAI-compatible server (FastAPI + uvicorn).

MODEL is a preset name (default: the built-in ``tiny``) or a checkpoint directory. The model loads on the
engine thread after the port is open, so /health answers 503 until it is ready. If it fails to load (an
unknown model, a device that is not there, a --max-model-len the model cannot take, ...) the server prints
the reason and exits with status 1, so a supervisor sees the failure and can restart it. A bad option
value exits with status 2 before the port opens. SIGTERM (or Ctrl-C) stops accepting connections, lets
in-flight streams finish, then exits.
"""
from __future__ import annotations

import argparse
import sys

from engram.commands.options import add_engine_arguments, add_model_arguments, build_llm, parse_engram_config
from engram.server import DEFAULT_MAX_REQUEST_BYTES

HELP = "serve a model over the OpenAI API (default: the built-in tiny model)"

EXAMPLES = """examples:
  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "prompt": "The tables are", "max_tokens": 16, "temperature": 0}}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://{host}:{port}/v1', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='The tables are', max_tokens=16).choices[0].text)"
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: MODEL)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond --max-num-seqs before new ones get 503 + Retry-After")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="larger request bodies get 413 before they are parsed (default: %(default)s)")
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from engram.server.app import build_app

    from engram.engine.options import RuntimeOptions

    try:
        RuntimeOptions.from_dict(parse_engram_config(args.engram_config))  # fail now, not on the engine thread
        if args.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes={args.max_request_bytes} must be >= 1")
    except ValueError as e:
        print(f"engram serve: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model)
                                      else args.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: uvicorn.Server | None = None

    def load_failed(reason: str) -> None:  # engine thread: stop serving; run() below then exits 1
        print(f"engram serve: error: {reason}", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    def load():  # engine thread; this process is the engine's: full collections skip the start-up heap
        from engram.engine.heap import freeze_startup_heap

        llm = build_llm(args)
        freeze_startup_heap()
        return llm

    app = build_app(load, name, args.tier, args.max_num_seqs, args.max_waiting,
                    args.max_request_bytes, on_load_error=load_failed)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=60))
    print(f"engram: serving {name!r} on http://{args.host}:{args.port} (GET /health turns 200 when loaded)\n"
          + EXAMPLES.format(host=args.host, port=args.port, model=name), flush=True)
    server.run()
    if app.state.engine.load_error is not None:
        return 1
    if not server.started:  # e.g. the port is taken (uvicorn logged why)
        print(f"engram serve: error: could not listen on {args.host}:{args.port}", file=sys.stderr)
        return 1
    return 0
