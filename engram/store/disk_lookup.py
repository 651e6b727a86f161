"""The handle of a disk-tier lookup submitted to its table's worker thread (``DiskTable.submit``), and the error
of one submitted past ``max_inflight``. The handle holds its table's in-flight slot (and counts its rows'
bytes) until ``wait()`` consumes the rows or ``cancel()`` drops them."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import TYPE_CHECKING

import torch

from engram.store.base import LookupHandle

if TYPE_CHECKING:
    from engram.store.disk import DiskTable


class InflightLimitError(RuntimeError):
    """More lookups submitted than ``max_inflight`` allows without waiting or cancelling."""


class DiskLookup(LookupHandle):
    """A lookup on a DiskTable's worker thread, holding its depth slot and rows until ``wait()`` or ``cancel()``;
    cancelled mid-read it finishes the reads, then frees both (``wait`` raises CancelledError)."""

    def __init__(self, table: "DiskTable", future: cf.Future, nbytes: int):
        self._table = table
        self._future = future
        self._nbytes = nbytes  # bytes of the rows this lookup returns, counted while held
        self._lock = threading.Lock()
        self._released = False
        self._cancelled = False
        self.finished_at: float | None = None  # monotonic time the lookup ended (engine/lookup_timing.py)
        future.add_done_callback(self._on_done)

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._table._release_slot(self._nbytes)

    def _on_done(self, fut: cf.Future) -> None:
        self.finished_at = time.monotonic()
        if self._cancelled:  # nobody will consume these rows: drop them (the future is their only owner)
            self._future = None
            self._release()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows, usable on the caller's stream (on CUDA it waits for their event; they are marked used by it)."""
        fut = self._future
        if self._cancelled or fut is None:
            raise cf.CancelledError("this lookup was cancelled")
        try:
            rows, ready = fut.result(timeout)  # re-raises the lookup's error (e.g. DiskReadError)
        finally:
            if fut.done():
                self._release()
        if ready is not None:
            stream = torch.cuda.current_stream(None if rows is None else rows.device)
            stream.wait_event(ready)
            if rows is not None:  # None: rows read into a caller's slab
                rows.record_stream(stream)  # the allocator must not reuse them while this stream may read them
        return rows

    def done(self) -> bool:
        fut = self._future
        return self._cancelled or fut is None or fut.done()  # a cancelled wait() raises at once

    def cancel(self) -> bool:
        """Drop the lookup; True when it had not started (no read was issued)."""
        with self._lock:
            if self._released and not self._cancelled:
                return False  # already consumed by wait()
            self._cancelled = True
        fut = self._future
        if fut is None:
            return False
        dropped = fut.cancel()
        if dropped or fut.done():
            self._future = None
            self._release()
        # A running lookup releases in _on_done; the future keeps its rows only until then.
        return dropped
