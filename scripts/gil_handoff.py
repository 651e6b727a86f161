"""How long a thread's disk read plus one numpy call takes while another thread runs Python, by GIL switch
interval.

A decode step's lookups run on a thread beside the engine's (engine/step_lookups.py). The reads themselves
release the GIL, but the lookup thread needs it back after each one (the plan, the flag), and a thread
running Python hands it over only every ``sys.getswitchinterval()``. This times ``--pages`` random O_DIRECT
page reads and an ``np.unique`` on one thread, ``--calls`` times, with a second thread idle and then busy
with pure Python, at each interval of ``--intervals-ms`` (5 ms is the interpreter's default).

    python3 scripts/gil_handoff.py VALUES_BIN [--pages 24] [--calls 300] [--intervals-ms 5,1,0.5,0.2,0.1]
                                   [--out FILE.json]

Prints one JSON line per (interval, other thread), then a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from engram.bench import report
from engram.bench.report import format_table
from engram.store.reader import PAGE, PageReader, aligned_pages


class _Python(threading.Thread):
    """A thread that runs pure Python (holding the GIL between switches) while ``busy`` is set."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.busy, self.stop = threading.Event(), False

    def run(self) -> None:
        x = 0
        while not self.stop:
            if self.busy.is_set():
                for i in range(2000):
                    x += i * i
            else:
                time.sleep(1e-4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a file of at least a few thousand pages (a table's values.bin)")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2,0.1")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    reader = PageReader(args.path, io="direct", queue_depth=64)
    buf, rng, n_pages = aligned_pages(args.pages), np.random.default_rng(0), reader.size // PAGE
    other = _Python()
    other.start()
    rows, default = [], sys.getswitchinterval()
    try:
        for interval_ms in (float(v) for v in args.intervals_ms.split(",")):
            sys.setswitchinterval(interval_ms / 1e3)
            for busy in (False, True):
                (other.busy.set if busy else other.busy.clear)()
                times = []
                for _ in range(args.calls):
                    offsets = rng.integers(0, n_pages, args.pages) * PAGE
                    t0 = time.perf_counter()
                    reader.read(offsets, buf)
                    np.unique(offsets)
                    times.append(time.perf_counter() - t0)
                ms = np.array(times) * 1e3
                row = {"switch interval ms": interval_ms, "other thread": "Python" if busy else "idle",
                       "pages": args.pages, "calls": args.calls, "p50 ms": float(np.median(ms)),
                       "p90 ms": float(np.percentile(ms, 90))}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        other.stop = True
        sys.setswitchinterval(default)
    print(format_table(rows))
    if args.out:  # with the commit, machine and settings, as every bench result
        report.write_result("gil-handoff", {"file": args.path.name, "pages": args.pages, "calls": args.calls,
                                            "intervals_ms": args.intervals_ms}, {"rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
