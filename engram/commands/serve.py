"""`engram serve [MODEL]`: the OpenAI-compatible server (FastAPI + uvicorn).

MODEL is a preset name (default: the built-in ``tiny``) or a checkpoint directory. Every option value is
checked first: a bad one exits with status 2 before the port opens. Then the port is tried (one in use, or
an address that is not this machine's, exits with status 3) and the model loads in the engine process while
the port is open, so /health answers 503 until it is ready. If it fails to load (an unknown model, a device
that is not there, a --max-model-len the model cannot take, ...) the server prints the reason and exits
with status 1, so a supervisor sees the failure and can restart it; an engine process, tensor-parallel rank,
pipeline stage or data-parallel replica that dies once serving fails the requests in flight and the server exits with
status 4. SIGTERM (or Ctrl-C)
stops accepting connections, answers requests still sending their body with 503, lets in-flight generations finish
for up to --timeout-graceful-shutdown seconds (then cancels them), and exits by that signal. Slow clients are cut
off: a request's line and headers must arrive within --timeout-request-headers seconds, its body within
--timeout-request-body seconds (else 408 and the connection closes), and an idle connection is closed after
--timeout-keep-alive seconds.

exit status: 0 stopped, 1 the model failed to load, 2 a bad option value, 3 the port could not be bound, 4 the
engine failed for good (the engine process, a tensor-parallel rank, a pipeline stage or a data-parallel replica
died);
after SIGTERM / SIGINT the process ends by that signal (143 / 130 in a shell).
"""
from __future__ import annotations

import argparse
import functools
import sys

from engram.commands.options import (add_engine_arguments, add_model_arguments, build_llm, check_options,
                                     run_torchrun_rank)
from engram.server import DEFAULT_MAX_REQUEST_BYTES

EXIT_LOAD_FAILED, EXIT_BAD_OPTION, EXIT_CANNOT_LISTEN, EXIT_ENGINE_FAILED = 1, 2, 3, 4

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
    t = p.add_argument_group("timeouts (seconds)")
    t.add_argument("--timeout-graceful-shutdown", type=float, default=60.0, metavar="S",
                   help="after SIGTERM, in-flight requests may run this long before they are cancelled "
                        "(default: %(default)g)")
    t.add_argument("--timeout-request-headers", type=float, default=10.0, metavar="S",
                   help="a request's line and headers must arrive within this, else 408 (default: %(default)g)")
    t.add_argument("--timeout-request-body", type=float, default=30.0, metavar="S",
                   help="a request's body must arrive within this after its headers, else 408 (default: %(default)g)")
    t.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="an idle connection is closed after this (default: %(default)g)")


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from engram.server.app import build_app
    from engram.server.http import DrainingServer, HttpLimits, check_port, server_config

    try:
        check_options(args)  # fail now, not in the engine process after the port opened
        if args.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes={args.max_request_bytes} must be >= 1")
        if args.max_waiting < 0:
            raise ValueError(f"--max-waiting={args.max_waiting} must be >= 0")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port={args.port} must be in [0, 65535]")
        limits = HttpLimits(graceful_shutdown=args.timeout_graceful_shutdown, keep_alive=args.timeout_keep_alive,
                            request_headers=args.timeout_request_headers, request_body=args.timeout_request_body)
    except ValueError as e:
        print(f"engram serve: error: {e}", file=sys.stderr)
        return EXIT_BAD_OPTION
    if run_torchrun_rank(args):  # a torchrun rank other than 0 serves rank 0's steps, no port
        return 0
    try:
        check_port(args.host, args.port)  # before anything loads: a port in use fails at once
    except OSError as e:
        return _cannot_listen(args, e)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model)
                                      else args.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: DrainingServer | None = None

    def load_failed(reason: str) -> None:  # the engine client's reader thread: stop serving; run() below then exits 1 (or 4)
        print(f"engram serve: error: {reason}", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    app = build_app(functools.partial(load_engine, args), name, args.tier, args.max_num_seqs, args.max_waiting,
                    args.max_request_bytes, on_load_error=load_failed, body_timeout=limits.request_body,
                    on_fatal=load_failed)
    server = DrainingServer(server_config(app, args.host, args.port, args.log_level, limits),
                            on_shutdown=app.state.stopping.set)
    print(f"engram: serving {name!r} on http://{args.host}:{args.port} (GET /health turns 200 when loaded)\n"
          + EXAMPLES.format(host=args.host, port=args.port, model=name), flush=True)
    try:
        server.run()
    except SystemExit as e:  # uvicorn's startup failure: the port was taken since check_port (uvicorn said why)
        if e.code != EXIT_CANNOT_LISTEN:
            raise
        return _cannot_listen(args, "see the error above")
    if app.state.engine.load_error is not None:
        return EXIT_LOAD_FAILED
    if app.state.engine.fatal_error is not None:
        return EXIT_ENGINE_FAILED
    return 0


def load_engine(args: argparse.Namespace):
    """The engine's LLM, built in the engine process (a module-level function, so it crosses the spawn); that process
    is the engine's: full collections skip the start-up heap."""
    from engram.engine.heap import freeze_startup_heap

    llm = build_llm(args)
    freeze_startup_heap()
    return llm


def _cannot_listen(args: argparse.Namespace, why: object) -> int:
    print(f"engram serve: error: cannot listen on {args.host}:{args.port}: {why}", file=sys.stderr, flush=True)
    return EXIT_CANNOT_LISTEN
