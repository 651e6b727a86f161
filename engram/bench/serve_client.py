"""The client side of ``engram bench serve``: stream ``ServeRequest`` completions to an OpenAI-compatible server (at
most ``concurrency`` in flight, each sent at its arrival offset), record each one's timings, and summarize them as
``vllm bench serve`` does: TTFT = first streamed text, TPOT = (e2e - TTFT) / (output tokens - 1), ITL = the gaps
between a request's streamed chunks, output tok/s = output tokens of the finished requests / the window's wall."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from engram.bench.serve_workload import ServeRequest

PERCENTILES = (50, 90, 99)
MAX_ERROR_SAMPLES = 5
# An idle pooled connection is dropped by the client after this, before `engram serve --timeout-keep-alive` (5 s by
# default) closes it: with equal expiries (httpx's default is 5 s too) a request sent on a connection the server is
# closing meets a reset (httpx.ReadError) without the server ever seeing it.
KEEPALIVE_EXPIRY_S = 2.0


@dataclass
class RequestRecord:
    """One request as the client saw it; ``error`` set means it does not count as finished."""

    prompt_len: int  # tokens sent
    output_len: int  # tokens asked for (max_tokens with ignore_eos)
    sent: float = 0.0  # monotonic seconds
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    end: float = 0.0
    prompt_tokens: int | None = None  # the server's usage
    completion_tokens: int | None = None
    error: str | None = None


async def send_one(client, model: str, req: ServeRequest) -> RequestRecord:
    """Stream one completion; every failure (refused, HTTP status, error event, broken stream) is the record's
    ``error``, never raised, so the load goes on."""
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rec = RequestRecord(prompt_len=len(req.prompt_ids), output_len=req.output_len, sent=time.monotonic())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the stream failed part way: an error, not a finished request
                    rec.error = str(event["error"].get("message", event["error"]))
                    return rec
                if event.get("usage"):
                    rec.prompt_tokens = event["usage"].get("prompt_tokens")
                    rec.completion_tokens = event["usage"].get("completion_tokens")
                if event.get("choices") and event["choices"][0].get("text"):
                    rec.chunk_times.append(time.monotonic())
    except Exception as e:  # a failed request is counted, the load goes on
        rec.error = describe_error(e, len(rec.chunk_times))
        return rec
    rec.end = time.monotonic()
    if not rec.chunk_times:
        rec.error = "the stream ended without any text"
    return rec


async def drive(url: str, model: str, requests: list[ServeRequest], offsets: np.ndarray,
                concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """Send request i at ``offsets[i]`` seconds after the start, at most ``concurrency`` (None: no limit) in flight;
    return the records in request order and the wall seconds from the start to the last request's end."""
    import httpx

    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} arrival offsets for {len(requests)} requests")
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    width = concurrency or len(requests)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0 = time.monotonic()

        async def one(req: ServeRequest, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            if slots is None:
                return await send_one(client, model, req)
            async with slots:
                return await send_one(client, model, req)

        records = await asyncio.gather(*(one(r, float(at)) for r, at in zip(requests, offsets)))
        wall = time.monotonic() - t0
    return list(records), wall


def describe_error(e: BaseException, chunks: int) -> str:
    """A transport failure with its causes (httpx's ReadError often has no message of its own: the OS error under
    it says reset or closed) and where in the stream it struck, so that a load's errors can be told apart."""
    causes, seen = [], e
    while seen is not None and len(causes) < 4:
        causes.append(f"{type(seen).__name__}: {seen}" if str(seen) else type(seen).__name__)
        seen = seen.__cause__ or seen.__context__
    where = "before the first chunk" if chunks == 0 else f"after {chunks} chunks"
    return f"{' <- '.join(causes)} ({where})"


def _pcts(values: list[float], name: str) -> dict[str, float | None]:
    """``{name}_mean_s`` and ``{name}_p{q}_s``; None when no request got that far, so a failed run is still written."""
    out: dict[str, float | None] = {f"{name}_mean_s": float(np.mean(values)) if values else None}
    out.update({f"{name}_p{q}_s": float(np.percentile(values, q)) if values else None for q in PERCENTILES})
    return out


def summarize(records: list[RequestRecord], wall: float) -> dict:
    """The window's metrics (module docstring); ``prompt_tokens_mismatch`` counts finished requests whose usage
    reports another prompt length than was sent (a server that re-tokenized or truncated)."""
    done = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    out_tokens = [r.completion_tokens if r.completion_tokens is not None else r.output_len for r in done]
    ttft = [r.chunk_times[0] - r.sent for r in done]
    e2e = [r.end - r.sent for r in done]
    tpot = [(e - t) / (n - 1) for e, t, n in zip(e2e, ttft, out_tokens) if n > 1]
    itl = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {"wall_s": wall, "requests": len(done), "errors": len(errors),
            "error_samples": list(dict.fromkeys(errors))[:MAX_ERROR_SAMPLES],
            "input_tokens": sum(r.prompt_len for r in done), "output_tokens": sum(out_tokens),
            "prompt_tokens_mismatch": sum(1 for r in done if r.prompt_tokens is not None
                                          and r.prompt_tokens != r.prompt_len),
            "output_tokens_short": sum(1 for r, n in zip(done, out_tokens) if n != r.output_len),
            "output_tokens_per_s": sum(out_tokens) / wall if wall > 0 else None,
            "total_tokens_per_s": (sum(out_tokens) + sum(r.prompt_len for r in done)) / wall if wall > 0 else None,
            "requests_per_s": len(done) / wall if wall > 0 else None,
            **_pcts(ttft, "ttft"), **_pcts(tpot, "tpot"), **_pcts(itl, "itl"), **_pcts(e2e, "e2e")}
