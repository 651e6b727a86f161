"""Row shards: rows [lo, hi) of a table as a table of their own, so a tensor-parallel rank holds and reads only its
share on every tier (the ordinary gpu / host / disk tiers open a shard like any table). ``write_row_shard`` copies the
rows once from the source table's files into ``shard_dir(source, lo, hi)`` (each page read checked against its CRC32C,
the shard written with its own checksums); ``row_range_chunks`` cuts a table built in memory the same way. Shard row
``i`` is source row ``lo + i``, byte for byte::

    source   | row 0 | ... | row lo | ... | row hi-1 | ... | row R-1 |
    shard                  | row 0  | ... | row hi-lo-1 |      (layout, stride, scales as the source's)"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from engram.store.build import RowChunks
from engram.store.disk import DiskTable
from engram.store.format import MANIFEST, TableManifest, read_manifest
from engram.store.options import StoreOptions
from engram.store.writer import TableWriter

COPY_ROWS = 1 << 16  # rows read and appended per step of ``write_row_shard``


def shard_dir(source: str | os.PathLike, lo: int, hi: int) -> Path:
    """Where the shard of rows [lo, hi) of the table at ``source`` lives: beside it, ``NAME.rows<lo>-<hi>``."""
    source = Path(source)
    return source.parent / f"{source.name}.rows{lo}-{hi}"


def _check_range(rows: int, lo: int, hi: int, where: Any) -> None:
    if not 0 <= lo < hi <= rows:
        raise ValueError(f"{where}: row shard [{lo}, {hi}) is not a non-empty range inside the table's {rows} rows")


def write_row_shard(source: str | os.PathLike, lo: int, hi: int, fingerprint: dict[str, Any] | None = None,
                    progress: bool = False) -> Path:
    """Rows [lo, hi) of the table at ``source`` written (once) as a table at ``shard_dir(source, lo, hi)`` with
    ``fingerprint``; an existing complete shard of that fingerprint is kept. Returns the shard's directory."""
    m = read_manifest(source)
    _check_range(m.rows, lo, hi, m.path)
    target = shard_dir(source, lo, hi)
    if (target / MANIFEST).is_file() and read_manifest(target).fingerprint == fingerprint:
        return target
    # the disk tier reads pages and checks each against its CRC32C: nothing unverified reaches the shard
    table = DiskTable(m, device="cpu", options=StoreOptions(io="buffered"))
    meta = {**m.meta, "row_shard": {"source": str(m.path), "lo": lo, "hi": hi}}
    try:
        with TableWriter(target, hi - lo, m.dim, m.row_dtype, layer_id=m.layer_id, fingerprint=fingerprint,
                         meta=meta, progress=progress, desc=f"{m.path.name} rows {lo}..{hi}") as w:
            for a in range(lo, hi, COPY_ROWS):
                raw = table.gather_raw(torch.arange(a, min(hi, a + COPY_ROWS)))  # [n, value_bytes + scale_cols]
                w.append(raw[:, : m.value_bytes], raw[:, m.value_bytes:] if m.scale_cols else None)
    finally:
        table.close()
    return target


def shard_manifest(m: TableManifest, lo: int, hi: int, fingerprint: dict[str, Any] | None = None) -> TableManifest:
    """The manifest of rows [lo, hi) of ``m`` built in memory (no files; ``row_range_chunks`` makes its rows)."""
    _check_range(m.rows, lo, hi, m.path)
    return dataclasses.replace(m, path=shard_dir(m.path, lo, hi), rows=hi - lo, files={}, fingerprint=fingerprint,
                               meta={**m.meta, "row_shard": {"source": str(m.path), "lo": lo, "hi": hi}})


def row_range_chunks(chunks: RowChunks, lo: int, hi: int) -> RowChunks:
    """``chunks`` of a whole table -> the chunks of its rows [lo, hi) (shard chunk k is rows lo + k*step ...): each
    spans at most two source chunks, the first copied before the second is made (a maker may reuse its buffer)."""
    step = chunks.rows

    def make(k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, b = lo + k * step, min(hi, lo + (k + 1) * step)  # source rows of shard chunk k
        parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for j in range(a // step, (b - 1) // step + 1):
            v, s = chunks.make(j)  # source rows [j * step, ...)
            r0, r1 = max(a, j * step) - j * step, min(b, (j + 1) * step) - j * step
            parts.append((v[r0:r1].clone(), None if s is None else s[r0:r1].clone()))
        values = torch.cat([v for v, _ in parts])
        scales = None if parts[0][1] is None else torch.cat([s for _, s in parts])
        return values, scales

    return RowChunks(step, make)
