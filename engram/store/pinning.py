"""Page-locked (pinned) host copies of big tables, fast enough for tables of tens of gigabytes. ``pin_tensor(t)``
returns a pinned copy of ``t`` when CUDA is available, else ``t``; ``pinned_empty_filled`` is the same with the caller
writing the bytes. The memory is a fresh 2 MiB-aligned anonymous mapping advised for huge pages, filled by several
threads, then registered with one ``cudaHostRegister`` (mapped + portable, for UVA; a copy may not span two
registrations), and unregistered when the last tensor viewing it is freed."""
from __future__ import annotations

import ctypes
import mmap
import threading
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

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
    """dst[:] = src (uint8) in chunks from a few threads, so page faults and copy run in parallel (GIL released)."""
    spans = [(off, min(chunk_bytes, src.numel() - off)) for off in range(0, src.numel(), chunk_bytes)]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(spans)))) as pool:
        list(pool.map(lambda s: dst[s[0]:s[0] + s[1]].copy_(src[s[0]:s[0] + s[1]]), spans))


def _map_region(nbytes: int, huge_pages: bool) -> tuple[mmap.mmap, memoryview, memoryview]:
    """A fresh anonymous mapping with a 2 MiB-aligned ``nbytes`` window (THP when asked) -> (map, its view, window)."""
    # Over-allocate one huge page so the window can start on a 2 MiB boundary (THP backs aligned spans only).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    base_unaligned = torch.frombuffer(view, dtype=torch.uint8, count=1).data_ptr()
    start = (-base_unaligned) % HUGE_PAGE
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:  # THP disabled on this kernel: plain pages still work, only slower
            pass
    return region, view, view[start:start + nbytes]


def _unmap(region: mmap.mmap, *views: memoryview) -> None:
    """Unmap now if nothing else views the map; otherwise it goes with its last view."""
    try:
        for v in views:
            v.release()
        region.close()
    except BufferError:
        pass


def _drop_fill_frames(err: BaseException) -> None:
    """Clear the locals of the frames ``err`` passed (workers' views of the destination): the mapping frees now."""
    while err is not None:
        traceback.clear_frames(err.__traceback__)  # executing frames are skipped
        err = err.__cause__ or err.__context__


def _filled_mapping(nbytes: int, fill: Callable[[torch.Tensor], None], huge_pages: bool,
                    register: bool) -> torch.Tensor:
    region, view, window = _map_region(nbytes, huge_pages)
    dst = torch.frombuffer(window, dtype=torch.uint8)  # [nbytes], keeps `window` (and the map) alive
    try:
        fill(dst)
    except BaseException as e:
        del dst
        _drop_fill_frames(e)
        _unmap(region, window, view)
        raise
    if not register:
        view.release()
        return dst
    # One registration for the whole table, after the fill: a copy (cudaMemcpy) may not span two registered
    # ranges, and a fill that fails leaves nothing registered.
    ptr = dst.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
    if int(getattr(err, "value", err)) != 0:
        del dst
        _unmap(region, window, view)
        _check(err, f"cudaHostRegister(ptr=0x{ptr:x}, bytes={nbytes})")
    _count(nbytes, 1)
    weakref.finalize(window, _unregister, ptr, region, nbytes)
    view.release()
    return dst


def _filled_alloc(nbytes: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
    torch.cuda.init()
    torch.cuda.current_stream().synchronize()  # makes the primary context current on this thread
    ptr = ctypes.c_void_p()
    err = _cuda_driver().cuMemHostAlloc(ctypes.byref(ptr), nbytes, _ALLOC_FLAGS)
    if err != 0:
        raise RuntimeError(f"cuMemHostAlloc(bytes={nbytes}) failed with CUDA driver error {err}")
    _count(nbytes, 1)
    arr = (ctypes.c_uint8 * nbytes).from_address(ptr.value)
    # The finalizer frees the block when the last tensor viewing `arr` goes, also after a failed fill.
    weakref.finalize(arr, _free_host, ptr.value, nbytes)
    dst = torch.frombuffer(arr, dtype=torch.uint8)  # [nbytes], keeps `arr` alive
    del arr
    try:
        fill(dst)
    except BaseException as e:
        del dst
        _drop_fill_frames(e)
        raise
    return dst


def pinned_empty_filled(nbytes: int, fill: Callable[[torch.Tensor], None], *, method: str = "register",
                        huge_pages: bool = True) -> torch.Tensor:
    """uint8 [nbytes] written by ``fill(dst)`` (which owns ``dst`` until it returns), then pinned with CUDA: "register"
    (one cudaHostRegister after the fill) or "alloc" (cuMemHostAlloc first). A raising ``fill`` leaves nothing."""
    if method not in PIN_METHODS:
        raise ValueError(f"method={method!r} is not one of {PIN_METHODS}")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    if nbytes == 0:
        dst = torch.empty(0, dtype=torch.uint8)
        fill(dst)
        return dst
    cuda = torch.cuda.is_available()
    if method == "alloc" and cuda:
        return _filled_alloc(nbytes, fill)
    return _filled_mapping(nbytes, fill, huge_pages, register=cuda)


def pin_tensor(t: torch.Tensor, *, method: str = "register", huge_pages: bool = True, chunk_bytes: int = 1 << 30,
               threads: int = 8) -> torch.Tensor:
    """A pinned host tensor equal to ``t`` (``t`` itself without CUDA); ``method`` as in ``pinned_empty_filled``."""
    if method not in PIN_METHODS:
        raise ValueError(f"method={method!r} is not one of {PIN_METHODS}")
    if chunk_bytes <= 0 or chunk_bytes % mmap.PAGESIZE:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of the page size {mmap.PAGESIZE}")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    if not torch.cuda.is_available() or t.device.type != "cpu" or t.numel() == 0 or t.is_pinned():
        return t
    src = t.contiguous().reshape(-1).view(torch.uint8)  # [nbytes] raw bytes, any dtype
    dst = pinned_empty_filled(src.numel(), lambda d: _copy_chunks(d, src, chunk_bytes, threads), method=method,
                              huge_pages=huge_pages)
    return dst.view(t.dtype).reshape(t.shape)
