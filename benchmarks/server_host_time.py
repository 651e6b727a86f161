"""Host time per engine step spent by the server's HTTP side (the API process) against the engine's own (the engine
process), under a streamed load from the official ``openai`` client, one fresh server per round:

    python -m benchmarks.server_host_time [--model tiny] [--streams 256] [--requests 512] [--output-len 64]
                                          [--rounds 2] [--out FILE]

Per round: CPU milliseconds per step of the whole engine process and of the API process, the wall and CPU time inside
``engine.step()`` (on one torch thread their difference is the step's wait for the GIL or the device), output tok/s,
TPOT p50, and the client's errors by exception (the cause's type: ``httpx.ReadError`` ...). Reads
``GET /engram/steps``'s ``engine_loop`` and /proc; Linux only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from engram.server.launcher import ServerProcess

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all its threads) or of one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of proc(5), after "pid (comm)"


def loop_stats(url: str) -> dict:
    return httpx.get(url + "/engram/steps", params={"since": 1 << 62}, timeout=60).json()["stats"]["engine_loop"]


async def load(url: str, model: str, prompts: list[list[int]], output_len: int, streams: int) -> dict:
    """Stream every prompt (ignore_eos, greedy) with at most ``streams`` in flight -> the client's view."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    slots = asyncio.Semaphore(streams)
    errors: Counter = Counter()
    tpot, tokens = [], 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        async with slots:
            sent, first, n = time.monotonic(), None, 0
            try:
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                         stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        first = first or time.monotonic()
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
            except Exception as e:  # counted by what the transport raised (openai wraps it)
                cause = e.__cause__ or e
                errors[f"{type(e).__name__}({type(cause).__module__}.{type(cause).__name__}: {cause})"[:200]] += 1
                return
            tokens += n
            if first is not None and n > 1:
                tpot.append((time.monotonic() - first) / (n - 1))

    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.monotonic() - t0
    await client.close()
    return {"wall_s": wall, "output_tokens": tokens, "errors": sum(errors.values()), "errors_by_cause": dict(errors),
            "output_tokens_per_s": tokens / wall, "tpot_p50_s": float(np.median(tpot)) if tpot else None}


def arm(args: argparse.Namespace, prompts: list[list[int]], log: Path) -> dict:
    """One fresh server, warmed up, then the measured load and the host times around it."""
    server_args = [args.model, "--threads", "1", "--max-num-seqs", str(args.streams),
                   "--max-num-batched-tokens", str(max(2048, args.streams)), *args.serve_args.split()]
    with ServerProcess(server_args, None, log) as s:
        asyncio.run(load(s.url, args.model, prompts[:8], 4, 8))  # warm-up (not measured)
        before = loop_stats(s.url)
        engine_pid = before["pid"]
        api0, eng0 = cpu_s(s.proc.pid), cpu_s(engine_pid)
        client = asyncio.run(load(s.url, args.model, prompts, args.output_len, args.streams))
        after = loop_stats(s.url)
        api1, eng1 = cpu_s(s.proc.pid), cpu_s(engine_pid)
    steps = after["steps"] - before["steps"]
    d = {k: after[k] - before[k] for k in ("step_s", "step_cpu_s", "deliver_s", "loop_cpu_s")}
    per = (lambda x: x / steps * 1e3) if steps else (lambda x: None)
    return {"steps": steps, "engine_cpu_ms_per_step": per(eng1 - eng0), "api_cpu_ms_per_step": per(api1 - api0),
            "step_wall_ms": per(d["step_s"]), "step_cpu_ms": per(d["step_cpu_s"]),
            "step_gil_or_device_wait_ms": per(d["step_s"] - d["step_cpu_s"]), "deliver_ms": per(d["deliver_s"]),
            "wall_ms_per_step": per(client["wall_s"]), **client}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (natural prose from the corpus)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-args", default="", help="further `engram serve` arguments for every round's server")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from engram.bench.corpus import LengthRange
    from engram.bench.report import format_table
    from engram.bench.serve_workload import make_requests, model_tokenizer, token_stream

    stream = token_stream(model_tokenizer(args.model, None), None, 0)
    length = LengthRange.parse(str(args.input_len), "--input-len")
    prompts = [r.prompt_ids for r in make_requests(stream, args.requests, length, length, 0)]
    logs = Path(tempfile.mkdtemp(prefix="engram-host-time-"))
    rows = []
    for r in range(args.rounds):
        row = {"round": r, **arm(args, prompts, logs / f"server-{r}.log")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    cols = ("round", "steps", "engine_cpu_ms_per_step", "api_cpu_ms_per_step", "step_wall_ms", "step_cpu_ms",
            "step_gil_or_device_wait_ms", "wall_ms_per_step", "output_tokens_per_s", "tpot_p50_s", "errors")
    print(format_table([{c: row[c] for c in cols} for row in rows]))
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "arms": rows}, indent=1))
    print(f"server logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
