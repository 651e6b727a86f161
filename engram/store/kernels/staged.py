"""Rows of a pinned host table gathered by CPU threads into pinned staging and copied to the GPU chunk by chunk on a
side stream, then dequantized by the HBM kernel: the host tier's route where UVA's per-row address translation costs
more (uva.py). Waits for the CPU gather, never for the GPU; the caller's stream is ordered after the copies."""
from __future__ import annotations

import threading

import torch

CHUNK_ROWS = 16384  # rows per pipelined copy (StoreOptions.staged_chunk_rows sets a table's)


def row_sources(values: torch.Tensor, scales: torch.Tensor | None) -> list[torch.Tensor]:
    """The 2-D tensors a row gather copies from: for the packed layout the buffer's whole rows (contiguous where it
    holds every row's padding: one memcpy a row); otherwise values [and scales]."""
    if (scales is not None and scales.stride(0) == values.stride(0) and scales.stride(1) == 1
            and values.stride(1) == 1 and scales.shape[0] == values.shape[0]
            and scales.data_ptr() == values.data_ptr() + values.shape[1]):
        rows, stride = values.shape[0], values.stride(0)
        storage_end = values.untyped_storage().nbytes() - values.storage_offset() * values.element_size()
        width = stride if rows * stride <= storage_end else values.shape[1] + scales.shape[1]
        return [values.as_strided((rows, width), (stride, 1))]
    return [values] if scales is None else [values, scales]


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # per device: the side stream of the staged copies
_STREAMS_LOCK = threading.Lock()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    with _STREAMS_LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device)
        return _STREAMS[device]


def device_for(ids: torch.Tensor, out: torch.Tensor | None) -> torch.device:
    """Where gathered rows go: ids' CUDA device, else out's, else the current CUDA device."""
    if ids.is_cuda:
        return ids.device
    if out is not None and out.is_cuda:
        return out.device
    return torch.device("cuda", torch.cuda.current_device())


def stage_rows(sources: list[torch.Tensor], ids: torch.Tensor, device: torch.device,
               chunk_rows: int = CHUNK_ROWS) -> list[torch.Tensor]:
    """Rows ``ids`` of each source (CPU [R, w_j]) as uint8 [N, w_j] on ``device``, the current stream ordered after
    their copies. No host sync for CPU ids (GPU ids are copied back first)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1")
    idx = ids.to("cpu", torch.int64)  # [N]
    n = idx.numel()
    widths = [s.shape[1] for s in sources]
    dev = [torch.empty(n, w, dtype=torch.uint8, device=device) for w in widths]  # [N, w_j] each
    flat = torch.empty(n * sum(widths), dtype=torch.uint8, pin_memory=True)  # this call's staging
    host, off = [], 0
    for w in widths:
        host.append(flat[off:off + n * w].view(n, w))  # [N, w_j] pinned, contiguous
        off += n * w
    stream = _copy_stream(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)  # `dev` was allocated on the current stream
    for c0 in range(0, n, chunk_rows):
        c1 = min(n, c0 + chunk_rows)
        for src, h in zip(sources, host):
            torch.index_select(src, 0, idx[c0:c1], out=h[c0:c1])
        with torch.cuda.stream(stream):
            for h, d in zip(host, dev):
                d[c0:c1].copy_(h[c0:c1], non_blocking=True)  # recorded: `flat` is reused only after it ran
    current.wait_stream(stream)  # `dev` is freed on the current stream: after the copies into it
    return dev


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                device: torch.device | None = None, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """Rows ``ids`` of a pinned host table dequantized into ``out`` [N, dim] on the GPU (out's device, else ids' if
    CUDA, else the current one) through CPU gather + pipelined copies."""
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
    # The HBM kernel over the staged rows: this route runs only where the UVA fast path does (CUDA, triton).
    from engram.store.kernels import triton_gather  # needs triton, which has no CPU backend
    return triton_gather.gather_rows(vals, scl, torch.arange(n, device=device), row_dtype, dim, out=out, dtype=dtype)
