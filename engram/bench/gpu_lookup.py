"""GPU gather kernels against the machine's limits: HBM and pinned-host (UVA) tables, 1 K .. 4 M rows.

Measures, on one CUDA device: the copy limits (device-to-device, counting bytes read + written; pinned
host-to-device), an empty Triton launch, the Triton gather of MXFP8 V4.1 rows (264 B in, 512 B bf16 out)
from an HBM table and from a pinned host table, uniform and Zipf ids, beside torch baselines, a small
launch-config sweep, the sorted/unsorted and huge-page ablations of the UVA path, and the time to pin
8 GB and 32 GB tables. Prints a table and writes every number as JSON (``--out``). GPU only.
Run: ``python -m engram.bench.gpu_lookup --out bench/results/<date>-gpu-lookup.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

HELP = "GPU gather kernels (HBM and pinned-host UVA) vs copy/PCIe limits, 1K..4M rows, uniform and Zipf."
ROW_IN = 264  # bytes read per V4.1 row: 256 fp8 values + 8 scale bytes
DIM = 256
SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
SWEEP = [(16, 4, 8), (32, 4, 8), (32, 4, 16), (64, 8, 8), (32, 8, 4), (32, 4, 0), (8, 4, 0)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hbm-gib", type=float, default=8.0, help="HBM table size (GiB of 256-B value rows)")
    p.add_argument("--host-gib", type=float, default=32.0, help="pinned host table size for the UVA runs")
    p.add_argument("--pin-gib", type=float, nargs="*", default=[8.0], help="extra tables timed from RAM to first lookup")
    p.add_argument("--rep-ms", type=int, default=150, help="do_bench repetition time per point")
    p.add_argument("--sweep", action="store_true", help="also sweep launch configs at 256K and 4M rows")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/<date>-gpu-lookup.json)")


def _bench(fn, rep_ms: int) -> float:
    """Median µs of fn, L2 flushed between calls (do_bench), so small batches are timed cold."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def zipf_ids(n: int, rows: int, g: torch.Generator, s: float = 1.1) -> torch.Tensor:
    """Zipf-like ids (rank ~ u**(-1/(s-1)), heavy head), ranks scattered over the table by an odd multiplier."""
    u = torch.rand(n, generator=g, device="cuda", dtype=torch.float64)
    rank = (u.pow(-1.0 / (s - 1.0)) - 1).clamp(max=2**62).long() % rows  # [n]
    return (rank * 2654435761 + 12345) % rows


def uniform_ids(n: int, rows: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, rows, (n,), generator=g, device="cuda")


def random_fill_(t: torch.Tensor, chunk: int = 1 << 30) -> torch.Tensor:
    """Random bytes into a uint8 tensor (host or device) from 1 GiB device chunks; never time on zeros."""
    flat = t.view(-1)
    g = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (min(chunk, flat.numel()),), dtype=torch.uint8, device="cuda", generator=g)
    for off in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - off)
        flat[off:off + n].copy_(src[:n])
        src = src.roll(4099)  # chunks differ
    torch.cuda.synchronize()
    return t


def limits(rep_ms: int) -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(x):
        pass

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    random_fill_(a)
    b = torch.empty_like(a)
    d2d = _bench(lambda: b.copy_(a), rep_ms)
    h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    h2d = _bench(lambda: a.copy_(h, non_blocking=True), rep_ms)
    x = torch.empty(1, device="cuda")
    noop = _bench(lambda: _noop[(1,)](x), rep_ms)
    return {"copy_GBps_read_plus_written": 2 * a.numel() / d2d / 1e3, "h2d_GBps": a.numel() / h2d / 1e3,
            "empty_launch_us": noop}


def gather_points(name: str, fn_of_ids, rows: int, rep_ms: int, sizes, dists, lim: dict, out_bytes: int) -> list:
    """One row per (size, distribution): µs, rows/s, GB/s of row bytes read, ratio to the copy / H2D limit."""
    pts = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for dist in dists:
        for n in sizes:
            ids = (uniform_ids if dist == "uniform" else zipf_ids)(n, rows, g)
            fn = fn_of_ids(ids)
            fn()
            torch.cuda.synchronize()
            us = _bench(fn, rep_ms)
            unique = int(torch.unique(ids).numel())
            gbps = n * ROW_IN / us / 1e3
            pts.append({"path": name, "dist": dist, "rows": n, "unique_rows": unique, "us": round(us, 2),
                        "Mrows_per_s": round(n / us, 2), "GBps_rows_read": round(gbps, 2),
                        "GBps_read_plus_written": round(n * (ROW_IN + out_bytes) / us / 1e3, 2),
                        "of_copy_limit": round(n * (ROW_IN + out_bytes) / us / 1e3 / lim["copy_GBps_read_plus_written"], 3),
                        "of_h2d_limit": round(gbps / lim["h2d_GBps"], 3)})
            print(json.dumps(pts[-1]), flush=True)
    return pts


def hbm(args, lim: dict) -> dict:
    from engram.store.kernels import reference, triton_gather
    from engram.store.kernels.launch_config import LaunchConfig
    rows = int(args.hbm_gib * (1 << 30)) // DIM
    values = random_fill_(torch.empty(rows, DIM, dtype=torch.uint8, device="cuda"))  # [R, 256] e4m3 bytes
    scales = torch.randint(100, 140, (rows, DIM // 32), dtype=torch.uint8, device="cuda")  # [R, 8]
    res = {"table_rows": rows, "table_GiB": rows * ROW_IN / 2**30}
    res["triton_bf16"] = gather_points("hbm-triton-bf16", lambda ids: lambda: triton_gather.gather_rows(
        values, scales, ids, "mxfp8", DIM), rows, args.rep_ms, SIZES, ["uniform", "zipf"], lim, 2 * DIM)
    res["triton_raw"] = gather_points("hbm-triton-raw", lambda ids: lambda: triton_gather.gather_raw(values, ids),
                                      rows, args.rep_ms, SIZES, ["uniform"], lim, DIM)
    res["torch_index_select_raw"] = gather_points("hbm-torch-index_select", lambda ids: lambda: values.index_select(
        0, ids), rows, args.rep_ms, SIZES, ["uniform"], lim, DIM)
    res["torch_reference_bf16"] = gather_points("hbm-torch-reference", lambda ids: lambda: reference.gather_rows(
        values, scales, ids, "mxfp8", DIM), rows, args.rep_ms, [1 << 10, 1 << 18, 1 << 22], ["uniform"], lim, 2 * DIM)
    if args.sweep:
        sweep = []
        for b, w, p in SWEEP:
            cfg = LaunchConfig(b, w, p)
            pts = gather_points(f"hbm-sweep-{b}x{w}w-{p}pps", lambda ids: lambda: triton_gather.gather_rows(
                values, scales, ids, "mxfp8", DIM, cfg=cfg), rows, args.rep_ms, [1 << 10, 1 << 18, 1 << 22],
                ["uniform"], lim, 2 * DIM)
            sweep.append({"block_r": b, "num_warps": w, "programs_per_sm": p, "points": pts})
        res["sweep"] = sweep
    # Small batches as the engine issues them: replay of a captured graph (no Python launch cost).
    ids = uniform_ids(1 << 10, rows, torch.Generator(device="cuda").manual_seed(3))
    out = torch.empty(1 << 10, DIM, dtype=torch.bfloat16, device="cuda")
    triton_gather.gather_rows(values, scales, ids, "mxfp8", DIM, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_gather.gather_rows(values, scales, ids, "mxfp8", DIM, out=out)
    res["graph_1k_us"] = _bench(graph.replay, args.rep_ms)
    t0 = time.perf_counter()
    for _ in range(200):
        triton_gather.gather_rows(values, scales, ids, "mxfp8", DIM, out=out)
    torch.cuda.synchronize()
    res["host_launch_1k_us"] = (time.perf_counter() - t0) / 200 * 1e6
    del values, scales
    torch.cuda.empty_cache()
    return res


def host_table(gib: float, huge_pages: bool = True) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A RAM table of ``gib`` GiB pinned with pin_tensor: seconds to pin and to the first lookup."""
    from engram.store.kernels import uva
    from engram.store.pinning import pin_tensor
    rows = int(gib * (1 << 30)) // DIM
    src = random_fill_(torch.empty(rows, DIM, dtype=torch.uint8))  # pageable [R, 256]
    src_s = torch.randint(100, 140, (rows, DIM // 32), dtype=torch.uint8)
    t0 = time.perf_counter()
    values = pin_tensor(src, huge_pages=huge_pages)
    scales = pin_tensor(src_s, huge_pages=huge_pages)
    t1 = time.perf_counter()
    ids = torch.randint(0, rows, (1024,), device="cuda")
    uva.gather_rows(values, scales, ids, "mxfp8", DIM)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    del src, src_s
    gc.collect()
    thp = _anon_huge_kib()
    return ({"GiB": gib, "rows": rows, "huge_pages": huge_pages, "pin_s": round(t1 - t0, 3),
             "first_lookup_s": round(t2 - t1, 4), "AnonHugePages_kiB": thp}, values, scales)


def _anon_huge_kib() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def uva_runs(args, lim: dict) -> dict:
    from engram.store.kernels import uva
    res: dict = {"pin": []}
    try:
        res["thp_setting"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        res["thp_setting"] = None
    for gib in args.pin_gib:  # smaller tables, plain pages vs huge pages: pin time and random-read speed
        for hp in (False, True):
            info, v, s = host_table(gib, huge_pages=hp)
            rows = v.shape[0]
            info["points"] = gather_points(f"uva-{gib:g}G-{'thp' if hp else '4k'}", lambda ids: lambda: uva.gather_rows(
                v, s, ids, "mxfp8", DIM), rows, args.rep_ms, [1 << 14, 1 << 18, 1 << 22], ["uniform"], lim, 2 * DIM)
            res["pin"].append(info)
            print(json.dumps({k: x for k, x in info.items() if k != "points"}), flush=True)
            del v, s
            gc.collect()
    info, values, scales = host_table(args.host_gib)
    res["main_table"] = info
    print(json.dumps(info), flush=True)
    rows = values.shape[0]
    res["auto"] = gather_points("uva-auto", lambda ids: lambda: uva.gather_rows(values, scales, ids, "mxfp8", DIM),
                                rows, args.rep_ms, SIZES, ["uniform", "zipf"], lim, 2 * DIM)
    res["unsorted"] = gather_points("uva-unsorted", lambda ids: lambda: uva.gather_rows(
        values, scales, ids, "mxfp8", DIM, sort=False), rows, args.rep_ms, [1 << 14, 1 << 16, 1 << 18, 1 << 22],
        ["uniform"], lim, 2 * DIM)
    res["sorted"] = gather_points("uva-sorted", lambda ids: lambda: uva.gather_rows(
        values, scales, ids, "mxfp8", DIM, sort=True), rows, args.rep_ms, [1 << 10, 1 << 12, 1 << 14],
        ["uniform"], lim, 2 * DIM)
    g = torch.Generator(device="cuda").manual_seed(5)
    sort_cost = {}
    for n in (1 << 14, 1 << 18, 1 << 22):
        ids = uniform_ids(n, rows, g)
        sort_cost[n] = round(_bench(lambda: uva.sort_plan(ids, rows), args.rep_ms), 2)
    res["sort_plan_us"] = sort_cost
    return res


def run(args: argparse.Namespace) -> int:
    import os

    from engram.bench.report import format_table, write_result
    if not torch.cuda.is_available():
        print("gpu_lookup needs CUDA")
        return 2
    lim = limits(args.rep_ms)
    print(json.dumps(lim), flush=True)
    result = {"limits": lim, "hbm": hbm(args, lim)}
    result["uva"] = uva_runs(args, lim)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    config["commit"] = os.environ.get("ENGRAM_COMMIT")  # the device copy has no .git: the caller names it
    path = write_result("gpu-lookup", config, result, out=args.out)
    rows = [p for key in ("triton_bf16",) for p in result["hbm"][key]] + result["uva"]["auto"]
    print(format_table(rows, ["path", "dist", "rows", "us", "Mrows_per_s", "GBps_rows_read", "of_copy_limit",
                              "of_h2d_limit"]))
    print(f"limits: {lim}; graph 1K: {result['hbm']['graph_1k_us']:.2f} us; json: {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
