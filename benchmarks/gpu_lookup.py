"""GPU gather kernels against the machine's limits: HBM and pinned-host (UVA) tables, 1 K .. 4 M rows.

Measures, on one CUDA device: the copy limits (device-to-device, counting bytes read + written; pinned
host-to-device; a uint8 -> bf16 stream), an empty Triton launch, the Triton gather of MXFP8 V4.1 rows
(264 B in, 512 B bf16 out) from an HBM table, uniform and Zipf ids, beside torch baselines and a small
launch-config sweep; the pinned-host parts (pinning methods, host-tier routes, the UVA probe) live in
benchmarks.host_lookup. Prints a table and writes every number as JSON (``--out``). GPU only.
Run from the repository root: ``python -m benchmarks.gpu_lookup [--out FILE.json]``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

HELP = "GPU gather kernels (HBM and pinned-host UVA) vs copy/PCIe limits, 1K..4M rows, uniform and Zipf."
ROW_IN = 264  # bytes read per V4.1 row: 256 fp8 values + 8 scale bytes
DIM = 256
SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
# (block_r, num_warps, programs_per_sm, stream). Run 3 found one program per tile ahead of every persistent
# grid (bench/results/2026-11-29-gpu-lookup-3.json); this sweep varies the tile around that winner.
SWEEP = [(32, 4, 0, False), (16, 2, 0, False), (16, 4, 0, False), (32, 8, 0, False), (64, 4, 0, False),
         (64, 8, 0, False), (128, 8, 0, False), (32, 4, 0, True)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hbm-gib", type=float, default=8.0, help="HBM table size (GiB of 256-B value rows)")
    p.add_argument("--host-gib", type=float, default=32.0, help="pinned host table size for the UVA runs")
    p.add_argument("--pin-gib", type=float, default=8.0, help="table size of the pin part")
    p.add_argument("--rep-ms", type=int, default=150, help="do_bench repetition time per point")
    p.add_argument("--parts", default="hbm,overhead,pin,uva",
                   help="comma list of: hbm, sweep (launch configs), overhead (host µs per call), pin (pinning "
                        "methods: time and UVA speed), uva (main host table, all sizes), probe (where UVA time "
                        "goes: benchmarks.uva_probe)")
    p.add_argument("--cpu-threads", type=int, default=16, help="threads of the probe's CPU-gather route")
    p.add_argument("--host-layout", default="packed", choices=("packed", "split"),
                   help="layout of the uva part's host table (packed: the host tier's default)")
    p.add_argument("--probe", default="window,graph,layout,cpu,vmm", help="sub-parts of the probe part")
    p.add_argument("--pin-methods", default="register-4k,register-thp,alloc,torch",
                   help="pinning variants for the pin part (torch = torch.empty(pin_memory=True))")
    p.add_argument("--out", default=None, help="JSON path (default: a fresh file in a temporary directory)")


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
    # The dequant gather reads 1 byte per value and writes 2. A Triton stream with that mix (uint8 in, bf16
    # out, consecutive) is the ceiling for it; a copy of the bytes a 256 K-row gather moves (776 B per row
    # read + written) is the copy ceiling at that size, launch ramp included.
    @triton.jit
    def _widen(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m, other=0).to(tl.float32).to(tl.bfloat16), mask=m)

    w = torch.empty(a.numel(), dtype=torch.bfloat16, device="cuda")
    widen = _bench(lambda: _widen[(triton.cdiv(a.numel(), 4096),)](a, w, a.numel(), BLOCK=4096), rep_ms)
    half = (1 << 18) * (ROW_IN + 2 * DIM) // 2
    same = 2 * half / _bench(lambda: b[:half].copy_(a[:half]), rep_ms) / 1e3
    return {"copy_GBps_read_plus_written": 2 * a.numel() / d2d / 1e3, "h2d_GBps": a.numel() / h2d / 1e3,
            "empty_launch_us": noop, "widen_u8_bf16_GBps_read_plus_written": 3 * a.numel() / widen / 1e3,
            "copy_GBps_same_bytes_as_256k_rows": same}


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
            moved = n * (ROW_IN + out_bytes) / us / 1e3  # GB/s counting bytes read and written
            pts.append({"path": name, "dist": dist, "rows": n, "unique_rows": unique, "us": round(us, 2),
                        "Mrows_per_s": round(n / us, 2), "GBps_rows_read": round(gbps, 2),
                        "GBps_read_plus_written": round(moved, 2),
                        "of_copy_limit": round(moved / lim["copy_GBps_read_plus_written"], 3),
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
    if "sweep" in args.parts:  # first, so the main series below runs with the best config
        sweep = []
        for b, w, p, st in SWEEP:
            cfg = LaunchConfig(b, w, p, st)
            pts = gather_points(f"hbm-sweep-{b}x{w}w-{p}pps-stream{int(st)}",
                                lambda ids: lambda: triton_gather.gather_rows(values, scales, ids, "mxfp8", DIM,
                                                                              cfg=cfg),
                                rows, args.rep_ms, [1 << 10, 1 << 18, 1 << 22], ["uniform"], lim, 2 * DIM)
            sweep.append({"config": cfg.__dict__, "points": pts, "us_256k_plus_4m": pts[1]["us"] + pts[2]["us"]})
        res["sweep"] = sweep
        triton_gather.CONFIG = LaunchConfig(**min(sweep, key=lambda e: e["us_256k_plus_4m"])["config"])
    res["config"] = triton_gather.CONFIG.__dict__
    res["triton_bf16"] = gather_points("hbm-triton-bf16", lambda ids: lambda: triton_gather.gather_rows(
        values, scales, ids, "mxfp8", DIM), rows, args.rep_ms, SIZES, ["uniform", "zipf"], lim, 2 * DIM)
    res["triton_raw"] = gather_points("hbm-triton-raw", lambda ids: lambda: triton_gather.gather_raw(values, ids),
                                      rows, args.rep_ms, SIZES, ["uniform"], lim, DIM)
    # The same kernel over consecutive rows: the gather's access pattern taken out of the measurement.
    for n in (1 << 18, 1 << 22):
        seq = torch.arange(n, device="cuda")
        us = _bench(lambda: triton_gather.gather_rows(values, scales, seq, "mxfp8", DIM), args.rep_ms)
        moved = n * (ROW_IN + 2 * DIM) / us / 1e3
        res[f"consecutive_{n}"] = {"us": round(us, 2), "GBps_read_plus_written": round(moved, 1),
                                   "of_copy_limit": round(moved / lim["copy_GBps_read_plus_written"], 3),
                                   "of_widen_limit": round(moved / lim["widen_u8_bf16_GBps_read_plus_written"], 3)}
        print(json.dumps({f"consecutive_{n}": res[f"consecutive_{n}"]}), flush=True)
    res["torch_index_select_raw"] = gather_points("hbm-torch-index_select", lambda ids: lambda: values.index_select(
        0, ids), rows, args.rep_ms, [1 << 10, 1 << 18, 1 << 22], ["uniform"], lim, DIM)
    res["torch_reference_bf16"] = gather_points("hbm-torch-reference", lambda ids: lambda: reference.gather_rows(
        values, scales, ids, "mxfp8", DIM), rows, args.rep_ms, [1 << 10, 1 << 18, 1 << 22], ["uniform"], lim, 2 * DIM)
    # Small batches as the engine issues them: replay of a captured graph (no Python launch cost).
    res["graph_us"] = {}
    for n in (1 << 10, 1 << 12, 1 << 14):
        ids = uniform_ids(n, rows, torch.Generator(device="cuda").manual_seed(3))
        out = torch.empty(n, DIM, dtype=torch.bfloat16, device="cuda")
        triton_gather.gather_rows(values, scales, ids, "mxfp8", DIM, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_gather.gather_rows(values, scales, ids, "mxfp8", DIM, out=out)
        res["graph_us"][n] = round(_bench(graph.replay, args.rep_ms), 2)
    res["graph_1k_us"] = res["graph_us"][1 << 10]
    del values, scales
    torch.cuda.empty_cache()
    return res


def overhead() -> dict:
    """Host µs per call (no sync inside the loop): what Python + the Triton launcher cost per batch."""
    from engram.store import kernels
    from engram.store.kernels import triton_gather, uva
    rows = 1 << 20
    v = torch.randint(0, 256, (rows, DIM), dtype=torch.uint8, device="cuda")
    s = torch.randint(100, 140, (rows, DIM // 32), dtype=torch.uint8, device="cuda")
    ids = torch.randint(0, rows, (1024,), device="cuda")
    ids64k = torch.randint(0, rows, (1 << 16,), device="cuda")
    out = torch.empty(1024, DIM, dtype=torch.bfloat16, device="cuda")
    calls = {
        "triton_gather.gather_rows": lambda: triton_gather.gather_rows(v, s, ids, "mxfp8", DIM, out=out),
        "kernels.gather_rows (dispatch)": lambda: kernels.gather_rows(v, s, ids, "mxfp8", DIM, out=out),
        "uva.sort_plan 64K": lambda: uva.sort_plan(ids64k, rows),
        "uva.gather_rows sorted 64K (HBM table)": lambda: uva.gather_rows(v, s, ids64k, "mxfp8", DIM, route="sorted"),
        "torch index_select 1K": lambda: v.index_select(0, ids),
    }
    res = {}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        res[name] = round((time.perf_counter() - t0) / 300 * 1e6, 2)
        torch.cuda.synchronize()
        print(name, res[name], "us/call", flush=True)
    return res


def run(args: argparse.Namespace) -> int:
    from engram.bench.report import args_config, format_table, write_result
    if not torch.cuda.is_available():
        print("gpu_lookup needs CUDA")
        return 2
    lim = limits(args.rep_ms)
    print(json.dumps(lim), flush=True)
    result: dict = {"limits": lim}
    args.parts = args.parts.split(",")
    if "overhead" in args.parts:
        result["overhead_us_per_call"] = overhead()
    if "hbm" in args.parts:
        result["hbm"] = hbm(args, lim)
    from benchmarks import host_lookup
    if "pin" in args.parts:
        result["pin"] = host_lookup.pin_part(args, lim)
    if "uva" in args.parts:
        result["uva"] = host_lookup.uva_runs(args, lim)
    if "probe" in args.parts:
        result["probe"] = host_lookup.probe_part(args, lim)
    path = write_result("gpu-lookup", args_config(args), result, out=args.out)  # git: ENGRAM_COMMIT off a checkout
    rows = result.get("hbm", {}).get("triton_bf16", []) + result.get("uva", {}).get("auto", [])
    for info in result.get("pin", []):
        rows += [p for k, pts in info.items() if k.startswith(("route=", "scales")) for p in pts]
    for pts in result.get("uva", {}).get("routes", {}).values():
        rows += pts
    print(format_table(rows, ["path", "dist", "rows", "us", "Mrows_per_s", "GBps_rows_read", "of_copy_limit",
                              "of_h2d_limit"]))
    print(f"limits: {lim}; graph 1K: {result.get('hbm', {}).get('graph_1k_us')} us; json: {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
