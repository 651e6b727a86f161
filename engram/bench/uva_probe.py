"""Where the time of a UVA gather goes: host pages touched, row layout, GPU time vs host launch, CPU route.

Four measurements over pinned host tables, each answering one question about the ``host`` tier's gather:
- ``window``: raw 256-B rows, ids uniform over a window of the table from 2 MiB to the whole table,
  unsorted and sorted, with the L2 flushed between calls (as after a model step) and not. If time per
  row follows the number of distinct host pages touched rather than the bytes, the cost is address
  translation, not the kernel or PCIe; ``dense`` (consecutive rows) gives the kernel's PCIe ceiling.
- ``layout``: the MXFP8 dequant gather (``uva.gather_rows``, sort policy as shipped) from a table whose
  scales live in a separate buffer ("split", one more page per row) against rows stored as values +
  scales + padding in one 272-B or 264-B row ("packed").
- ``graph``: GPU-only time of small batches (a captured CUDA graph replayed), next to the direct call
  whose time includes Python and the Triton launcher.
- ``cpu_route``: the alternative route, rows gathered by the CPU into a pinned staging buffer and sent in
  one copy; host time, threads as given.
GPU only; called by ``engram.bench.gpu_lookup`` (part ``probe``), which owns the limits and the JSON.
"""
from __future__ import annotations

import json
import time

import torch

PAGE = 4096
HUGE = 2 << 20


def _time_noflush(fn, reps: int = 50) -> float:
    """Mean µs of ``fn`` over back-to-back calls timed with CUDA events (caches left warm)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _distinct(ids: torch.Tensor, stride: int, unit: int) -> int:
    return int(torch.unique(ids.to(torch.int64) * stride // unit).numel())


def window(bench, values: torch.Tensor, rep_ms: int, sizes=(1 << 14, 1 << 18)) -> list[dict]:
    """Raw rows ``values`` [R, 256] (pinned): time per row and per distinct page vs the id window."""
    from engram.store.kernels import triton_gather
    from engram.store.kernels.uva import UVA_CONFIG
    rows, stride = values.shape[0], values.stride(0)
    g = torch.Generator(device="cuda").manual_seed(11)
    windows = [HUGE, 32 << 20, 256 << 20, 2 << 30, 8 << 30, rows * stride]
    out = []
    for n in sizes:
        for w_bytes in sorted({min(w, rows * stride) for w in windows}):
            w_rows = w_bytes // stride
            ids = torch.randint(0, w_rows, (n,), generator=g, device="cuda")
            for order in ("random", "sorted"):
                x = ids if order == "random" else ids.sort().values
                dst = torch.empty(n, stride, dtype=torch.uint8, device="cuda")
                fn = lambda: triton_gather.gather_raw(values, x, dst, cfg=UVA_CONFIG)  # noqa: E731
                flushed, warm = bench(fn, rep_ms), _time_noflush(fn)
                pages, huge = _distinct(x, stride, PAGE), _distinct(x, stride, HUGE)
                out.append({"part": "window", "rows": n, "window_MiB": round(w_bytes / 2**20, 1), "order": order,
                            "pages_4k": pages, "pages_2m": huge, "us": round(flushed, 2), "us_warm": round(warm, 2),
                            "ns_per_row": round(flushed * 1e3 / n, 1), "ns_per_page": round(flushed * 1e3 / pages, 1),
                            "GBps": round(n * stride / flushed / 1e3, 2)})
                print(json.dumps(out[-1]), flush=True)
    for n in (1 << 16, 1 << 22):  # consecutive rows: the kernel against PCIe, translation amortized
        ids = torch.arange(n, device="cuda")
        dst = torch.empty(n, stride, dtype=torch.uint8, device="cuda")
        us = bench(lambda: triton_gather.gather_raw(values, ids, dst, cfg=UVA_CONFIG), rep_ms)
        out.append({"part": "dense", "rows": n, "us": round(us, 2), "GBps": round(n * stride / us / 1e3, 2),
                    "ns_per_page": round(us * 1e3 / (n * stride / PAGE), 1)})
        print(json.dumps(out[-1]), flush=True)
    return out


def packed_copy(values: torch.Tensor, scales: torch.Tensor, stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pinned [R, stride] table whose rows are values then scales then zeros; returns (buffer, values view,
    scales view). Filled row block by row block through the GPU (the bench's tables are random anyway)."""
    from engram.store.pinning import pin_tensor
    rows, vb, sc = values.shape[0], values.shape[1], scales.shape[1]
    buf = pin_tensor(torch.zeros(rows, stride, dtype=torch.uint8))  # [R, stride]
    step = 1 << 22
    for r in range(0, rows, step):
        blk = torch.cat([values[r:r + step].cuda(), scales[r:r + step].cuda()], dim=1)  # [b, vb + sc]
        buf[r:r + step, : vb + sc].copy_(blk)
    torch.cuda.synchronize()
    return buf, buf[:, :vb], buf[:, vb:vb + sc]


def layout(bench, values: torch.Tensor, scales: torch.Tensor, rep_ms: int, lim: dict,
           sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 22)) -> list[dict]:
    """uva.gather_rows (dequant to bf16, shipped sort policy) from split vs packed host layouts."""
    from engram.store.kernels import uva
    dim = values.shape[1]
    out = []
    layouts = [("split", values, scales, None)]
    for stride in (272, 264):
        buf, v, s = packed_copy(values, scales, stride)
        layouts.append((f"packed{stride}", v, s, buf))
    g = torch.Generator(device="cuda").manual_seed(12)
    id_sets = {n: torch.randint(0, values.shape[0], (n,), generator=g, device="cuda") for n in sizes}
    for n, ids in id_sets.items():
        ref = None
        for name, v, s, _ in layouts:
            res = uva.gather_rows(v, s, ids, "mxfp8", dim)
            if ref is None:
                ref = res
            elif not torch.equal(res.view(torch.uint8), ref.view(torch.uint8)):
                raise AssertionError(f"layout {name} gathered different bytes at {n} rows")
            us = bench(lambda: uva.gather_rows(v, s, ids, "mxfp8", dim), rep_ms)
            gbps = n * (dim + scales.shape[1]) / us / 1e3
            out.append({"part": "layout", "layout": name, "rows": n, "us": round(us, 2), "GBps_rows_read": round(gbps, 2),
                        "of_h2d_limit": round(gbps / lim["h2d_GBps"], 3)})
            print(json.dumps(out[-1]), flush=True)
    del layouts
    return out


def graph(bench, values: torch.Tensor, scales: torch.Tensor, rep_ms: int, sizes=(1 << 10, 1 << 14)) -> list[dict]:
    """GPU time of uva.gather_rows (captured graph, replayed) vs the direct call at small batch sizes."""
    from engram.store.kernels import uva
    dim = values.shape[1]
    out = []
    for n in sizes:
        ids = torch.randint(0, values.shape[0], (n,), device="cuda")
        dst = torch.empty(n, dim, dtype=torch.bfloat16, device="cuda")
        direct = bench(lambda: uva.gather_rows(values, scales, ids, "mxfp8", dim, out=dst), rep_ms)
        row = {"part": "graph", "rows": n, "sorted": n >= uva.SORT_MIN_ROWS, "us_direct": round(direct, 2)}
        try:
            uva.gather_rows(values, scales, ids, "mxfp8", dim, out=dst)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                uva.gather_rows(values, scales, ids, "mxfp8", dim, out=dst)
            row["us_graph"] = round(bench(g.replay, rep_ms), 2)
            row["us_graph_warm"] = round(_time_noflush(g.replay), 2)
        except RuntimeError as e:  # capture not supported for some op on this build: say so
            row["graph_error"] = str(e)[:200]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def cpu_route(packed: torch.Tensor, threads: int, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 22)) -> list[dict]:
    """CPU index_select of packed rows into pinned staging, then one H2D copy (host wall time, median)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = []
    try:
        for n in sizes:
            ids = torch.randint(0, packed.shape[0], (n,))
            stage = torch.empty(n, packed.shape[1], dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(n, packed.shape[1], dtype=torch.uint8, device="cuda")
            times = {"gather": [], "total": []}
            for _ in range(7):
                t0 = time.perf_counter()
                torch.index_select(packed, 0, ids, out=stage)
                t1 = time.perf_counter()
                dev.copy_(stage, non_blocking=True)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                times["gather"].append(t1 - t0)
                times["total"].append(t2 - t0)
            med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
            out.append({"part": "cpu_route", "threads": threads, "rows": n, "us_cpu_gather": round(med["gather"], 1),
                        "us": round(med["total"], 1), "GBps": round(n * packed.shape[1] / med["total"] / 1e3, 2)})
            print(json.dumps(out[-1]), flush=True)
    finally:
        torch.set_num_threads(old)
    return out
