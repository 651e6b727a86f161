"""Background verification of a disk-tier table: read ``values.bin`` once, checking every page's CRC32C. With
``background_verify`` a DiskTable starts a ``Scrubber`` thread reading BLOCK_PAGES blocks through the table's own
PageReader; a corrupt page is counted in ``corrupt_pages`` and warned about (file, offset). ``status()``: verify_state
("running", "done", "stopped", "failed: <error>") and verified_pages."""
from __future__ import annotations

import threading
import warnings
from typing import Callable

import numpy as np

from engram.store.page_checker import PageChecker
from engram.store.page_crc import bad_pages, page_error
from engram.store.reader import PAGE, PageReader, aligned_pages

BLOCK_PAGES = 256  # pages per read: 1 MiB at 4 KiB pages


class Scrubber:
    """Reads every page of ``reader``'s file once on a daemon thread, checking it against ``pages``; ``on_corrupt(n)``
    gets each bad block's count."""

    def __init__(self, reader: PageReader, pages: PageChecker, on_corrupt: Callable[[int], None]) -> None:
        self._reader, self._pages, self._on_corrupt = reader, pages, on_corrupt
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._state, self._done = "running", 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engram-scrub-{reader.path}")
        self._thread.start()

    def _run(self) -> None:
        page, total = self._pages.page_size, len(self._pages.crcs)
        buf = aligned_pages(min(BLOCK_PAGES, total) * page // PAGE)
        try:
            for first in range(0, total, BLOCK_PAGES):
                if self._stop.is_set():
                    self._set("stopped")
                    return
                n = min(BLOCK_PAGES, total - first)
                self._reader.read(np.array([first * page], dtype=np.int64), buf, n * page)  # one contiguous read
                bad, got = bad_pages(buf.numpy(), np.array([first]), n, self._pages.crcs, page)
                if len(bad):
                    self._on_corrupt(len(bad))
                    err = page_error(self._pages.path, int(bad[0]), page, int(self._pages.crcs[bad[0]]), int(got[0]))
                    warnings.warn(f"engram: background verification: {err} ({len(bad)} bad page(s) in this block)",
                                  RuntimeWarning, stacklevel=1)
                with self._lock:
                    self._done += n
            self._set("done")
        except Exception as e:  # noqa: BLE001 - reported through status(), the table keeps serving
            self._set(f"failed: {e}")

    def _set(self, state: str) -> None:
        with self._lock:
            self._state = state

    def status(self) -> dict[str, object]:
        with self._lock:
            return {"verify_state": self._state, "verified_pages": self._done}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the scan to end; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the block being read and wait for the thread."""
        self._stop.set()
        self._thread.join()
