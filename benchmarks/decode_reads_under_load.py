"""Decode reads under a prompt read load (issue 45's target: decode read latency p99 under prompt load <= 1.2 x idle).

One decode-priority read of ``--pages`` random 4 KiB pages of a file every ``--gap-ms`` (a decode step's first Engram
layer), timed, in arms interleaved ``--rounds`` times: alone (idle); beside a thread that reads batches of
``--prompt-pages`` random pages back to back at prompt priority (``reader.read_priority(PROMPT)``: what the prompt
prefetch does), once per ``--prompt-queue-depths`` entry (``advanced.prompt_queue_depth``: the prompt reads' preads
in flight, which a decode read arriving behind them still waits for in the device's queue); and beside the same load
at decode priority (the control: no protection). Each arm uses the disk tier's own reader (``PageReader``, ``--io``,
``--queue-depth``), so O_DIRECT decode reads take Linux AIO and prompt reads the C pool, as in the engine.

    python -m benchmarks.decode_reads_under_load FILE | --workdir DIR [--gib 16] [--pages 48] [--prompt-pages 8192] [--gap-ms 4]
        [--seconds 2] [--rounds 3] [--io direct] [--queue-depth 64] [--prompt-queue-depths 64,16,4] [--out JSON]

FILE: a file of many pages on the disk under test (a table's values.bin), or one of ``--gib`` GiB written in
``--workdir``. Prints JSON: per arm the p50 / p99 / mean
of the decode reads and the prompt pages read per second, and p99 ratios against idle.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from engram.store import reader
from engram.store.reader import PAGE, PageReader, aligned_pages



def arm(r: PageReader, pages: int, load_pages: int, load: int | None, gap_s: float, seconds: float,
        rng: np.random.Generator) -> dict:
    """Decode reads for ``seconds`` beside a background load at priority ``load`` (None: no load)."""
    n_file = r.size // PAGE
    stop = threading.Event()
    loaded = [0]

    def background() -> None:
        buf = aligned_pages(load_pages)
        g = np.random.default_rng(7)
        with reader.read_priority(load):
            while not stop.is_set():
                r.read(g.integers(0, n_file, load_pages).astype(np.int64) * PAGE, buf)
                loaded[0] += load_pages

    thread = threading.Thread(target=background, daemon=True) if load is not None else None
    if thread is not None:
        thread.start()
        time.sleep(0.05)  # the load is running
    buf, times = aligned_pages(pages), []
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            time.sleep(gap_s)
            offsets = rng.integers(0, n_file, pages).astype(np.int64) * PAGE
            t0 = time.perf_counter()
            r.read(offsets, buf)  # decode priority: this thread's default
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    wall = time.perf_counter() - start
    t = np.asarray(times)
    return {"reads": len(t), "p50_ms": float(np.percentile(t, 50) * 1e3), "p99_ms": float(np.percentile(t, 99) * 1e3),
            "mean_ms": float(t.mean() * 1e3), "prompt_pages_per_s": loaded[0] / wall}


def random_file(path: Path, gib: int) -> Path:
    """``path`` of ``gib`` GiB of random bytes (kept: a later run reuses it)."""
    if path.is_file() and path.stat().st_size == gib << 30:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(gib * 16):
            f.write(rng.integers(0, 256, 64 << 20, dtype=np.uint8).tobytes())
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, nargs="?", default=None, help="a file on the disk under test")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="instead of PATH: DIR/decode-reads-<gib>g.bin, written with random bytes unless it exists")
    ap.add_argument("--gib", type=int, default=16, help="size of the --workdir file (beyond the page cache's reach)")
    ap.add_argument("--pages", type=int, default=48, help="pages per decode read (2 layers x 24 columns at batch 1)")
    ap.add_argument("--prompt-pages", type=int, default=8192, help="pages per prompt read of the load")
    ap.add_argument("--gap-ms", type=float, default=4.0, help="time between decode reads (a decode step)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per arm and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io", choices=reader.IO_MODES, default="direct")
    ap.add_argument("--queue-depth", type=int, default=64)
    ap.add_argument("--prompt-queue-depths", default="64,16,4", help="prompt reads' preads in flight, one arm each")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if (args.path is None) == (args.workdir is None):
        raise SystemExit("give a FILE or --workdir DIR")
    if args.path is None:
        args.path = random_file(args.workdir / f"decode-reads-{args.gib}g.bin", args.gib)
    depths = [int(d) for d in args.prompt_queue_depths.split(",")]
    readers = {d: PageReader(args.path, io=args.io, queue_depth=args.queue_depth, prompt_queue_depth=d)
               for d in depths}
    r = readers[depths[0]]
    if r.size // PAGE < 4 * args.prompt_pages:
        raise SystemExit(f"{args.path}: {r.size // PAGE} pages; the load needs at least {4 * args.prompt_pages}")
    rng = np.random.default_rng(1)
    arms = [("idle", r, None), *((f"prompt-load-qd{d}", readers[d], reader.PROMPT) for d in depths),
            ("decode-load", r, reader.DECODE)]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    for _ in range(args.rounds):
        for name, rd, load in arms:
            rows[name].append(arm(rd, args.pages, args.prompt_pages, load, args.gap_ms / 1e3, args.seconds, rng))
    med = {a: {k: float(np.median([x[k] for x in v])) for k in v[0]} for a, v in rows.items()}
    out = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "io": r.io, "backend": reader.active_backend(), "median": med, "rounds": rows,
           "p99_over_idle": {a: med[a]["p99_ms"] / med["idle"]["p99_ms"] for a in rows}}
    for rd in readers.values():
        rd.close()
    text = json.dumps(out, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
