"""``engram bench lookup``: row-lookup throughput of a table on any tier, and of the disk tier against its disk. Each
cell (tier options x id distribution x batch x cache size) times ``table.gather`` on fresh ids per batch (id generation
and cache drops untimed; CUDA synchronized around it): µs/batch, rows/s, GB/s delivered, and on the disk tier read
ops/s, disk MB/s and page amplification. ``--tier disk`` also sweeps queue depths and io modes and, with ``--raw``,
plain random page reads of the same file, interleaved with the table cells."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HELP = "Table lookups per tier: rows/s, µs/batch, GB/s; disk: queue depths, raw-read baseline, amplification."

COUNTERS = ("read_ops", "bytes_read", "disk_rows", "hits", "misses", "unique_rows")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("table", nargs="?", help="table directory (or use --random-rows)")
    p.add_argument("--random-rows", type=int, default=0, help="build a random MXFP8 table of N rows, deleted after")
    p.add_argument("--dim", type=int, default=256, help="row dim of --random-rows (default 256, as V4.1)")
    p.add_argument("--workdir", default=None,
                   help="where --random-rows builds its table: the disk under test (default: the temporary directory)")
    p.add_argument("--keep-table", action="store_true", help="keep the --random-rows table")
    p.add_argument("--tier", default="disk", choices=("gpu", "host", "disk"))
    p.add_argument("--ops", default="gather_raw,gather",
                   help="gather_raw: packed row bytes (the tier's own work); gather: + dequantize to bf16")
    p.add_argument("--batch-sizes", default="48,1024,16384", help="ids per lookup (48 = one V4.1 token's rows)")
    p.add_argument("--dists", default="uniform,zipf", help="id distributions: uniform, zipf")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent over a random permutation of rows")
    p.add_argument("--cache-rows", default="0", help="hot-row cache sizes (host, disk), comma-separated")
    p.add_argument("--queue-depths", default="1,2,4,8,16,32,64,128", help="disk: preads in flight")
    p.add_argument("--io", default="direct,buffered", help="disk: io modes")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="disk buffered: drop values.bin from the page cache before each batch (default on)")
    p.add_argument("--raw", action=argparse.BooleanOptionalAction, default=True,
                   help="disk: also measure plain random page reads of the same file")
    p.add_argument("--raw-pages", type=int, default=16384,
                   help="pages per raw read call (64 MiB: the pool drains once per call, <1%% of the time)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="timed seconds per cell, split over rounds (the run prints its total before it starts)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per (io, queue depth) group")
    p.add_argument("--device", default=None, help="device rows are returned on (default: cuda if present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="result name (default lookup-<tier>)")
    p.add_argument("--out", default=None, help="JSON path (default: a fresh file in a temporary directory)")


def build_random_table(rows: int, dim: int, workdir: str) -> Path:
    """A random MXFP8 table (``convert_random``, seed 0) in a fresh directory under ``workdir``."""
    from engram.store.convert import convert_random

    root = Path(tempfile.mkdtemp(prefix=".engram-bench-lookup-", dir=workdir))
    convert_random(root / "table", rows, dim, seed=0, progress=False)
    return root / "table"


class IdSource:
    """Fresh row ids per batch: uniform, or Zipf(s) over a fixed permutation of the rows (built once per (rows, s))."""

    _zipf: dict[tuple[int, float], tuple[Any, Any]] = {}

    def __init__(self, rows: int, dist: str, s: float, seed: int):
        import numpy as np

        self.rows, self.dist = rows, dist
        self.rng = np.random.default_rng(seed)
        if dist == "zipf":
            if (rows, s) not in self._zipf:
                w = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s
                self._zipf[(rows, s)] = (np.cumsum(w) / w.sum(), np.random.default_rng(0).permutation(rows))
            self.cdf, self.perm = self._zipf[(rows, s)]
        elif dist != "uniform":
            raise ValueError(f"--dists: {dist!r} is not one of uniform, zipf")

    def draw(self, n: int):
        import numpy as np
        import torch

        if self.dist == "uniform":
            ids = self.rng.integers(0, self.rows, size=n)
        else:
            ranks = np.minimum(np.searchsorted(self.cdf, self.rng.random(n)), self.rows - 1)
            ids = self.perm[ranks]
        return torch.from_numpy(ids.astype(np.int64))


class Cell:
    """One measured configuration: a timed step run for a time budget per round, samples accumulated."""

    def __init__(self, key: dict[str, Any], step: Callable[[], tuple[float, int]], counters=None, row_bytes: int = 0,
                 value_bytes: int = 0):
        self.key, self.step, self.counters = key, step, counters  # counters: table.stats for table cells
        self.row_bytes, self.value_bytes = row_bytes, value_bytes  # delivered per row; values part of it
        self.times: list[float] = []  # seconds per batch
        self.items = 0  # ids (table) or pages (raw) processed
        self.delta = dict.fromkeys(COUNTERS, 0)

    def run(self, budget_s: float) -> None:
        before = self.counters() if self.counters else None
        end = time.perf_counter() + budget_s
        while time.perf_counter() < end or not self.times:
            dt, n = self.step()
            self.times.append(dt)
            self.items += n
        if before is not None:
            after = self.counters()
            for k in COUNTERS:
                self.delta[k] += after.get(k, 0) - before.get(k, 0)

    def result(self) -> dict[str, Any]:
        secs = sum(self.times)
        out = dict(self.key)
        out["batches"] = len(self.times)
        out["us_per_batch_p50"] = statistics.median(self.times) * 1e6
        out["us_per_batch_mean"] = secs / len(self.times) * 1e6
        if self.key["mode"] == "raw":
            out["read_ops_per_s"] = self.items / secs
            out["disk_MB_per_s"] = self.items * 4096 / secs / 1e6
            return out
        d = self.delta
        out["rows_per_s"] = self.items / secs
        out["GB_per_s"] = self.items * self.row_bytes / secs / 1e9
        if self.key["tier"] == "disk":
            out["read_ops_per_s"] = d["read_ops"] / secs
            out["disk_MB_per_s"] = d["bytes_read"] / secs / 1e6
            out["page_amp"] = d["bytes_read"] / (d["disk_rows"] * self.value_bytes) if d["disk_rows"] else 0.0
        looked = d["hits"] + d["misses"]
        out["hit_rate"] = d["hits"] / looked if looked else None
        out["unique_frac"] = d["unique_rows"] / self.items if self.items else None
        return out


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def table_cell(table, op: str, tier: str, group: dict, dist: str, batch: int, cache_rows: int, ids: IdSource,
               sync, cold: bool) -> Cell:
    fn = getattr(table, op)

    def step() -> tuple[float, int]:
        batch_ids = ids.draw(batch)
        if cold:
            table.reader.drop_cache()
        return _timed(lambda: fn(batch_ids), sync), batch

    return Cell(dict(tier=tier, mode=op, **group, dist=dist, batch=batch, cache_rows=cache_rows), step,
                counters=table.stats, row_bytes=table.row_bytes, value_bytes=table.value_bytes)


def raw_cell(values_path: Path, group: dict, pages: int, seed: int, cold: bool) -> Cell:
    """Plain random page reads of the file: the same pread pool at the same depth, no table work."""
    import numpy as np

    from engram.store.reader import PAGE, PageReader, aligned_pages

    reader = PageReader(values_path, io=group["io"], queue_depth=group["queue_depth"])
    n_pages = reader.size // PAGE
    buf = aligned_pages(pages)
    rng = np.random.default_rng(seed)

    def step() -> tuple[float, int]:
        offs = rng.integers(0, n_pages, size=pages, dtype=np.int64) * PAGE
        if cold:
            reader.drop_cache()
        t0 = time.perf_counter()
        reader.read(offs, buf)
        return time.perf_counter() - t0, pages

    return Cell(dict(tier="disk", mode="raw", **group, dist="uniform", batch=pages, cache_rows=0), step)


def run_group(cells: list[Cell], seconds: float, rounds: int) -> None:
    """Every cell gets seconds / rounds per round; odd rounds run in reverse so drift hits all cells alike."""
    for r in range(rounds):
        for cell in (cells if r % 2 == 0 else cells[::-1]):
            cell.run(seconds / rounds)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (io, queue depth, op): raw read ops/s vs the table's at its largest uniform batch without cache."""
    out = []
    for raw in (r for r in rows if r["mode"] == "raw"):
        same = [r for r in rows if r["mode"] != "raw" and r["io"] == raw["io"] and r["dist"] == "uniform"
                and r["queue_depth"] == raw["queue_depth"] and r["cache_rows"] == 0]
        for op in dict.fromkeys(r["mode"] for r in same):
            best = max((r for r in same if r["mode"] == op), key=lambda r: r["batch"])
            out.append(dict(io=raw["io"], queue_depth=raw["queue_depth"], op=op, raw_ops_per_s=raw["read_ops_per_s"],
                            table_ops_per_s=best["read_ops_per_s"], table_batch=best["batch"],
                            reader_over_raw=best["read_ops_per_s"] / raw["read_ops_per_s"]))
    return out


def estimate(args: argparse.Namespace, groups: int) -> str:
    """What the run will time, said before it starts (``--seconds`` is per cell; the disk sweep multiplies cells)."""
    table_cells = len(_ints(args.cache_rows)) * len(_words(args.ops)) * len(_words(args.dists)) * \
        len(_ints(args.batch_sizes))
    cells = table_cells + (1 if args.tier == "disk" and args.raw else 0)
    total = groups * cells * args.seconds
    sweep = f"{groups} (io, queue depth) groups x " if args.tier == "disk" else ""
    return (f"bench lookup: {sweep}{cells} cells x {args.seconds:g} s = {total:.0f} s timed (about {total / 60:.1f} "
            f"min), plus one warm-up batch per cell and {groups * len(_ints(args.cache_rows))} table opens; a "
            f"batch slower than --seconds / --rounds runs once per round anyway. Fewer --queue-depths, --io, "
            f"--batch-sizes, --dists or --ops, or a smaller --seconds, shorten it.")


def run(args: argparse.Namespace) -> int:
    import torch

    from engram.bench.report import args_config, format_table, write_result
    from engram.store import open_table

    if bool(args.table) == bool(args.random_rows):
        raise SystemExit("engram bench lookup: give a TABLE directory or --random-rows N (exactly one)")
    from engram.store.format import read_manifest

    disk = args.tier == "disk"
    groups = ([dict(io=io, queue_depth=qd) for io in _words(args.io) for qd in _ints(args.queue_depths)]
              if disk else [dict(io=None, queue_depth=None)])
    print(estimate(args, len(groups)), file=sys.stderr, flush=True)
    made = build_random_table(args.random_rows, args.dim, args.workdir) if args.random_rows else None
    path = Path(made or args.table)
    manifest = read_manifest(path)
    device = torch.device(args.device) if args.device else None
    on_cuda = (device or torch.device("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()  # the disk and CPUs may be shared: record how busy the machine was
    try:
        for group in groups:
            cold = disk and args.cold and group["io"] == "buffered"
            cells, tables = [], []
            if disk and args.raw:
                cells.append(raw_cell(path / "values.bin", group, args.raw_pages, args.seed, cold))
            for cache_rows in _ints(args.cache_rows):
                opts = dict(io=group["io"], queue_depth=group["queue_depth"]) if disk else {}
                t = open_table(path, tier=args.tier, device=device, cache_rows=cache_rows, count_unique=True, **opts)
                tables.append(t)
                for op in _words(args.ops):
                    for dist in _words(args.dists):
                        for batch in _ints(args.batch_sizes):
                            src = IdSource(t.rows, dist, args.zipf_s, args.seed + len(cells))  # own ids per cell
                            cells.append(table_cell(t, op, args.tier, group, dist, batch, cache_rows, src, sync,
                                                    cold))
            for cell in cells:  # warm-up: pools, allocator, first touch (not recorded)
                cell.step()
            run_group(cells, args.seconds, args.rounds)
            rows += [c.result() for c in cells]
            for t in tables:
                t.close()
            print(format_table([r for r in rows if r.get("queue_depth") == group["queue_depth"]
                                and r.get("io") == group["io"]]), flush=True)
    finally:
        if made is not None and not args.keep_table:
            shutil.rmtree(made.parent, ignore_errors=True)
    summary = summarize(rows) if disk else []
    from engram.store import reader as rd

    config = args_config(args)
    config.update(reader_backend=rd.active_backend(), table_rows=manifest.rows, row_dtype=manifest.row_dtype,
                  row_stride=manifest.row_stride, values_bytes=manifest.files["values"].bytes,
                  loadavg_before=load_before, loadavg_after=os.getloadavg(),
                  note="raw = the same pread pool reading uniformly random pages of values.bin with no table work")
    out = write_result(args.name or f"lookup-{args.tier}", config, {"cells": rows, "summary": summary},
                       out=args.out)
    print()
    print(format_table(rows))
    if summary:
        print()
        print(format_table(summary))
    print(f"\nwrote {out}")
    return 0

