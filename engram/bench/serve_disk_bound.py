"""The disk tier's bound in ``engram bench serve --tier disk``: the server writes a row trace (``--row-trace``,
engine/row_trace.py); after the load, with the server stopped, the trace is replayed through an LRU of the tables'
hot-row cache capacity (page_replay.py) into the 4 KiB pages the measured window's steps had to read, and the same
table file is read at random at the engine's queue depth (disk_bound.measure_file_reads) for the disk's rate now.

    bound_s = window pages ÷ raw read ops/s      (nothing else: no compute, no other I/O)
    output_tokens_per_s_bound = output tokens ÷ bound_s;  ratio = bound_s ÷ wall_s  (= tok/s ÷ bound tok/s)
    ttft_bound_s = median over the window's steps with prompt tokens of that step's pages ÷ rate

``ratio >= TARGET`` meets the issue's target. A request cannot see its first token before the step that prefills its
prompt has read its pages, hence ``ttft_bound_s``."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

TARGET = 0.9  # measured tok/s >= 0.9 x the bound's
TRACE_NAME = "rows.trace"


def add_arguments(g) -> None:
    g.add_argument("--row-trace", default=None, metavar="FILE",
                   help="the row trace the server writes (`engram serve --row-trace`): a started --tier disk server "
                        "writes one to the bench's temporary directory unless this names the file; with --url, name "
                        "the file that server writes to get the disk bound")
    g.add_argument("--raw-read-seconds", type=float, default=5.0, metavar="S",
                   help="seconds of random 4 KiB reads of the table file for the disk bound's rate (default: 5)")


def trace_file(args: argparse.Namespace, logdir: Path | None) -> Path | None:
    """The row trace of this run: ``--row-trace``, else for a started disk-tier server one in ``logdir``, else None."""
    if args.row_trace is not None:
        return Path(args.row_trace)
    if args.url is None and args.tier == "disk" and logdir is not None:
        return logdir / TRACE_NAME
    return None


def read_depth(layout: dict, tables: int) -> int:
    """Reads the engine keeps in flight: its queue depth, times its tables when they read side by side each on a queue
    of its own (``queue_per_thread``, as disk_bound.read_depth)."""
    return int(layout["queue_depth"]) * (tables if layout.get("queue_per_thread") else 1)


def disk_bound(path: Path, records: list, load: dict, before: dict, after: dict, seconds: float, seed: int) -> dict:
    """The bound of the window's steps ``records`` (StepRecords) from the trace at ``path`` and the rate measured now
    (see the module docstring), beside what the run did: its tables' read ops and the disk tier's gather seconds
    (``before`` / ``after``: the engine's stats around the window); {"skipped": reason} when it cannot be priced."""
    from engram.bench.disk_bound import measure_file_reads
    from engram.bench.page_replay import trace_pages
    from engram.engine.row_trace import read_row_trace

    if not path.is_file():
        return {"skipped": f"no row trace at {path}"}
    if not records:
        return {"skipped": "no step records for the window"}
    try:
        trace = read_row_trace(path)
        window = np.array([r.step_id for r in records], dtype=np.int64)
        missing = np.setdiff1d(window, trace.step_ids)
        if missing.size:
            return {"skipped": f"{path}: the trace lacks {missing.size} of the window's {window.size} steps "
                               f"(first {int(missing[0])})"}
        replay = trace_pages(trace, window)
    except ValueError as e:
        return {"skipped": str(e)}
    files = trace.header["table_files"]
    first = files[str(trace.layer_ids[0])]
    per_step = replay.pop("pages_per_step")
    kinds = replay.pop("kinds")
    n_tables = len(trace.layer_ids)
    busy = per_step[per_step > 0]
    pages_per_call = max(1, int(np.median(busy)) // n_tables) if busy.size else 1
    raw = measure_file_reads(first["values"], first["io"], read_depth(first, n_tables), seconds, pages_per_call, seed)
    rate = raw["read_ops_per_s"]
    bound_s = replay["pages"] / rate
    prompt_steps = per_step[[k != "decode" for k in kinds]] / rate
    ttft_bound = float(np.median(prompt_steps)) if prompt_steps.size else None
    out_tokens, wall = load["output_tokens"], load["wall_s"]
    ratio = bound_s / wall if wall else None
    ttft = load.get("ttft_p50_s")
    return {"trace": str(path), "window_steps": int(window.size), "replay": replay, "raw_reads": raw,
            "read_ops_per_s": rate, "bound_s": bound_s,
            "output_tokens_per_s_bound": out_tokens / bound_s if bound_s else math.inf,
            "wall_s": wall, "ratio": ratio, "target": TARGET,
            "target_met": None if ratio is None else ratio >= TARGET,
            "ttft_bound_s": ttft_bound, "ttft_p50_s": ttft,
            "ttft_ratio": ttft_bound / ttft if ttft_bound is not None and ttft else None,
            "disk_gather_s": sum(r.gather_s.get("disk", 0.0) for r in records),
            "measured": table_reads(before, after)}


def table_reads(before: dict, after: dict) -> dict:
    """The growth of the engine's table counters over the window, summed over its tables: read ops, bytes read, hot-row
    cache hits and misses (what the run read, beside the replay's pages)."""
    def total(stats: dict, key: str) -> int:
        return sum(t.get(key, 0) for t in stats.get("tables", {}).values())

    return {k: total(after, k) - total(before, k) for k in ("read_ops", "bytes_read", "hits", "misses")}


def bound_rows(b: dict) -> list[dict]:
    """The bound as one table row (``format_table``)."""
    r = b["replay"]
    return [{"pages": r["pages"], "read ops (run)": b["measured"]["read_ops"], "raw reads/s": b["read_ops_per_s"],
             "depth": b["raw_reads"]["queue_depth"], "bound s": b["bound_s"], "wall s": b["wall_s"],
             "disk gather s": b["disk_gather_s"], "ratio": b["ratio"], "target": f">= {b['target']}",
             "met": b["target_met"], "bound tok/s": b["output_tokens_per_s_bound"],
             "TTFT p50 ms": None if b["ttft_p50_s"] is None else b["ttft_p50_s"] * 1e3,
             "TTFT bound ms": None if b["ttft_bound_s"] is None else b["ttft_bound_s"] * 1e3,
             "hit (LRU)": r["hit_rate"], "ids/distinct": r["dedup_ratio"]}]
