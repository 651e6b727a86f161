"""Caching a probed slab's rows late: ``admit_probed`` only takes the rows out of the slab and ``hold``s them; the
table's next probed lookup ``hand_over``s them right after its cache split, and they are cached on this object's thread
while that lookup reads (docs/disk.md, "Caching a step's rows late").

Exact because the caching follows the next split (whose hits carry the current clock, never evicted), bytes are written
before tags, ``RowCache.admit`` rechecks ids cached since the split, and ``settle`` (which makes the engine's stream
wait for the cache stream and caches rows never handed over) precedes any other use of the cache."""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch



@dataclass
class TakenRows:
    """A probed lookup's rows taken out of its slab: ``RowCache.admit``'s arguments, the stream to cache them on and the
    stream that waits for it (None, None on the CPU)."""
    miss_ids: np.ndarray  # [M] host
    values: torch.Tensor  # [M, stride] uint8
    scales: torch.Tensor | None  # [M, scale_cols] uint8
    looked_up: int  # distinct ids the lookup looked up
    stream: "torch.cuda.Stream | None"  # the table's cache stream (the gather ran there)
    consumer: "torch.cuda.Stream | None"  # the engine's stream when the rows were taken out


class LateCaching:
    """One table's rows held for late caching; ``cache(rows)`` caches one ``TakenRows`` (on this object's thread)."""

    def __init__(self, cache: Callable[[TakenRows], None], device: torch.device):
        self._cache, self.device = cache, device
        self._lock = threading.Lock()
        self._held: TakenRows | None = None
        self._running: list[cf.Future] = []  # handed over, not yet settled (in order, on one thread)
        self._thread: cf.ThreadPoolExecutor | None = None
        self.used = False  # rows were ever held: a caching may since run between a lookup's split and its admit

    def hold(self, rows: TakenRows) -> None:
        """Keep ``rows`` for the table's next probed lookup to hand over (after ``settle``)."""
        with self._lock:
            if self._held is not None or self._running:
                raise RuntimeError("rows held for late caching before the ones before them were settled")
            self._held, self.used = rows, True

    def hand_over(self) -> None:
        """Called by the next probed lookup right after its cache split: cache the held rows on the thread meanwhile."""
        with self._lock:
            rows, self._held = self._held, None
            if rows is None:
                return
            if self._thread is None:
                index = None
                if self.device.type == "cuda":  # its CUDA calls go to the table's device
                    index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="engram-late-caching",
                                                     initializer=torch.cuda.set_device if index is not None else None,
                                                     initargs=(index,) if index is not None else ())
            self._running.append(self._thread.submit(self._cache, rows))

    def settle(self) -> None:
        """Before any other use of the cache: finish the handed-over caching (raising its error; rows held since are
        dropped, to be read again), then cache rows held but never handed over, on this thread."""
        with self._lock:
            running, self._running = self._running, []
            rows, self._held = self._held, None
        errors = [f.exception() for f in running]  # waits for each
        if any(errors):
            raise next(e for e in errors if e is not None)
        if rows is not None:
            self._cache(rows)

    def close(self) -> None:
        """Settle, then stop the thread."""
        try:
            self.settle()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None
