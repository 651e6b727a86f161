"""Reusable read buffers of the disk tier's one-read lookups (``DiskTable``'s direct path). A ``PageSlab`` holds one
lookup's plan (slab_plan.py), its pages (page-aligned for O_DIRECT), their CRC32Cs, each asked id's buffer row
(``slots``) and, for MXFP8, each read row's scales at that row, so one gather over the slab decodes the lookup. On CUDA
slabs are pinned and read over UVA: ``release`` records an event on the reading stream and ``acquire`` only hands out
slabs whose event passed (allocating rather than waiting). Slabs grow to the largest lookup (powers of two of pages); at
most ``keep`` idle ones are kept, the extra dropped once its event passed."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from engram.store.reader import PAGE, aligned_pages


@dataclass(eq=False)
class SlotProbe:
    """What a decode piece needs to find a cached disk table's rows on the device (kernels/cache_probe.py): the resolved
    slots (int64 [3, rows] on the cache's device: cache slot, slab row, run), the host plan of the same shape (pinned)
    and the flag (int64 [1], pinned: ``2 * plan`` planned, ``2 * plan + 1`` failed; -1 before any)."""

    resolved: torch.Tensor
    plan: torch.Tensor
    flag: torch.Tensor
    pending: tuple | None = None  # the last lookup's rows read, until DiskTable.admit_probed caches them


@dataclass(eq=False)  # a slab is itself: compared by identity
class PageSlab:
    """Buffers for up to ``pages`` pages of ``page_size`` bytes and ``rows`` asked-for ids."""

    pages: int
    rows: int
    data: torch.Tensor  # uint8 [pages * page_size // PAGE, PAGE], page-aligned
    crcs: np.ndarray  # uint32 [pages]: each read page's CRC32C, written by the reader
    slots: torch.Tensor  # int64 [rows]: buffer row (of ``data`` viewed as [-1, stride]) of each id
    scales: torch.Tensor | None  # uint8 [pages * rows_per_page, scale_cols], by buffer row (mxfp8)
    pinned: bool
    offsets: np.ndarray  # int64 [pages]: the plan (slab_plan.py): byte offset of each page read
    uniq: np.ndarray  # int64 [rows]: the distinct ids, ascending
    uslots: np.ndarray  # int64 [rows]: the buffer row of each distinct id
    done: "torch.cuda.Event | None" = None  # recorded after the last device work reading this slab
    probe: "SlotProbe | None" = None  # a decode graph's slab over a hot-row cache: its slots found on the device

    def ready(self) -> bool:
        """No device work still reads this slab."""
        return self.done is None or self.done.query()


class SlabPool:
    """Slabs of one table: ``acquire(pages, rows)``, ``release(slab, stream)`` once its decode is queued; threadsafe."""

    def __init__(self, page_size: int, stride: int, scale_cols: int, pinned: bool, keep: int = 2):
        if page_size % PAGE:
            raise ValueError(f"page_size={page_size} is not a multiple of {PAGE}")
        self.page_size, self.stride, self.scale_cols = page_size, stride, scale_cols
        self.rows_per_page = page_size // stride
        self.pinned = pinned
        self.keep = keep
        self._idle: list[PageSlab] = []
        self._retired: list[PageSlab] = []  # dropped slabs whose device work has not run yet
        self._lock = threading.Lock()

    def new(self, pages: int, rows: int) -> PageSlab:
        """A slab of at least ``pages`` pages and ``rows`` ids, outside the pool (``acquire`` hands them out)."""
        pages = 1 << max(4, (pages - 1).bit_length())  # >= 16 pages, a power of two
        rows = 1 << max(6, (rows - 1).bit_length())
        data = aligned_pages(pages * (self.page_size // PAGE), pin=self.pinned)
        slots = torch.empty(rows, dtype=torch.int64, pin_memory=self.pinned)
        scales = (torch.empty(pages * self.rows_per_page, self.scale_cols, dtype=torch.uint8, pin_memory=self.pinned)
                  if self.scale_cols else None)
        return PageSlab(pages, rows, data, np.empty(pages, dtype=np.uint32), slots, scales, self.pinned,
                        np.empty(pages, dtype=np.int64), np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64))

    def acquire(self, pages: int, rows: int) -> PageSlab:
        with self._lock:
            self._retired = [s for s in self._retired if not s.ready()]
            for i, slab in enumerate(self._idle):
                if slab.ready() and slab.pages >= pages and slab.rows >= rows:
                    return self._idle.pop(i)
        return self.new(pages, rows)

    def release(self, slab: PageSlab, stream: "torch.cuda.Stream | None" = None) -> None:
        """Give ``slab`` back; on CUDA after recording its event on ``stream`` (the decode's)."""
        if slab.pinned and stream is not None:
            slab.done = torch.cuda.Event()
            slab.done.record(stream)
        with self._lock:
            self._idle.append(slab)
            if len(self._idle) > self.keep:  # drop the smallest; it is freed once nothing reads it
                self._idle.sort(key=lambda s: (s.pages, s.rows), reverse=True)
                self._retired.append(self._idle.pop())

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle slabs (tests, stats)."""
        with self._lock:
            return sum(s.data.numel() + s.slots.numel() * 8 + (s.scales.numel() if s.scales is not None else 0)
                       for s in self._idle)
