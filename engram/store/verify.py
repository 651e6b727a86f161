"""``verify_table``: a table directory checked completely (manifest, file sizes, every chunk's CRC32 and every
page of values.bin against its CRC32C), above the format and the loaders it reads with."""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engram.store.format import (TableFormatError, TableManifest, check_file_size, checksum_error, iter_chunks,
                                 read_manifest)
from engram.store.load import load_file
from engram.store.page_crc import bad_pages, page_error


@dataclass
class VerifyReport:
    """Result of ``verify_table``: per-file sizes and checksum results; ``ok`` when nothing is wrong."""

    path: str  # table directory
    files: list[dict[str, Any]]  # {"file", "bytes", "chunks", "bad_chunks"} per data file (+ "bad_pages": values)
    errors: list[TableFormatError]  # every defect found, in file order
    bytes_checked: int = 0  # bytes read and checksummed
    seconds: float = 0.0  # wall time of the check

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "files": self.files, "errors": [str(e) for e in self.errors],
                "bytes_checked": self.bytes_checked, "seconds": round(self.seconds, 3)}


def _stored_page_crcs(m: TableManifest) -> Any:
    """The sidecar's page CRCs (uint32 [pages]) when its chunk CRCs hold, else None (reported by verify_table)."""
    if not m.has_page_crcs:
        return None
    try:
        return load_file(m, "page_crc", "ram", verify=True).numpy().view("<u4").astype(np.uint32)
    except TableFormatError:
        return None


def verify_table(directory: str | os.PathLike, progress: bool = False) -> VerifyReport:
    """Check a table directory completely (manifest, sizes, chunk CRC32s, page CRC32Cs) -> a report; never raises on a
    bad table (``report.raise_first()`` does)."""
    t0 = time.perf_counter()
    report = VerifyReport(path=str(directory), files=[], errors=[])
    try:
        m = read_manifest(directory, check_sizes=False)
    except TableFormatError as e:
        report.errors.append(e)
        report.seconds = time.perf_counter() - t0
        return report
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(f.bytes for f in m.files.values()), unit="B", unit_scale=True, desc="verify")
    stored = _stored_page_crcs(m)
    for kind, entry in m.files.items():
        path = m.path / entry.name
        info = {"file": str(path), "bytes": entry.bytes, "chunks": len(entry.crc32), "bad_chunks": []}
        pages = kind == "values" and stored is not None
        if pages:
            info["bad_pages"] = []
        report.files.append(info)
        try:
            check_file_size(path, entry.bytes)
        except TableFormatError as e:
            report.errors.append(e)
            continue
        for i, (off, data) in enumerate(iter_chunks(path, m.chunk_bytes, entry.bytes)):
            if zlib.crc32(data) != entry.crc32[i]:
                info["bad_chunks"].append(i)
                report.errors.append(checksum_error(path, i, off, len(data)))
            if pages:
                _check_pages(data, off, m.page_size, stored, path, info, report)
            report.bytes_checked += len(data)
            if bar is not None:
                bar.update(len(data))
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def _check_pages(data: bytes, offset: int, page: int, stored: Any, path: Path, info: dict[str, Any],
                 report: VerifyReport) -> None:
    """Add every page of ``data`` (values.bin from byte ``offset``) whose CRC32C differs to the report."""
    bad, got = bad_pages(np.frombuffer(data, dtype=np.uint8), np.array([offset // page]), len(data) // page, stored,
                         page)
    for p, g in zip(bad.tolist(), got.tolist()):
        info["bad_pages"].append(p)
        report.errors.append(page_error(path, p, page, int(stored[p]), g))
