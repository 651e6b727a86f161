"""How long one batched read of N random 4 KiB pages of a file takes, at several queue depths.

The disk tier's first Engram layer waits for one such read per decode step (24 pages at batch 1 for the
presets), so its latency, not the disk's deep-queue rate, is what a batch-1 step pays. Each depth gets its
own pread pool (``engram.bench.lookup.raw_cell``: the same reader and pool the tier uses, no table work);
depth 1 reads the pages one after another, so its time over N is the disk's latency of one read, and the
others show how much of a batched read is the disk and how much waking the pool's threads. ``--gaps-ms``
sleeps that long before each timed call: in a decode step the first Engram layer's read comes after the
disk and the pool's threads have been idle for most of a step (~4 ms at batch 1), which back-to-back calls
(gap 0) never see.

    python -m benchmarks.read_latency VALUES_BIN [--pages 24] [--depths 1,4,8,24,64] [--gaps-ms 0,4]
                                    [--seconds 2] [--io direct]

Prints one JSON line per depth, then a table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engram.bench.lookup import raw_cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a file of at least a few thousand pages (a table's values.bin)")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--depths", default="1,4,8,24,64")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--gaps-ms", default="0", help="idle time before each timed call, ms (a list)")
    ap.add_argument("--io", choices=("direct", "buffered"), default="direct")
    args = ap.parse_args()
    rows = []
    for gap_ms in (float(g) for g in args.gaps_ms.split(",")):
        for depth in (int(d) for d in args.depths.split(",")):
            cell = raw_cell(args.path, {"io": args.io, "queue_depth": depth}, args.pages, seed=depth,
                            cold=args.io == "buffered")
            cell.step()  # the pool's threads start, the buffer is touched
            if gap_ms:
                timed = cell.step

                def after_gap(timed=timed, gap=gap_ms / 1e3):
                    time.sleep(gap)
                    return timed()

                cell.step = after_gap  # Cell.run times only what step() returns
            cell.run(args.seconds)
            r = cell.result()
            times = sorted(cell.times)
            r["gap_ms"] = gap_ms
            r["us_per_batch_p90"] = times[int(0.9 * (len(times) - 1))] * 1e6
            r["us_per_page_p50"] = r["us_per_batch_p50"] / args.pages
            print(json.dumps(r))
            rows.append(r)
    print(f"\n{'gap ms':>6}  {'depth':>5}  {'calls':>6}  {'p50 us':>8}  {'p90 us':>8}  {'us/page':>8}")
    for r in rows:
        print(f"{r['gap_ms']:>6g}  {r['queue_depth']:>5}  {r['batches']:>6}  {r['us_per_batch_p50']:>8.1f}  "
              f"{r['us_per_batch_p90']:>8.1f}  {r['us_per_page_p50']:>8.1f}")
    print(f"{args.pages} random pages per call of {args.path} ({args.io}); a gap: idle time before each call")


if __name__ == "__main__":
    main()
