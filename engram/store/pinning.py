"""Page-locked (pinned) host copies of big tables, fast enough for tables of tens of gigabytes.

``pin_tensor(t)`` returns a pinned tensor with ``t``'s dtype, shape and contents when CUDA is available,
and ``t`` itself otherwise (or when it is already pinned or on a device). The copy lives in a fresh
2 MiB-aligned anonymous mapping advised for transparent huge pages, is registered with the driver in
chunks from a few threads (``cudaHostRegister``, mapped + portable, so kernels can read it through UVA),
and is unregistered when the last tensor viewing it is freed.

Why not ``torch.empty(pin_memory=True)``: the caching host allocator rounds sizes up to a power of two
(a 20 GiB table would take 32 GiB) and pins 4 KiB pages one by one. Huge pages make both the registration
and the GPU's address translation of random row reads cheaper (FACTS.md: random UVA reads thrash it).
"""
from __future__ import annotations

import mmap
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

HUGE_PAGE = 2 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every context, addressable from kernels.
_REGISTER_FLAGS = 0x01 | 0x02
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


def _unpin(chunks: list[tuple[int, int]], region: mmap.mmap, nbytes: int) -> None:
    """Finalizer: unregister every chunk, then unmap (the memoryview that exported the map is gone)."""
    cudart = torch.cuda.cudart()
    for ptr, _ in chunks:
        cudart.cudaHostUnregister(ptr)
    with _STATS_LOCK:
        _STATS["pinned_bytes"] -= nbytes
        _STATS["regions"] -= 1
    try:
        region.close()
    except BufferError:  # a stray export still alive: the map is freed when it goes
        pass


def _register_chunks(base: int, nbytes: int, chunk_bytes: int, threads: int) -> list[tuple[int, int]]:
    cudart = torch.cuda.cudart()
    chunks = [(base + off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]
    done: list[tuple[int, int]] = []
    lock = threading.Lock()

    def register(chunk: tuple[int, int]) -> None:
        ptr, size = chunk
        err = cudart.cudaHostRegister(ptr, size, _REGISTER_FLAGS)
        _check(err, f"cudaHostRegister(ptr=0x{ptr:x}, bytes={size}) at offset {ptr - base} of a {nbytes}-byte table")
        with lock:
            done.append(chunk)

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(chunks)))) as pool:
            list(pool.map(register, chunks))
    except Exception:
        for ptr, _ in done:
            cudart.cudaHostUnregister(ptr)
        raise
    return chunks


def pin_tensor(t: torch.Tensor, *, huge_pages: bool = True, chunk_bytes: int = 1 << 30,
               threads: int = 8) -> torch.Tensor:
    """A pinned host tensor equal to ``t`` (same dtype, shape, bytes); ``t`` unchanged without CUDA."""
    if chunk_bytes <= 0 or chunk_bytes % mmap.PAGESIZE:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of the page size {mmap.PAGESIZE}")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    if not torch.cuda.is_available() or t.device.type != "cpu" or t.numel() == 0 or t.is_pinned():
        return t
    src = t.contiguous().reshape(-1).view(torch.uint8)  # [nbytes] raw bytes, any dtype
    nbytes = src.numel()
    # Over-allocate one huge page so the region can start on a 2 MiB boundary (THP backs aligned spans only).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    base_unaligned = torch.frombuffer(view, dtype=torch.uint8, count=1).data_ptr()
    start = (-base_unaligned) % HUGE_PAGE
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % mmap.PAGESIZE or mmap.PAGESIZE)
        except OSError:  # THP disabled on this kernel: plain pages still work, only slower
            pass
    window = view[start:start + nbytes]
    dst = torch.frombuffer(window, dtype=torch.uint8)  # [nbytes], keeps `window` (and the map) alive
    for off in range(0, nbytes, chunk_bytes):  # chunked so torch's copy threads stream, and faults stay local
        dst[off:off + chunk_bytes].copy_(src[off:off + chunk_bytes])
    chunks = _register_chunks(dst.data_ptr(), nbytes, chunk_bytes, threads)
    with _STATS_LOCK:
        _STATS["pinned_bytes"] += nbytes
        _STATS["regions"] += 1
    # `window` dies with the last tensor sharing dst's storage; `view` must go too so the map can close.
    weakref.finalize(window, _unpin, chunks, region, nbytes)
    view.release()
    return dst.view(t.dtype).reshape(t.shape)
