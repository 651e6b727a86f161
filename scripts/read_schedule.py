"""Two Engram layers' page reads in one decode step: one after the other, side by side, or as one call.

A decode step reads each Engram layer's missed pages in one batched call (the disk tier's ``read_slab``);
the first layer's rows are needed first. This times, for ``--pages`` random 4 KiB pages a layer, O_DIRECT:

* ``serial``: layer A's call, then layer B's, at queue depth ``--depth`` (what the engine does by default:
  ``FIRST_LOOKUP_ALONE``), reporting when A's rows are in and when both are;
* ``side by side``: A's call on this thread and B's on another, each at ``--depth`` (``2 x depth`` in
  flight: ``ENGRAM_FIRST_LOOKUP_ALONE=0``);
* ``one call``: both layers' pages in one call at depth ``--depth`` and at ``2 x depth`` (the disk's rate at
  each depth, which a bound charging these reads would use).

    python3 scripts/read_schedule.py VALUES_BIN [--pages 1176] [--depth 64] [--steps 40] [--out FILE.json]

Each step draws fresh pages; the schedules run interleaved, step by step. Prints one JSON line per schedule
(medians and p10 / p90 over the steps), then a table.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
from pathlib import Path

import numpy as np

from engram.bench import report
from engram.bench.report import format_table
from engram.store.reader import PAGE, PageReader, aligned_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a file of many pages (a table's values.bin)")
    ap.add_argument("--pages", type=int, default=1176, help="pages a layer (4b-like batch 64, 200 K-row cache)")
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    depth, pages = args.depth, args.pages
    readers = {d: PageReader(args.path, io="direct", queue_depth=d) for d in (depth, 2 * depth)}
    n_pages = readers[depth].size // PAGE
    a, b, both = aligned_pages(pages), aligned_pages(pages), aligned_pages(2 * pages)
    rng = np.random.default_rng(0)
    other = cf.ThreadPoolExecutor(1)  # B's reads side by side: a thread that lives across steps, as a table's
    times: dict[str, list[float]] = {}

    def offsets(k: int) -> np.ndarray:
        return rng.integers(0, n_pages, k) * PAGE

    def note(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds * 1e3)

    def read_b(offs: np.ndarray, t0: float) -> float:
        readers[depth].read(offs, b)
        return time.perf_counter() - t0

    for _ in range(args.steps + 1):  # the first step warms the readers' contexts and is dropped
        oa, ob = offsets(pages), offsets(pages)
        t0 = time.perf_counter()
        readers[depth].read(oa, a)
        note("serial: A in", time.perf_counter() - t0)
        readers[depth].read(ob, b)
        note("serial: both in", time.perf_counter() - t0)
        oa, ob = offsets(pages), offsets(pages)
        t0 = time.perf_counter()
        b_done = other.submit(read_b, ob, t0)
        readers[depth].read(oa, a)
        a_in = time.perf_counter() - t0
        note("side by side: A in", a_in)
        note("side by side: both in", max(a_in, b_done.result()))
        for d in (depth, 2 * depth):
            t0 = time.perf_counter()
            readers[d].read(offsets(2 * pages), both)
            note(f"one call at depth {d}: both in", time.perf_counter() - t0)
    rows = []
    for name, ms in times.items():
        ms = np.array(ms[1:])
        row = {"schedule": name, "pages a layer": pages, "depth": depth, "p50 ms": float(np.median(ms)),
               "p10 ms": float(np.percentile(ms, 10)), "p90 ms": float(np.percentile(ms, 90)),
               "reads/s (p50)": (2 if "both" in name else 1) * pages / float(np.median(ms)) * 1e3}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(format_table(rows))
    if args.out:  # with the commit, machine and settings, as every bench result
        report.write_result("read-schedule", {"file": args.path.name, "pages": pages, "depth": depth,
                                              "steps": args.steps}, {"rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
