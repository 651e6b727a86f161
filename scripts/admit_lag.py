"""What caching a step's rows one step late would cost in disk reads, on natural text (CPU only).

The cached disk tier caches the rows a decode step read (``DiskTable.admit_probed``) before the next step's
lookups start, on the critical path (docs/benchmarks.md, "The runs at 5ab2062, e47e82d and ef3a39a"). Doing it
during the next step's reads instead means that step's cache split no longer sees them: a row read at step s
and needed again at step s + 1 is read twice. This replays the hit-rate bench's serving trace
(``engram.bench.serving_trace``: the corpus served 64 requests at a time, each step's distinct rows per
Engram layer) through the engine's ``RowCache`` both ways and counts the misses (the rows a step reads):

* lag 0: each step's misses cached right after its split (``late_caching`` off);
* lag 1: each step's misses cached after the next step's split (``late_caching`` on, the default since c9fd500:
  ``RowCache.admit(recheck=True)`` skips those cached since, so a row that step missed too is read again, and
  cached once).

    python3 scripts/admit_lag.py --corpus bench/corpus/natural-v1.jsonl [--out RESULT.json]

Prints one JSON line per layer and a table; ``--out`` writes the JSON result.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engram.bench.corpus import load_corpus
from engram.bench.hit_rate import case_traces
from engram.bench.report import format_table, write_result
from engram.bench.serving_trace import LayerTrace
from engram.store.cache import RowCache


def misses_per_step(trace: LayerTrace, capacity: int, ways: int, policy: str, lag: int) -> np.ndarray:
    """[steps with accesses] rows each step missed (read), the step's misses cached ``lag`` steps late."""
    cache = RowCache(capacity, 1, policy=policy, ways=ways)
    pending: tuple[np.ndarray, int] | None = None
    out = []
    for s in range(trace.step_bounds.size - 1):
        a, b = int(trace.step_bounds[s]), int(trace.step_bounds[s + 1])
        ids = trace.rows[a:b]  # distinct, ascending
        if not len(ids):
            continue
        _, _, miss_pos = cache.split(ids)
        miss = ids[miss_pos]
        if lag and pending is not None:  # the step before's rows, after this step's split (as the engine's
            before, looked_up = pending  # late caching: those cached since it missed them are skipped)
            cache.admit(before, torch.zeros(len(before), 1, dtype=torch.uint8), None, looked_up, recheck=True)
        if lag:
            pending = (miss, len(ids))
        else:
            cache.admit(miss, torch.zeros(len(miss), 1, dtype=torch.uint8), None, len(ids))
        out.append(len(miss))
    return np.array(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus file from `engram bench corpus`")
    p.add_argument("--layout", default="4b-like")
    p.add_argument("--tokenizer", default="builtin")
    p.add_argument("--table-rows", type=int, default=31_000_000, help="rows per table (the placement bench's)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cache-rows", type=int, default=200_000)
    p.add_argument("--ways", type=int, default=8)
    p.add_argument("--policy", default="lru")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    case = case_traces(load_corpus(args.corpus), args.layout, args.tokenizer, concurrency=args.concurrency,
                       table_rows=args.table_rows)
    rows = []
    for trace in case.traces:
        per = {lag: misses_per_step(trace, args.cache_rows, args.ways, args.policy, lag) for lag in (0, 1)}
        warm = len(per[0]) // 4  # the last three quarters: the cache full
        row = {"layer": trace.layer_id, "steps": len(per[0]),
               "reads/step lag 0": float(per[0][warm:].mean()), "reads/step lag 1": float(per[1][warm:].mean()),
               "reads lag 0": int(per[0].sum()), "reads lag 1": int(per[1].sum())}
        row["extra reads"] = row["reads/step lag 1"] / row["reads/step lag 0"] - 1
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(format_table(rows, ["layer", "steps", "reads/step lag 0", "reads/step lag 1", "extra reads"]))
    if args.out:
        path = write_result("admit-lag", vars(args), {"layers": rows, "seconds": time.perf_counter() - t0},
                            out=args.out)
        print(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
