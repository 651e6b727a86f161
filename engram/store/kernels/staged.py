"""Rows of a pinned host table gathered by the CPU into pinned staging and sent to the GPU in chunks.

The ``host`` tier's second route beside UVA (uva.py). On the device machine a UVA read of a random row
costs a host-side address translation that grows with the span of host memory the batch touches (26 ns
per row over 32 GiB against 5 ns within 256 MiB, the same with 4 KiB, huge-page and 2 MiB cuMemCreate
mappings: docs/benchmarks.md), while the CPU gathers random rows at ~40 GB/s and the copy engine moves a
contiguous buffer at the PCIe rate. So: CPU threads ``index_select`` chunk after chunk of rows into a
pinned buffer; each chunk's host-to-device copy is queued on a side stream as soon as it is gathered, so
copies overlap the next chunk's gather; the GPU then dequantizes the staged packed rows with the HBM
kernel (rows in id order, bitwise equal to every other route). The call waits for the gather (CPU
work) but not for the copies or the dequant: the caller's stream is ordered after them.
"""
from __future__ import annotations

import os
import threading

import torch

CHUNK_ROWS = int(os.environ.get("ENGRAM_STAGED_CHUNK_ROWS", "16384"))


def row_sources(values: torch.Tensor, scales: torch.Tensor | None) -> list[torch.Tensor]:
    """The 2-D tensors a row gather copies from. When ``scales`` sit in the same rows right after the values
    (the host tier's packed layout), one source: the whole rows of the underlying buffer, [R, row stride]
    and contiguous where the storage holds every row's padding (so ``index_select`` copies each row with one
    memcpy), else [R, value_bytes + scale_cols]. Otherwise values [and scales]."""
    if (scales is not None and scales.stride(0) == values.stride(0) and scales.stride(1) == 1
            and values.stride(1) == 1 and scales.shape[0] == values.shape[0]
            and scales.data_ptr() == values.data_ptr() + values.shape[1]):
        rows, stride = values.shape[0], values.stride(0)
        storage_end = values.untyped_storage().nbytes() - values.storage_offset() * values.element_size()
        width = stride if rows * stride <= storage_end else values.shape[1] + scales.shape[1]
        return [values.as_strided((rows, width), (stride, 1))]
    return [values] if scales is None else [values, scales]


class _Stager:
    """Per device: a pinned staging buffer reused across calls, the side stream of its copies, and the event
    after the last copy (the buffer is not rewritten before that copy has read it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buf: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None
        self.lock = threading.Lock()

    def buffer(self, nbytes: int) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None
            self.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)  # [bytes]
        return self.buf[:nbytes]


_STAGERS: dict[torch.device, _Stager] = {}
_STAGERS_LOCK = threading.Lock()


def _stager(device: torch.device) -> _Stager:
    with _STAGERS_LOCK:
        if device not in _STAGERS:
            _STAGERS[device] = _Stager(device)
        return _STAGERS[device]


def device_for(ids: torch.Tensor, out: torch.Tensor | None) -> torch.device:
    """Where gathered rows go: ids' CUDA device, else out's, else the current CUDA device."""
    if ids.is_cuda:
        return ids.device
    if out is not None and out.is_cuda:
        return out.device
    return torch.device("cuda", torch.cuda.current_device())


def stage_rows(sources: list[torch.Tensor], ids: torch.Tensor, device: torch.device,
               chunk_rows: int = CHUNK_ROWS) -> list[torch.Tensor]:
    """Rows ``ids`` of each source (CPU [R, w_j]) as uint8 [N, w_j] tensors on ``device``; the current stream
    of ``device`` is ordered after their copies."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1")
    idx = ids.to("cpu", torch.int64)  # [N]; syncs when ids are on the GPU
    n = idx.numel()
    widths = [s.shape[1] for s in sources]
    dev = [torch.empty(n, w, dtype=torch.uint8, device=device) for w in widths]  # [N, w_j] each
    st = _stager(device)
    with st.lock:
        flat = st.buffer(n * sum(widths))
        host, off = [], 0
        for w in widths:
            host.append(flat[off:off + n * w].view(n, w))  # [N, w_j] pinned, contiguous
            off += n * w
        current = torch.cuda.current_stream(device)
        st.stream.wait_stream(current)  # `dev` was allocated on the current stream
        for c0 in range(0, n, chunk_rows):
            c1 = min(n, c0 + chunk_rows)
            for src, h in zip(sources, host):
                torch.index_select(src, 0, idx[c0:c1], out=h[c0:c1])
            with torch.cuda.stream(st.stream):
                for h, d in zip(host, dev):
                    d[c0:c1].copy_(h[c0:c1], non_blocking=True)
        st.done = torch.cuda.Event()
        st.done.record(st.stream)
        current.wait_event(st.done)
    return dev


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                device: torch.device | None = None, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """Rows ``ids`` of a pinned host table dequantized into ``out`` [N, dim] ``dtype`` on the GPU (``device``:
    out's, else ids' if on CUDA, else the current one), through CPU gather + pipelined copies."""
    if device is None:
        device = out.device if out is not None else device_for(ids, None)
    n = ids.numel()
    if out is None:
        out = torch.empty(n, dim, dtype=dtype, device=device)  # [N, dim]
    if n == 0:
        return out
    sources = row_sources(values, scales)
    staged = stage_rows(sources, ids.reshape(-1), device, chunk_rows)
    if len(sources) == 1 and scales is not None:  # packed rows: split them back into values | scales
        vb = values.shape[1]
        vals, scl = staged[0][:, :vb], staged[0][:, vb:vb + scales.shape[1]]
    else:
        vals, scl = staged[0], (staged[1] if scales is not None else None)
    from engram.store import kernels  # the HBM fast path (or the torch reference) over the staged rows
    return kernels.gather_rows(vals, scl, torch.arange(n, device=device), row_dtype, dim, out=out, dtype=dtype)
