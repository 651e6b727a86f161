"""The pinned-host-table parts of ``engram bench gpu-lookup``: pinning methods, the host tier's routes, the probe.

``pin_part`` pins one table size several ways and times UVA gathers from each; ``uva_runs`` times the
shipped route choice (GPU events) and every route as a caller sees it (``wall_points``: wall clock,
synchronized, L2 flushed before each call) on a big table in the host tier's layout; ``probe_part`` runs
benchmarks.uva_probe (where UVA time goes). Helpers and limits come from benchmarks.gpu_lookup.
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.gpu_lookup import DIM, ROW_IN, SIZES, _bench, gather_points, random_fill_, uniform_ids


def _pin(src: torch.Tensor, variant: str) -> torch.Tensor:
    from engram.store.pinning import pin_tensor
    if variant == "torch":  # the caching host allocator (cudaHostAlloc, size rounded up to a power of two)
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        return dst.copy_(src)
    if variant.startswith("register"):
        return pin_tensor(src, method="register", huge_pages=variant.endswith("thp"))
    return pin_tensor(src, method=variant)


def host_table(gib: float, variant: str = "register-thp",
               layout: str = "split") -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A pinned table of ``gib`` GiB of values: seconds to pin and to the first lookup (kernel compiled
    before). ``layout`` "split": values [R, 256] and scales [R, 8] apart; "packed": one [R, 272] buffer of
    values, scales, padding (the host tier's layout), returned as the two views."""
    from engram.store.kernels import uva
    rows = int(gib * (1 << 30)) // DIM
    t0 = time.perf_counter()
    if layout == "packed":
        buf = _pin(torch.empty(rows, 272, dtype=torch.uint8), variant)  # [R, 272]
        t1 = time.perf_counter()
        random_fill_(buf)  # random scale bytes too: NaN / inf rows cost the same time
        values, scales = buf[:, :DIM], buf[:, DIM:DIM + DIM // 32]
    else:
        src = random_fill_(torch.empty(rows, DIM, dtype=torch.uint8))  # pageable [R, 256]
        src_s = torch.randint(100, 140, (rows, DIM // 32), dtype=torch.uint8)
        t0 = time.perf_counter()
        values = _pin(src, variant)
        scales = _pin(src_s, variant)
        t1 = time.perf_counter()
        del src, src_s
    ids = torch.randint(0, rows, (1024,), device="cuda")
    t2 = time.perf_counter()
    uva.gather_rows(values, scales, ids, "mxfp8", DIM)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    gc.collect()
    return ({"GiB": gib, "rows": rows, "pin": variant, "layout": layout, "pin_s": round(t1 - t0, 3),
             "first_lookup_s": round(t3 - t2, 4), "AnonHugePages_kiB": _anon_huge_kib()}, values, scales)


def wall_points(name: str, fn_of_ids, rows: int, sizes, lim: dict, budget_s: float = 0.4) -> list:
    """Caller-visible time per call (host launch, CPU work and GPU work; synchronized, L2 flushed before
    each call, outside the timing): median over up to 25 calls within ``budget_s`` per point."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    pts = []
    for n in sizes:
        ids = uniform_ids(n, rows, g)
        fn = fn_of_ids(ids)
        fn()
        times: list[float] = []
        end = time.perf_counter() + budget_s
        while len(times) < 3 or (len(times) < 25 and time.perf_counter() < end):
            flush.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        us = sorted(times)[len(times) // 2] * 1e6
        gbps = n * ROW_IN / us / 1e3
        pts.append({"path": name, "dist": "uniform", "rows": n, "calls": len(times), "us": round(us, 2),
                    "GBps_rows_read": round(gbps, 2), "of_h2d_limit": round(gbps / lim["h2d_GBps"], 3)})
        print(json.dumps(pts[-1]), flush=True)
    return pts


def _anon_huge_kib() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def pin_part(args, lim: dict) -> list:
    """Each pinning variant on one table size: pin time, then unsorted / sorted UVA gathers."""
    from engram.store.kernels import uva
    out = []
    for variant in args.pin_methods.split(","):
        info, v, s = host_table(args.pin_gib, variant)
        print(json.dumps(info), flush=True)
        rows = v.shape[0]
        for route in ("direct", "sorted"):
            info[f"route={route}"] = gather_points(f"uva-{variant}-{route}", lambda ids: lambda: uva.gather_rows(
                v, s, ids, "mxfp8", DIM, route=route), rows, args.rep_ms, [1 << 10, 1 << 14, 1 << 18, 1 << 22],
                ["uniform"], lim, 2 * DIM)
        if variant == "alloc":  # scales kept in HBM: one host read per row instead of two
            sd = s.cuda()
            info["scales_in_hbm"] = gather_points("uva-alloc-scales-hbm", lambda ids: lambda: uva.gather_rows(
                v, sd, ids, "mxfp8", DIM, route="sorted"), rows, args.rep_ms, [1 << 10, 1 << 14, 1 << 18, 1 << 22],
                ["uniform"], lim, 2 * DIM)
            del sd
        out.append(info)
        del v, s
        gc.collect()
    return out


def uva_runs(args, lim: dict) -> dict:
    """The host tier's gather on a ``--host-gib`` table in ``--host-layout``: the shipped route choice (GPU
    time, uniform and Zipf), then every route timed as a caller sees it (wall clock)."""
    from engram.store.kernels import uva
    res: dict = {}
    try:
        res["thp_setting"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        res["thp_setting"] = None
    info, values, scales = host_table(args.host_gib, layout=args.host_layout)
    res["main_table"] = info
    res["staged_min_rows"] = uva.STAGED_MIN_ROWS
    print(json.dumps(info), flush=True)
    rows = values.shape[0]
    res["auto"] = gather_points("uva-auto", lambda ids: lambda: uva.gather_rows(values, scales, ids, "mxfp8", DIM),
                                rows, args.rep_ms, SIZES, ["uniform", "zipf"], lim, 2 * DIM)
    res["routes"] = {}
    for route in ("direct", "sorted", "staged"):
        res["routes"][route] = wall_points(f"host-{route}-wall", lambda ids: lambda: uva.gather_rows(
            values, scales, ids, "mxfp8", DIM, route=route), rows, SIZES, lim)
    res["routes"]["staged_cpu_ids"] = wall_points("host-staged-cpu-ids-wall", lambda ids: (
        lambda c: lambda: uva.gather_rows(values, scales, c, "mxfp8", DIM, route="staged"))(ids.cpu()), rows,
        SIZES, lim)
    if "sweep" in args.parts:  # launch configs for the sorted host path: uva passes uva.UVA_CONFIG to every launch
        from engram.store.kernels.launch_config import LaunchConfig
        chosen, res["sweep"] = uva.UVA_CONFIG, []
        for b, w, p, st in [(32, 4, 0, True), (64, 8, 0, True), (16, 4, 0, True), (64, 8, -1, True)]:
            uva.UVA_CONFIG = LaunchConfig(b, w, p, st)
            res["sweep"].append({"config": uva.UVA_CONFIG.__dict__, "points": gather_points(
                f"uva-sorted-{b}x{w}w-{p}pps", lambda ids: lambda: uva.gather_rows(values, scales, ids, "mxfp8", DIM,
                                                                                  route="sorted"),
                rows, args.rep_ms, [1 << 18, 1 << 22], ["uniform"], lim, 2 * DIM)})
        uva.UVA_CONFIG = chosen
    g = torch.Generator(device="cuda").manual_seed(5)
    sort_cost = {}
    for n in (1 << 14, 1 << 18, 1 << 22):
        ids = uniform_ids(n, rows, g)
        sort_cost[n] = round(_bench(lambda: uva.sort_plan(ids, rows), args.rep_ms), 2)
    res["sort_plan_us"] = sort_cost
    return res


def probe_part(args, lim: dict) -> dict:
    """benchmarks.uva_probe on a ``--host-gib`` table: the ``--probe`` sub-parts (window, graph, layout, cpu,
    vmm; vmm runs in a child process)."""
    import subprocess
    import sys

    from benchmarks import uva_probe
    subs = set(args.probe.split(","))
    res: dict = {}
    info, values, scales = host_table(args.host_gib)
    res["main_table"] = info
    if "window" in subs:
        res["window"] = uva_probe.window(_bench, values, args.rep_ms)
    layouts = {"split": (values, scales)}
    if subs & {"graph", "layout", "cpu"}:
        packed, v, s = uva_probe.packed_copy(values, scales, 272)
        layouts["packed272"] = (v, s)
    if "graph" in subs:
        res["graph"] = [p for name, (v, s) in layouts.items() for p in uva_probe.graph(_bench, v, s, args.rep_ms, name)]
    if "layout" in subs:
        res["layout"] = uva_probe.layout(_bench, layouts, args.rep_ms, lim)
    del values, scales, layouts
    gc.collect()
    if "cpu" in subs:
        res["cpu_route"] = uva_probe.cpu_route(packed, args.cpu_threads)
    if subs & {"graph", "layout", "cpu"}:
        del packed, v, s
        gc.collect()
    if "vmm" in subs:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.uva_probe", str(args.host_gib), str(args.rep_ms)],
                              capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VMM_RESULT ")]
        res["vmm"] = json.loads(lines[-1].split(" ", 1)[1]) if lines else {"rc": proc.returncode,
                                                                              "stderr": proc.stderr[-1500:]}
    return res
