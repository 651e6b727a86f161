"""Seconds from ``open_table`` to the first rows, per tier and table size.

For each size a random MXFP8 table (dim 256, as V4.1) is written under ``--workdir`` (the disk under test;
deleted after unless ``--keep``), then opened on each tier twice: "cold" (the table's files dropped from the
page cache first with posix_fadvise, so the disk is read) and "warm" (files in the page cache). Timed:
``open_table`` (read, CRC-check, pin or upload; the memory preflight included) and the first ``gather`` of
1 K ids, synchronized. Reports seconds and GB/s of table bytes. Runs on the CPU too (host tier = RAM).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

HELP = "Seconds from open_table to the first lookup, per tier and table size, cold and warm page cache."
DIM = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", default="8,32", help="table sizes in GiB of 256-B value rows, comma-separated")
    p.add_argument("--tiers", default="host,gpu", help="tiers to open: host, gpu")
    p.add_argument("--caches", default="cold,warm", help="page-cache states: cold, warm")
    p.add_argument("--workdir", default=None,
                   help="where the tables are written: the disk under test (default: the temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the tables")
    p.add_argument("--device", default=None, help="device rows are returned on (default: cuda if present)")
    p.add_argument("--out", default=None, help="JSON path (default: a fresh file in a temporary directory)")


def _drop_page_cache(directory: Path) -> None:
    for f in directory.iterdir():
        if f.is_file() and hasattr(os, "posix_fadvise"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def open_once(directory: Path, tier: str, cache: str, device) -> dict:
    """Open ``directory`` on ``tier`` and gather 1 K rows; seconds of each phase."""
    import torch

    from engram.store import open_table
    if cache == "cold":
        _drop_page_cache(directory)
    t0 = time.perf_counter()
    table = open_table(directory, tier=tier, device=device)
    t1 = time.perf_counter()
    ids = torch.randint(0, table.rows, (1024,), device=table.device)
    rows = table.gather(ids)
    if rows.is_cuda:
        torch.cuda.synchronize(rows.device)
    t2 = time.perf_counter()
    nbytes = sum(f.stat().st_size for f in directory.iterdir() if f.suffix == ".bin")
    table.close()
    del table, rows
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"tier": tier, "cache": cache, "table_GiB": round(nbytes / 2**30, 2), "table_bytes": nbytes,
            "open_s": round(t1 - t0, 3),
            "first_lookup_s": round(t2 - t1, 4), "open_to_rows_s": round(t2 - t0, 3),
            "GBps": round(nbytes / (t2 - t0) / 1e9, 2)}


def run(args: argparse.Namespace) -> int:
    import json

    from engram.bench.report import args_config, format_table, write_result
    from engram.store.convert import convert_random
    sizes = [float(x) for x in args.gib.split(",") if x.strip()]
    tiers = [x.strip() for x in args.tiers.split(",") if x.strip()]
    caches = [x.strip() for x in args.caches.split(",") if x.strip()]
    for t in tiers:
        if t not in ("host", "gpu"):
            raise SystemExit(f"--tiers: {t!r} is not one of host, gpu")
    for c in caches:
        if c not in ("cold", "warm"):
            raise SystemExit(f"--caches: {c!r} is not one of cold, warm")
    results = []
    for gib in sizes:
        root = Path(tempfile.mkdtemp(prefix=".engram-bench-open-", dir=args.workdir))
        try:
            rows = int(gib * (1 << 30)) // DIM
            t0 = time.perf_counter()
            convert_random(root / "table", rows, DIM, seed=0, progress=False)
            write_s = time.perf_counter() - t0
            print(json.dumps({"GiB": gib, "rows": rows, "write_s": round(write_s, 2)}), flush=True)
            for tier in tiers:
                for cache in caches:
                    res = open_once(root / "table", tier, cache, args.device)
                    res.update(rows=rows, write_s=round(write_s, 2))
                    results.append(res)
                    print(json.dumps(res), flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    path = write_result("table-open", args_config(args), {"points": results}, out=args.out)
    print(format_table(results, ["tier", "cache", "table_GiB", "open_s", "first_lookup_s", "open_to_rows_s", "GBps"]))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
