"""Tables built in memory: what ``load_table`` returns, for rows made chunk by chunk (``RowChunks``) instead of read
from files, through load.py's destinations, so a built table equals a written-then-loaded one byte for byte."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engram.store.format import TableManifest
from engram.store.load import (DEVICE_WINDOW, LAYOUTS, LOAD_THREADS, HostTarget, _bar, _check_threads,
                               _host_buffer, _through_windows, is_host_target, packed_row_bytes)
from engram.store.shared_host import made_with


@dataclass(frozen=True)
class RowChunks:
    """A table's rows made chunk by chunk: ``make(k)`` -> rows [k * rows, (k + 1) * rows) (clipped) as CPU (values
    uint8, scales | None); called from several threads, any order, each result read before that thread's next call."""

    rows: int  # rows per chunk
    make: Callable[[int], "tuple[torch.Tensor, torch.Tensor | None]"]


def build_table(m: TableManifest, chunks: RowChunks, target: HostTarget | torch.device = "ram", layout: str = "split",
                progress: bool = False, threads: int = LOAD_THREADS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``load_table(m, target, layout=layout)``'s result with the bytes made by ``chunks`` (no file read or written;
    padding zero, as in the files): host targets filled in one pass then pinned once, a device through two pinned
    windows. A failed chunk raises (the first in chunk order) and keeps nothing."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    _check_threads(threads)
    if chunks.rows < 1:
        raise ValueError(f"chunks.rows={chunks.rows} must be >= 1")
    packed = layout == "packed" and m.scale_cols > 0
    if packed and not is_host_target(target):
        raise ValueError(f"target={target!r}: the packed layout is built in host memory ('ram' or 'pinned')")
    bar = _bar(progress, m.rows * (m.value_bytes + m.scale_cols), f"build {m.path.name}", tty_only=True)
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-build") as pool:
            def fill(views: tuple, r0: int, r1: int) -> None:
                _fill_rows(pool, chunks, m, views, r0, r1, bar)

            if is_host_target(target):
                return _build_host(m, target, packed, fill)
            return _build_device(m, torch.device(target), chunks.rows, fill)
    finally:
        if bar is not None:
            bar.close()


def _fill_rows(pool: ThreadPoolExecutor, chunks: RowChunks, m: TableManifest, views: tuple, r0: int, r1: int,
               bar) -> None:
    """Table rows [r0, r1) into ``views`` (values, scales | None, padding | None; row 0 is table row r0)."""
    vals, scales, pad = (v.numpy() if v is not None else None for v in views)
    stop = threading.Event()

    def job(k: int) -> None:
        if stop.is_set():
            return
        try:
            a, b = k * chunks.rows, min(r1, (k + 1) * chunks.rows)
            v, s = chunks.make(k)
            want = ((b - a, m.value_bytes), (b - a, m.scale_cols) if m.scale_cols else None)
            got = (tuple(v.shape), tuple(s.shape) if s is not None else None)
            if got != want or v.dtype != torch.uint8 or (s is not None and s.dtype != torch.uint8):
                raise ValueError(f"{m.path}: chunk {k} made uint8 shapes {got}, expected {want}")
            np.copyto(vals[a - r0:b - r0], v.numpy())
            if scales is not None:
                np.copyto(scales[a - r0:b - r0], s.numpy())
            if pad is not None and pad.shape[1]:
                pad[a - r0:b - r0] = 0
            if bar is not None:
                bar.update((b - a) * (m.value_bytes + m.scale_cols))
        except BaseException:
            stop.set()
            raise

    futures = [pool.submit(job, k) for k in range(r0 // chunks.rows, -(-r1 // chunks.rows))]
    for fut in futures:
        fut.exception()  # every job has finished (or skipped) before the first error surfaces
    for fut in futures:
        fut.result()


def _build_host(m: TableManifest, target: HostTarget, packed: bool, fill: Callable[[tuple, int, int], None]):
    """``build_table`` into host memory: (values, scales) in the packed or split layout."""
    rows, vb, sc = m.rows, m.value_bytes, m.scale_cols
    if packed:
        stride = packed_row_bytes(vb, sc)

        def fill_packed_rows(dst: torch.Tensor) -> None:
            p = dst.view(rows, stride)
            fill((p[:, :vb], p[:, vb:vb + sc], p[:, vb + sc:]), 0, rows)

        buf = _host_buffer(rows * stride, target, fill_packed_rows, "packed").view(rows, stride)  # [rows, S]
        return buf[:, :vb], buf[:, vb:vb + sc]
    stride = m.row_stride
    scales: list[torch.Tensor] = []

    def fill_split(dst: torch.Tensor) -> None:
        v = dst.view(rows, stride)  # [rows, row_stride]
        if not sc:
            fill((v[:, :vb], None, v[:, vb:]), 0, rows)
            return
        # the scales are a second buffer, filled (and pinned) inside the values' fill: one pass over the chunks
        scales.append(_host_buffer(rows * sc, target, lambda s: fill((v[:, :vb], s.view(rows, sc), v[:, vb:]),
                                                                     0, rows), "scales"))

    values = _host_buffer(rows * stride, target, fill_split, "values").view(rows, stride)
    if sc and not scales:  # a shared values segment that existed: its scales were made inside its fill, before it
        scales.append(_host_buffer(rows * sc, target, made_with(target, "scales", "values"), "scales"))
    return values, (scales[0].view(rows, sc) if sc else None)


def _build_device(m: TableManifest, dev: torch.device, chunk_rows: int, fill: Callable[[tuple, int, int], None]):
    """``build_table`` into device memory (split layout) through ``_through_windows``."""
    rows, stride, vb, sc = m.rows, m.row_stride, m.value_bytes, m.scale_cols
    outs = [torch.empty(rows, stride, dtype=torch.uint8, device=dev)]  # values [rows, row_stride]
    if sc:
        outs.append(torch.empty(rows, sc, dtype=torch.uint8, device=dev))  # scales [rows, scale_cols]
    span = max(1, DEVICE_WINDOW // (chunk_rows * (stride + sc))) * chunk_rows  # rows: whole chunks per window
    _through_windows(outs, span, lambda hosts, w0, w1: fill((hosts[0][:, :vb], hosts[1] if sc else None,
                                                            hosts[0][:, vb:]), w0, w1))
    return outs[0], (outs[1] if sc else None)
