"""``engram bench serve``: hold N concurrent streaming requests against a server for a fixed time: ``engram serve`` on a
free port (or ``--url``), ``--concurrency`` workers sending completions back to back for ``--duration`` seconds, prompts
from a checked corpus (``--corpus``, default bench/corpus/natural-v1.jsonl) shuffled by ``--seed``. Reports errors,
throughput and TTFT / TPOT percentiles as JSON (``--out``) and a table."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np

HELP = "serving load: N concurrent streams for a fixed time; throughput, TTFT/TPOT percentiles, errors"
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "bench" / "corpus" / "natural-v1.jsonl"


def corpus_prompts(path: str | os.PathLike | None = None, seed: int = 0) -> tuple[list[str], str]:
    """The corpus's prompts in ``default_rng(seed).permutation`` order, and its SHA-256 (checked by ``load_corpus``)."""
    from engram.bench.corpus import CorpusError, load_corpus

    path = Path(DEFAULT_CORPUS if path is None else path)
    if not path.is_file():
        raise CorpusError(f"corpus {path}: no such file (write one with `engram bench corpus`, pass it with "
                          f"--corpus)")
    corpus = load_corpus(path)
    order = np.random.default_rng(seed).permutation(len(corpus.requests))
    return [corpus.requests[i].prompt for i in order], corpus.sha256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an engram (or any OpenAI-compatible) server; default: start one")
    p.add_argument("--model", default="tiny", help="model to start (and the model name sent)")
    p.add_argument("--serve-args", default="", help="extra arguments for the started `engram serve`")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos, so exactly this)")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="request corpus whose prompts are sent (engram bench corpus; default: the committed "
                        "bench/corpus/natural-v1.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="shuffles the order in which the corpus's prompts are sent")
    p.add_argument("--out", default=None, help="result JSON path (default: a fresh file in a temporary directory)")


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile; None when no request got that far, so a failed run's result is still written."""
    return float(np.percentile(values, q)) if values else None


async def _worker(client, model: str, prompts: list[str], start: int, stride: int, deadline: float,
                  max_tokens: int, stats: dict) -> None:
    i = start
    while time.monotonic() < deadline:
        prompt = prompts[i % len(prompts)]
        i += stride
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        times: list[float] = []
        tokens = max_tokens  # what ignore_eos asks for; the usage chunk, when the server sends one, says exactly
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    stats["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                failed = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:  # the stream failed part way: an error, not a finished request
                        stats["errors"].append(event["error"]["message"])
                        failed = True
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event.get("choices") and event["choices"][0].get("text"):
                        times.append(time.monotonic())
                if failed:
                    continue
        except Exception as e:  # a failed request is counted, the load goes on
            stats["errors"].append(f"{type(e).__name__}: {e}")
            continue
        stats["requests"] += 1
        stats["e2e"].append(time.monotonic() - t0)
        if times:
            stats["ttft"].append(times[0] - t0)
            if len(times) > 1:
                stats["tpot"].append((times[-1] - times[0]) / (len(times) - 1))
        stats["tokens"] += tokens


async def run_load(url: str, model: str, concurrency: int, duration: float, max_tokens: int,
                   prompts: list[str]) -> dict:
    """Hold ``concurrency`` streams for ``duration`` seconds (worker w sends prompts w, w + concurrency, ...)."""
    import httpx

    if not prompts:
        raise ValueError("run_load needs at least one prompt")
    stats = {"requests": 0, "tokens": 0, "errors": [], "ttft": [], "tpot": [], "e2e": []}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.monotonic()
        deadline = t0 + duration
        await asyncio.gather(*(_worker(client, model, prompts, w, concurrency, deadline, max_tokens, stats)
                               for w in range(concurrency)))
        wall = time.monotonic() - t0
    return {"wall_s": wall, "requests": stats["requests"], "errors": len(stats["errors"]),
            "error_samples": stats["errors"][:5], "output_tokens": stats["tokens"],
            "output_tokens_per_s": stats["tokens"] / wall, "requests_per_s": stats["requests"] / wall,
            **{f"ttft_p{q}_s": _pct(stats["ttft"], q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_s": _pct(stats["tpot"], q) for q in (50, 90, 99)},
            **{f"e2e_p{q}_s": _pct(stats["e2e"], q) for q in (50, 99)}}


def run(args: argparse.Namespace) -> int:
    import shlex
    import tempfile

    from engram.bench.corpus import CorpusError
    from engram.bench.report import format_table, write_result
    from engram.server.launcher import ServerProcess

    try:
        prompts, corpus_sha256 = corpus_prompts(args.corpus, args.seed)
    except CorpusError as e:
        raise SystemExit(f"engram bench serve: {e}") from None
    server = None
    url = args.url
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="engram-bench-")) / "server.log"
        server = ServerProcess([args.model, "--max-num-seqs", str(args.concurrency), *shlex.split(args.serve_args)],
                               None, log)
        print(f"starting engram serve {args.model} (log: {log}) ...", flush=True)
        url = server.wait_ready().url
    try:
        result = asyncio.run(run_load(url, args.model, args.concurrency, args.duration, args.max_tokens, prompts))
    finally:
        if server is not None:
            server.stop()
    config = {"url": args.url, "model": args.model, "serve_args": args.serve_args, "concurrency": args.concurrency,
              "duration_s": args.duration, "max_tokens": args.max_tokens, "seed": args.seed,
              "corpus": args.corpus, "corpus_sha256": corpus_sha256}  # corpus None: the committed default
    path = write_result("serve-load", config, result, out=args.out)
    print(json.dumps(result, indent=2))
    print(format_table([{k: v for k, v in result.items() if k != "error_samples"}]))
    print(f"result: {path}")
    return 0 if result["errors"] == 0 else 1
