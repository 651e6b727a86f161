"""``engram bench serve``: the serving benchmark, in the shape of ``vllm bench serve``. ``--num-prompts`` streaming
completions (prompts of exactly the drawn ``--input-len`` tokens of natural prose, ``--output-len`` tokens with
ignore_eos) against ``engram serve`` started on a free port (or ``--url``), at most ``--concurrency`` in flight, sent
at ``--request-rate`` (Poisson; inf: all at once), after ``--warmup`` requests that are not measured. Reports output
tok/s, TTFT / TPOT / ITL / e2e percentiles, errors, the engine's counters for the window (``GET /engram/steps``), the
node's memory of the server it started (node_memory.py, sampled after the window) and the serving roofline of the
window's steps (serving_roofline.py), as JSON (``--out``) and tables. ``--shared-prefix-len`` puts one system prompt
before every prompt and reports the prefix cache's hits (shared_prefix.py)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from engram.bench import node_memory, serve_disk_bound, shared_prefix
from engram.bench.serve_workload import DEFAULT_CORPUS, DEFAULT_LENGTHS  # noqa: F401  (DEFAULT_CORPUS: others cite it)

START_TIMEOUT_S = 900.0  # a large preset builds its tables and captures its graphs before /health answers
HELP = ("serving benchmark: N streamed requests of natural prompts at a concurrency or request rate; throughput, "
        "TTFT/TPOT/ITL percentiles, engine counters and the serving roofline")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an engram (or any OpenAI-compatible) server; default: start one")
    p.add_argument("--model", default="tiny", help="model to start (and the model name sent)")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="tokenizer prompt lengths are counted in (a tokenizer.json path, builtin, pkg:PKG/PATH); "
                        "default: the model's")
    p.add_argument("--num-prompts", type=int, default=1000, help="measured requests")
    p.add_argument("--warmup", type=int, default=8, help="requests sent and finished before the measured window")
    p.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once, --concurrency paces them)")
    p.add_argument("--input-len", default=DEFAULT_LENGTHS, metavar="LO:HI", help="prompt tokens, uniform integers")
    p.add_argument("--output-len", default=DEFAULT_LENGTHS, metavar="LO:HI", help="output tokens, uniform integers")
    p.add_argument("--seed", type=int, default=0, help="draws the lengths, the corpus order and the arrivals")
    shared_prefix.add_arguments(p)
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="request corpus whose prose the prompts are cut from (default: bench/corpus/natural-v1.jsonl)")
    g = p.add_argument_group("the server (passed to the one started; say what --url runs, for the roofline)")
    g.add_argument("--tier", choices=("gpu", "host", "disk"), default="gpu")
    g.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of the started server and of the bench's own measurements")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step, at most (also the ideal schedule's prefill step)")
    g.add_argument("--serve-args", default="", help="further arguments for the started `engram serve`")
    serve_disk_bound.add_arguments(g)
    p.add_argument("--no-roofline", action="store_true", help="skip measuring the ceilings and the roofline")
    p.add_argument("--out", default=None, help="result JSON path (default: a fresh file in a temporary directory)")


def server_args(args: argparse.Namespace, trace: Path | None = None) -> list[str]:
    """The started server's command line: the model, the options the roofline relies on, the row trace it writes
    (serve_disk_bound.py), then ``--serve-args``."""
    import shlex

    out = [args.model, "--tier", args.tier, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if trace is not None:
        out += ["--row-trace", str(trace)]
    if args.concurrency:
        out += ["--max-num-seqs", str(args.concurrency)]
    for flag, value in (("--dtype", args.dtype), ("--device", args.device), ("--threads", args.threads)):
        if value is not None:
            out += [flag, str(value)]
    return out + shlex.split(args.serve_args)


def _workload(args: argparse.Namespace):
    from engram.bench.corpus import LengthRange
    from engram.bench.serve_workload import arrival_offsets, make_requests, model_tokenizer, token_stream

    if args.warmup < 0 or (args.concurrency is not None and args.concurrency < 1) or (args.threads or 1) < 1:
        raise ValueError(f"--warmup={args.warmup} must be >= 0, --concurrency={args.concurrency} and "
                         f"--threads={args.threads} >= 1")
    input_len = LengthRange.parse(args.input_len, "--input-len")
    output_len = LengthRange.parse(args.output_len, "--output-len")
    stream = token_stream(model_tokenizer(args.model, args.tokenizer), args.corpus, args.seed)
    requests = make_requests(stream, args.warmup + args.num_prompts, input_len, output_len, args.seed)
    requests = shared_prefix.with_shared_prefix(stream, requests, args.shared_prefix_len)
    return stream, requests[:args.warmup], requests[args.warmup:], arrival_offsets(args.num_prompts,
                                                                                   args.request_rate, args.seed)


def _steps(url: str, since: int):
    """fetch_steps, or (None, reason) when the server cannot give them."""
    import httpx

    from engram.bench.serve_counters import fetch_steps

    try:
        got = fetch_steps(url, since)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        return None, f"GET /engram/steps failed: {type(e).__name__}: {e}"
    return (got, None) if got is not None else (None, "the server has no GET /engram/steps")


def model_config(model: str):
    """(ModelConfig, None) of a preset or a checkpoint directory's config.json, else (None, why not): a DeepSeek-V4
    preset too (the serving roofline counts dense decoders only)."""
    from engram.model.model_config import ModelConfig
    from engram.model.presets import MODEL_PRESETS, preset_config

    if model in MODEL_PRESETS:
        cfg = preset_config(model)
        if not isinstance(cfg, ModelConfig):
            return None, f"no serving roofline for {model!r} ({cfg.architecture}: the roofline counts dense decoders)"
        return cfg, None
    path = Path(model) / "config.json"
    if not path.is_file():
        return None, f"no model config for {model!r} (a preset or a checkpoint directory)"
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()), name=Path(model).name), None
    except (ValueError, KeyError, TypeError) as e:  # an architecture the roofline's counts do not cover
        return None, f"{path}: {type(e).__name__}: {e}"


def roofline_result(args: argparse.Namespace, records, load: dict) -> dict:
    """Ceilings and the GEMM curve measured now on ``--device``, the window's serving roofline and the ideal
    schedule's; {"skipped": reason} when there is nothing to measure against."""
    import torch

    from engram.bench.roofline import measure_ceilings
    from engram.bench.serving_roofline import ideal_schedule, m_grid, measure_gemm_curve, serving_roofline
    from engram.model.loader import resolve_dtype

    cfg, reason = model_config(args.model)
    if cfg is None:
        return {"skipped": reason}
    if not records:
        return {"skipped": "no step records for the window"}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    if args.threads is not None:  # the server's thread count: more threads than cores time their contention
        torch.set_num_threads(args.threads)
    concurrency = args.concurrency or max(r.num_seqs for r in records)
    ceilings = measure_ceilings(device, dtype)
    ms = m_grid(max(max(r.num_tokens for r in records), args.max_num_batched_tokens, concurrency))
    head_ms = m_grid(max(max(r.sampled for r in records), concurrency))
    curve = measure_gemm_curve(cfg, ms, head_ms, device, dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    done = [r for r in load["records"] if r.error is None]
    out = serving_roofline(cfg, records, curve, ceilings, itemsize, args.tier, load["wall_s"], load["tpot_p50_s"])
    prompt_lens = [r.prompt_len for r in done]
    output_lens = [r.completion_tokens or r.output_len for r in done]
    out["ideal"] = ideal_schedule(cfg, prompt_lens, output_lens, args.max_num_batched_tokens, concurrency, curve,
                                  ceilings, itemsize, args.tier)
    out["roofline_output_tokens_per_s"] = load["output_tokens"] / out["roofline_s"] if out["roofline_s"] else None
    out.update(ceilings=ceilings.to_dict(), gemm_curve=curve.to_dict(), dtype=str(dtype).removeprefix("torch."))
    return out


def run_bench(args: argparse.Namespace, url: str, warmup, measured, offsets) -> dict:
    """Warm-up, then the measured window with the engine's step records around it; the window's result (with its
    request ``records`` and step records ``steps``)."""
    from engram.bench.serve_client import drive, summarize
    from engram.bench.serve_counters import speculative_window, window_counters

    if warmup:
        warm, _ = asyncio.run(drive(url, args.model, warmup, [0.0] * len(warmup), args.concurrency))
        failed = [r.error for r in warm if r.error]
        if failed:
            print(f"warm-up: {len(failed)} of {len(warm)} requests failed, e.g. {failed[0]}", file=sys.stderr)
    before, reason = _steps(url, -1)
    since = before[0][-1].step_id if before and before[0] else -1
    records, wall = asyncio.run(drive(url, args.model, measured, offsets, args.concurrency))
    result = summarize(records, wall)
    after, reason = _steps(url, since) if before else (None, reason)
    result["records"] = records
    result["steps"] = after[0] if after else []
    result["counters"] = window_counters(after[0], before[1], after[1], wall) if after else {"skipped": reason}
    result["prefix_cache"] = (shared_prefix.prefix_cache_window(before[1], after[1]) if after
                              else {"skipped": reason})
    result["speculative"] = speculative_window(before[1], after[1]) if after else None  # acceptance length
    result["stats_window"] = (before[1], after[1]) if after else None
    return result


def run(args: argparse.Namespace) -> int:
    import tempfile

    from engram.bench.corpus import CorpusError
    from engram.bench.report import args_config, format_table, write_result
    from engram.server.launcher import ServerProcess

    try:
        stream, warmup, measured, offsets = _workload(args)
    except (CorpusError, ValueError) as e:
        raise SystemExit(f"engram bench serve: {e}") from None
    server, url = None, args.url
    logdir = Path(tempfile.mkdtemp(prefix="engram-bench-")) if url is None else None
    trace = serve_disk_bound.trace_file(args, logdir)
    if url is None:
        log = logdir / "server.log"
        server = ServerProcess(server_args(args, trace), None, log)
        print(f"starting engram serve {' '.join(server_args(args, trace))} (log: {log}) ...", file=sys.stderr,
              flush=True)
        try:
            url = server.wait_ready(START_TIMEOUT_S).url
        except BaseException:
            server.stop()
            raise
    try:
        print(f"{len(measured)} measured requests after {len(warmup)} warm-up, input {args.input_len}, output "
              f"{args.output_len} tokens, concurrency {args.concurrency or 'unlimited'}, request rate "
              f"{args.request_rate}/s", file=sys.stderr, flush=True)
        load = run_bench(args, url, warmup, measured, offsets)
        pid = server.proc.pid if server is not None else None  # None: a server the bench did not start
        load["node_memory"] = node_memory.bench_server_memory(pid, args.serve_args)
    finally:
        if server is not None:
            server.stop()  # before the ceilings are measured: the device is the bench's alone
    steps = load.pop("steps")
    window = load.pop("stats_window")
    if trace is not None:  # the server has closed its trace (or, with --url, still holds its last chunk)
        load["disk_bound"] = (serve_disk_bound.disk_bound(trace, steps, load, *window, args.raw_read_seconds,
                                                          args.seed) if window else {"skipped": "no engine counters"})
    roof = {"skipped": "--no-roofline"} if args.no_roofline else (
        roofline_result(args, steps, load) if "skipped" not in load["counters"]
        else {"skipped": load["counters"]["skipped"]})
    load.pop("records")
    result = {**load, "roofline": roof}
    config = args_config(args)
    config.update(request_rate=str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate,
                  corpus_sha256=stream.corpus_sha256, tokenizer=stream.tokenizer,
                  server_args=server_args(args, trace) if args.url is None else None)
    path = write_result("serve", config, result, out=args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("counters", "roofline", "disk_bound")}, indent=2))
    print(format_tables(result, format_table))
    print(f"result: {path}")
    return 0 if result["errors"] == 0 else 1


def lookup_columns(part: dict | None) -> dict:
    """A step kind's lookup counters as table columns: waits, host gaps, table time by tier, ids / distinct."""
    if part is None:
        return {}
    ratio = " ".join("-" if r is None else f"{r:.2f}" for r in part["dedup_ratio"])
    return {"exposed s": part["lookup_exposed_s"], "host gap s": part["host_gap_s"],
            "gather s": " ".join(f"{t}:{v:.3f}" for t, v in sorted(part["gather_s"].items())),
            "ids/unique": ratio}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def format_tables(result: dict, format_table) -> str:
    """The load's latencies, the window's steps by kind, and the roofline's summary, as text tables."""
    lat = [{"metric": m, **{f"{s} ms": _ms(result[f"{m}_{s}_s"]) for s in ("mean", "p50", "p90", "p99")}}
           for m in ("ttft", "tpot", "itl", "e2e")]
    parts = [format_table([{"requests": result["requests"], "errors": result["errors"], "wall s": result["wall_s"],
                            "output tok/s": result["output_tokens_per_s"], "input tokens": result["input_tokens"],
                            "output tokens": result["output_tokens"]}]), format_table(lat)]
    c, roof = result["counters"], result["roofline"]
    if "skipped" not in c:
        by = roof.get("by_kind", {})
        look = c.get("lookups_by_kind", {})
        parts.append(format_table([{"kind": k, "steps": c["steps_by_kind"][k], "eager": c["eager_steps_by_kind"][k],
                                    "tokens": c["tokens_by_kind"][k],
                                    "gpu s": (c["gpu_busy_s_by_kind"] or {}).get(k),
                                    **lookup_columns(look.get(k)),
                                    "roofline s": by.get(k, {}).get("roofline_s"),
                                    "bound": " ".join(f"{b}:{n}" for b, n in by.get(k, {}).get("bound", {}).items())}
                                   for k in c["steps_by_kind"]]))
        idle = "no device clock" if c["gpu_idle_s"] is None else f"{c['gpu_idle_s']:.3f} s, " \
            f"{c['gpu_idle_share']:.1%} of wall" + ("" if c["host_gap_p50_s"] is None else
                                                    f", gap p50 {_ms(c['host_gap_p50_s']):.3f} ms, "
                                                    f"p99 {_ms(c['host_gap_p99_s']):.3f} ms")
        cache = c.get("hot_cache") or {}
        if cache.get("hit_rate") is not None:
            parts.append(f"hot-row cache: {cache['bytes']} bytes, hit rate {cache['hit_rate']:.1%} "
                         f"({cache['hits']} hits, {cache['misses']} misses)")
        parts.append(f"routes {c['steps_by_route']}, graph replays {c.get('graph_replays_delta')}, mixed "
                     f"{c.get('mixed_graph_replays_delta')}, lookup exposed {c.get('lookup_exposed_s_delta')} s; "
                     f"GPU idle between steps: {idle}")
    spec = result.get("speculative")
    if spec:
        parts.append(f"speculative decoding ({spec['method']}, K={spec['num_speculative_tokens']}): acceptance length "
                     f"{spec['acceptance_length']:.2f}, {spec['accepted_tokens']} of {spec['draft_tokens']} drafts "
                     f"accepted ({spec['acceptance_rate']:.1%})")
    bound = result.get("disk_bound")
    if bound is not None:
        parts.append(f"disk bound: skipped ({bound['skipped']})" if "skipped" in bound
                     else "disk bound (replayed pages ÷ raw 4 KiB reads/s)\n"
                     + format_table(serve_disk_bound.bound_rows(bound)))
    if result.get("node_memory"):
        parts.append(node_memory.summary_line(result["node_memory"]))
    if "skipped" in roof:
        parts.append(f"roofline: skipped ({roof['skipped']})")
    else:
        ideal = roof["ideal"]
        parts.append(format_table([{"roofline s": roof["roofline_s"], "wall s": roof["wall_s"],
                                    "ratio": roof["ratio"], "roofline tok/s": roof["roofline_output_tokens_per_s"],
                                    "ideal s": ideal["roofline_s"], "ideal tok/s": ideal["output_tokens_per_s"],
                                    "step roofline ms": _ms(roof["mean_decode_step_roofline_s"]),
                                    "TPOT p50 ms": _ms(roof["tpot_p50_s"]),
                                    "TPOT/step": roof["tpot_p50_over_mean_step"]}]))
    return "\n\n".join(parts)
