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
GPU only; called by ``benchmarks.gpu_lookup`` (part ``probe``), which owns the limits and the JSON.
"""
from __future__ import annotations

import ctypes
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


def packed_copy(values: torch.Tensor, scales: torch.Tensor,
                stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pinned [R, stride] table whose rows are values then scales then zeros; returns (buffer, values view,
    scales view). Filled row block by row block through the GPU (the bench's tables are random anyway)."""
    from engram.store.pinning import pin_tensor
    rows, vb, sc = values.shape[0], values.shape[1], scales.shape[1]
    buf = pin_tensor(torch.empty(rows, stride, dtype=torch.uint8))  # [R, stride]; padding is never read
    step = 1 << 22
    for r in range(0, rows, step):
        blk = torch.cat([values[r:r + step].cuda(), scales[r:r + step].cuda()], dim=1)  # [b, vb + sc]
        buf[r:r + step, : vb + sc].copy_(blk)
    torch.cuda.synchronize()
    return buf, buf[:, :vb], buf[:, vb:vb + sc]


def layout(bench, layouts: dict, rep_ms: int, lim: dict,
           sizes=(1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 22)) -> list[dict]:
    """uva.gather_rows (dequant to bf16, route as shipped) per host layout ({name: (values, scales)});
    every layout must gather the same bytes."""
    from engram.store.kernels import uva
    values, scales = next(iter(layouts.values()))
    dim = values.shape[1]
    out = []
    g = torch.Generator(device="cuda").manual_seed(12)
    for n in sizes:
        ids = torch.randint(0, values.shape[0], (n,), generator=g, device="cuda")
        ref = None
        for name, (v, s) in layouts.items():
            res = uva.gather_rows(v, s, ids, "mxfp8", dim)
            if ref is None:
                ref = res
            elif not torch.equal(res.view(torch.uint8), ref.view(torch.uint8)):
                raise AssertionError(f"layout {name} gathered different bytes at {n} rows")
            us = bench(lambda: uva.gather_rows(v, s, ids, "mxfp8", dim), rep_ms)
            gbps = n * (dim + scales.shape[1]) / us / 1e3
            out.append({"part": "layout", "layout": name, "rows": n, "us": round(us, 2),
                        "GBps_rows_read": round(gbps, 2), "of_h2d_limit": round(gbps / lim["h2d_GBps"], 3)})
            print(json.dumps(out[-1]), flush=True)
    return out


def graph(bench, values: torch.Tensor, scales: torch.Tensor, rep_ms: int, layout: str = "split",
          sizes=(1 << 10, 1 << 14)) -> list[dict]:
    """GPU time of uva.gather_rows (captured graph, replayed) vs the direct call at small batch sizes."""
    from engram.store.kernels import uva
    dim = values.shape[1]
    out = []
    for n in sizes:
        ids = torch.randint(0, values.shape[0], (n,), device="cuda")
        dst = torch.empty(n, dim, dtype=torch.bfloat16, device="cuda")
        direct = bench(lambda: uva.gather_rows(values, scales, ids, "mxfp8", dim, out=dst), rep_ms)
        row = {"part": "graph", "layout": layout, "rows": n, "route": uva.route_for(n), "us_direct": round(direct, 2)}
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


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def vmm_host_table(nbytes: int, cpu_access: bool) -> tuple[int, int, object]:
    """Pinned host memory from the CUDA virtual memory API (cuMemCreate, location HOST_NUMA 0), mapped for
    device 0 (and the CPU when ``cpu_access``): (device address, mapped bytes, release callable)."""
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.cuda.current_stream().synchronize()
    prop = _Prop(type=1, handle_types=0, loc_type=3, loc_id=0)  # PINNED, HOST_NUMA node 0
    gran = ctypes.c_size_t()
    err = cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1)  # RECOMMENDED
    if err:
        raise RuntimeError(f"cuMemGetAllocationGranularity: CUDA error {err}")
    size = -(-nbytes // gran.value) * gran.value
    handle = ctypes.c_ulonglong()
    err = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    if err:
        raise RuntimeError(f"cuMemCreate(HOST_NUMA, {size} B, granularity {gran.value}): CUDA error {err}")
    ptr = ctypes.c_ulonglong()
    err = cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(gran.value),
                                 ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    if err:
        raise RuntimeError(f"cuMemAddressReserve: CUDA error {err}")
    err = cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    if err:
        raise RuntimeError(f"cuMemMap: CUDA error {err}")
    desc = (_Access * 2)(_Access(1, torch.cuda.current_device(), 3), _Access(3, 0, 3))  # device, host: RW
    err = cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), desc, ctypes.c_size_t(2 if cpu_access else 1))
    cpu_err = None
    if err and cpu_access:  # no CPU mapping on this driver: keep the device one
        cpu_err, cpu_access = err, False
        err = cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), desc, ctypes.c_size_t(1))
    if err:
        raise RuntimeError(f"cuMemSetAccess(device): CUDA error {err}")

    def release() -> None:
        cu.cuMemUnmap(ptr, ctypes.c_size_t(size))
        cu.cuMemRelease(handle)
        cu.cuMemAddressFree(ptr, ctypes.c_size_t(size))
    return ptr.value, size, {"granularity": gran.value, "release": release, "cpu_access": cpu_access,
                             "cpu_access_error": cpu_err}


def vmm_window(bench, gib: float, rep_ms: int) -> list[dict]:
    """``window`` over a cuMemCreate host table of ``gib`` GiB (filled from the GPU with cuMemcpy, read through
    its CPU mapping as a tensor): says whether the mapping's page size, not the host memory, sets the cost."""
    cu = ctypes.CDLL("libcuda.so.1")
    stride = 256
    rows = int(gib * (1 << 30)) // stride
    t0 = time.perf_counter()
    ptr, size, info = vmm_host_table(rows * stride, cpu_access=True)
    alloc_s = time.perf_counter() - t0
    if not info["cpu_access"]:
        info["release"]()
        raise RuntimeError(f"cuMemSetAccess gave no CPU mapping (CUDA error {info['cpu_access_error']})")
    chunk = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    for off in range(0, rows * stride, chunk.numel()):
        n = min(chunk.numel(), rows * stride - off)
        err = cu.cuMemcpy(ctypes.c_ulonglong(ptr + off), ctypes.c_ulonglong(chunk.data_ptr()), ctypes.c_size_t(n))
        if err:
            raise RuntimeError(f"cuMemcpy into the VMM host table at {off}: CUDA error {err}")
    torch.cuda.synchronize()
    values = torch.frombuffer((ctypes.c_uint8 * (rows * stride)).from_address(ptr), dtype=torch.uint8)
    values = values.view(rows, stride)  # [R, 256] over the mapping: triton_gather reads it through UVA
    out = [{"part": "vmm", "GiB": gib, "granularity": info["granularity"], "alloc_map_s": round(alloc_s, 3),
            "fill_s": round(time.perf_counter() - t0 - alloc_s, 3),
            "cpu_first_page_equals_gpu": bool(torch.equal(values[:16].reshape(-1), chunk[:4096].cpu()))}]
    print(json.dumps(out[-1]), flush=True)
    out += [dict(p, part="vmm_" + p["part"]) for p in window(bench, values, rep_ms)]
    del values
    info["release"]()
    return out


if __name__ == "__main__":  # the VMM probe runs in its own process: a failed CPU mapping cannot take the bench down
    import sys

    import triton.testing
    gib, rep = float(sys.argv[1]), int(sys.argv[2])
    res = vmm_window(lambda fn, r: triton.testing.do_bench(fn, warmup=25, rep=r, return_mode="median") * 1e3, gib, rep)
    print("VMM_RESULT " + json.dumps(res), flush=True)
