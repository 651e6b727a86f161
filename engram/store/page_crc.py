"""Per-page checksums of ``values.bin``: the ``values.crc32c`` sidecar (format 2), one little-endian uint32 CRC32C per
page (its own chunk CRC32s checked on load). ``PageCrcStream`` computes it as a writer streams values.bin;
``PageChecker`` (page_checker.py) checks the pages a read returned before any row is cut out, raising
``CorruptPageError`` (file and page offset); ``bad_pages`` finds every mismatch of a buffer."""
from __future__ import annotations

import numpy as np

from engram.store.crc32c import crc32c_pages
from engram.store.format import MANIFEST, TableFormatError, TableManifest


class CorruptPageError(TableFormatError):
    """A page of values.bin read back with a CRC32C other than the one stored for it."""


def missing_page_crcs_error(m: TableManifest) -> TableFormatError:
    """The error of a format-1 table where page checksums are needed, with the command that adds them."""
    mpath = m.path / MANIFEST
    text = mpath.read_text(encoding="utf-8")
    pos = text.find('"format_version"')
    return TableFormatError(mpath, len(text[:max(pos, 0)].encode()),
                            f"format_version {m.format_version} has no per-page checksums, which the disk tier "
                            f"checks on every read; add them in place with: engram convert --add-checksums {m.path}")


class PageCrcStream:
    """CRC32C of each ``page_size`` page of a byte stream fed in pieces of any size (writers)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._parts: list[np.ndarray] = []  # uint32 CRCs of the full pages so far
        self._carry = bytearray()  # the start of a page not yet complete

    def update(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        if self._carry:
            take = min(self.page_size - len(self._carry), len(mv))
            self._carry += mv[:take]
            mv = mv[take:]
            if len(self._carry) < self.page_size:
                return
            self._parts.append(crc32c_pages(self._carry, self.page_size))
            self._carry = bytearray()
        whole = len(mv) // self.page_size * self.page_size
        if whole:
            self._parts.append(crc32c_pages(mv[:whole], self.page_size))
        self._carry += mv[whole:]

    def finish(self) -> np.ndarray:
        """uint32 [pages]; ValueError when the stream did not end on a page boundary."""
        if self._carry:
            raise ValueError(f"the stream ends {len(self._carry)} bytes into a {self.page_size}-byte page")
        return np.concatenate(self._parts) if self._parts else np.empty(0, dtype=np.uint32)


def page_error(path, page: int, page_size: int, stored: int, got: int | None = None) -> CorruptPageError:
    """The error of page ``page`` of values.bin (``path``) read back with CRC32C ``got`` instead of ``stored``."""
    read = "" if got is None else f", read {got:#010x}"
    return CorruptPageError(path, page * page_size,
                            f"page {page} fails its checksum (CRC32C stored {stored:#010x}{read}): values.bin is "
                            f"corrupt there; `engram inspect --verify {path.parent}` checks the whole table")


def sidecar_bytes(crcs: np.ndarray) -> bytes:
    """The sidecar file's contents for page CRCs ``crcs``."""
    return np.ascontiguousarray(crcs, dtype="<u4").tobytes()


def bad_pages(buf: np.ndarray | None, first_pages: np.ndarray, pages_per_block: int, expected: np.ndarray,
              page_size: int, got: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(page numbers [k], CRC32Cs as read [k]) of the pages of ``buf`` (blocks of ``pages_per_block`` pages from
    ``first_pages[i]``) not matching ``expected``; ``got``: the reader's CRC32Cs (``buf`` then unread)."""
    n = len(first_pages) * pages_per_block
    if got is None:
        got = crc32c_pages(buf.reshape(-1)[: n * page_size], page_size)  # [n]
    got = got[:n]
    pages = (np.asarray(first_pages, dtype=np.int64)[:, None] + np.arange(pages_per_block)).reshape(-1)  # [n]
    bad = got != expected[pages]
    return pages[bad], got[bad]
