"""``add_checksums`` (``engram convert --add-checksums DIR``): give a format-1 table its page CRC32C sidecar, in place.
One pass checks every chunk against the manifest's CRC32 and computes the page CRC32Cs; only if all match is the sidecar
written (fsynced, renamed) and then manifest.json replaced (format 2). A crash in between leaves the old manifest, which
ignores the stray sidecar; running again finishes. Tables that have page checksums are left alone."""
from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

import numpy as np

from engram.store.crc32c import crc32c_pages
from engram.store.format import (FORMAT_VERSION, MANIFEST, PAGE_CRC_FILE, TableManifest, check_file_size,
                                 checksum_error, iter_chunks, read_manifest)
from engram.store.writer import owner_tag, fsync_dir, remove_stale_partials, write_synced, write_sidecar


def add_checksums(directory: str | os.PathLike, progress: bool = False) -> tuple[TableManifest, bool]:
    """(the manifest, whether it changed); TableFormatError (file, offset) when a chunk mismatches, nothing written."""
    m = read_manifest(directory)
    if m.has_page_crcs:
        return m, False
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(f.bytes for f in m.files.values()), unit="B", unit_scale=True, desc=m.path.name)
    pages: list[np.ndarray] = []
    try:
        for kind, entry in m.files.items():
            path = m.path / entry.name
            check_file_size(path, entry.bytes)
            for i, (off, data) in enumerate(iter_chunks(path, m.chunk_bytes, entry.bytes)):
                if zlib.crc32(data) != entry.crc32[i]:
                    raise checksum_error(path, i, off, len(data))
                if kind == "values":
                    pages.append(crc32c_pages(data, m.page_size))
                if bar is not None:
                    bar.update(len(data))
    finally:
        if bar is not None:
            bar.close()
    root = Path(m.path)
    remove_stale_partials(root)  # files an upgrade killed before it finished left behind
    tmp = root / f".{PAGE_CRC_FILE}.partial-{owner_tag()}"
    entry = write_sidecar(tmp, np.concatenate(pages), m.chunk_bytes)
    os.replace(tmp, root / PAGE_CRC_FILE)
    new = dataclasses.replace(m, files={**m.files, "page_crc": entry}, format_version=FORMAT_VERSION)
    mtmp = root / f".{MANIFEST}.partial-{owner_tag()}"
    write_synced(mtmp, new.to_json().encode(), True)
    os.replace(mtmp, root / MANIFEST)
    fsync_dir(root)
    return read_manifest(root), True
