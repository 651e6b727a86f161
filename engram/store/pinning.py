"""Page-locked (pinned) host copies of big tables, fast enough for tables of tens of gigabytes.

``pin_tensor(t)`` returns a pinned tensor with ``t``'s dtype, shape and contents when CUDA is available,
and ``t`` itself otherwise (or when it is already pinned or on a device). By default the copy goes into a
fresh 2 MiB-aligned anonymous mapping advised for transparent huge pages, written by several threads,
then registered with ONE ``cudaHostRegister`` (mapped + portable, so kernels read it through UVA; a copy
may not span two registrations, so the table is never registered in pieces); it is unregistered when the
last tensor viewing it is freed. Measured on the H200 machine (docs/benchmarks.md): 8 GiB pin in 0.64 s
this way, 2.1 s without huge pages, 4.1 s with cuMemHostAlloc (``method="alloc"``), 5.1 s with
``torch.empty(pin_memory=True)``, which also rounds sizes up to a power of two; UVA gathers ran at the
same speed from all four.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

HUGE_PAGE = 2 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped (and CU_MEMHOSTALLOC_PORTABLE | _DEVICEMAP): visible to
# every context, addressable from kernels.
_REGISTER_FLAGS = 0x01 | 0x02
_ALLOC_FLAGS = 0x01 | 0x02
PIN_METHODS = ("alloc", "register")
_STATS_LOCK = threading.Lock()
_STATS = {"pinned_bytes": 0, "regions": 0}


def pinned_stats() -> dict:
    """Bytes and regions currently pinned by ``pin_tensor`` (for tests and the store's stats)."""
    with _STATS_LOCK:
        return dict(_STATS)


def _check(err, what: str) -> None:
    code = int(err.value) if hasattr(err, "value") else int(err)
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code} ({err})")


def _cuda_driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
    return lib


def _count(nbytes: int, regions: int) -> None:
    with _STATS_LOCK:
        _STATS["pinned_bytes"] += nbytes
        _STATS["regions"] += regions


def _unregister(ptr: int, region: mmap.mmap, nbytes: int) -> None:
    """Finalizer of a registered region: unregister, then unmap (the memoryview that exported it is gone)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)
    _count(-nbytes, -1)
    try:
        region.close()
    except BufferError:  # a stray export still alive: the map is freed when it goes
        pass


def _free_host(ptr: int, nbytes: int) -> None:
    _cuda_driver().cuMemFreeHost(ctypes.c_void_p(ptr))
    _count(-nbytes, -1)


def _copy_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int, threads: int) -> None:
    """dst[:] = src (uint8 [nbytes] each) in chunks from a few threads: first touches (page faults) and
    the copy itself run in parallel; torch's copy releases the GIL."""
    spans = [(off, min(chunk_bytes, src.numel() - off)) for off in range(0, src.numel(), chunk_bytes)]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(spans)))) as pool:
        list(pool.map(lambda s: dst[s[0]:s[0] + s[1]].copy_(src[s[0]:s[0] + s[1]]), spans))


def _pin_register(src: torch.Tensor, huge_pages: bool, chunk_bytes: int, threads: int) -> torch.Tensor:
    nbytes = src.numel()
    # Over-allocate one huge page so the region can start on a 2 MiB boundary (THP backs aligned spans only).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    base_unaligned = torch.frombuffer(view, dtype=torch.uint8, count=1).data_ptr()
    start = (-base_unaligned) % HUGE_PAGE
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:  # THP disabled on this kernel: plain pages still work, only slower
            pass
    window = view[start:start + nbytes]
    dst = torch.frombuffer(window, dtype=torch.uint8)  # [nbytes], keeps `window` (and the map) alive
    _copy_chunks(dst, src, chunk_bytes, threads)
    # One registration for the whole table: a copy (cudaMemcpy) may not span two registered ranges.
    err = torch.cuda.cudart().cudaHostRegister(dst.data_ptr(), nbytes, _REGISTER_FLAGS)
    _check(err, f"cudaHostRegister(ptr=0x{dst.data_ptr():x}, bytes={nbytes})")
    _count(nbytes, 1)
    weakref.finalize(window, _unregister, dst.data_ptr(), region, nbytes)
    view.release()
    return dst


def _pin_alloc(src: torch.Tensor, chunk_bytes: int, threads: int) -> torch.Tensor:
    nbytes = src.numel()
    torch.cuda.init()
    torch.cuda.current_stream().synchronize()  # makes the primary context current on this thread
    ptr = ctypes.c_void_p()
    err = _cuda_driver().cuMemHostAlloc(ctypes.byref(ptr), nbytes, _ALLOC_FLAGS)
    if err != 0:
        raise RuntimeError(f"cuMemHostAlloc(bytes={nbytes}) failed with CUDA driver error {err}")
    arr = (ctypes.c_uint8 * nbytes).from_address(ptr.value)
    dst = torch.frombuffer(arr, dtype=torch.uint8)  # [nbytes], keeps `arr` alive
    _count(nbytes, 1)
    weakref.finalize(arr, _free_host, ptr.value, nbytes)
    _copy_chunks(dst, src, chunk_bytes, threads)
    return dst


def pin_tensor(t: torch.Tensor, *, method: str = "register", huge_pages: bool = True, chunk_bytes: int = 1 << 30,
               threads: int = 8) -> torch.Tensor:
    """A pinned host tensor equal to ``t`` (same dtype, shape, bytes); ``t`` unchanged without CUDA.
    ``method``: "register" (a huge-page mapping registered with cudaHostRegister; default, the fastest to
    pin) or "alloc" (cuMemHostAlloc); ``huge_pages`` applies to "register"."""
    if method not in PIN_METHODS:
        raise ValueError(f"method={method!r} is not one of {PIN_METHODS}")
    if chunk_bytes <= 0 or chunk_bytes % mmap.PAGESIZE:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of the page size {mmap.PAGESIZE}")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    if not torch.cuda.is_available() or t.device.type != "cpu" or t.numel() == 0 or t.is_pinned():
        return t
    src = t.contiguous().reshape(-1).view(torch.uint8)  # [nbytes] raw bytes, any dtype
    if method == "alloc":
        dst = _pin_alloc(src, chunk_bytes, threads)
    else:
        dst = _pin_register(src, huge_pages, chunk_bytes, threads)
    return dst.view(t.dtype).reshape(t.shape)
