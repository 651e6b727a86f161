"""Read a table's files into memory (RAM, pinned RAM or device memory), checking CRCs on the way.

``load_file(manifest, kind, target)`` streams one data file in checksum-sized chunks: every chunk is
CRC-checked (TableFormatError naming the file and the chunk's byte offset on a mismatch) and copied to
its place, so no second full copy of the table is ever held. Targets: "ram" (plain host memory), "pinned"
(page-locked through engram.store.pinning when CUDA exists, else RAM), or a CUDA device.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from engram.store.format import TableFormatError, TableManifest, check_file_size, checksum_error
from engram.store.pinning import pin_tensor


def _bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc)


def load_file(m: TableManifest, kind: str, target: str | torch.device = "ram", verify: bool = True,
              progress: bool = False) -> torch.Tensor:
    """Whole data file ``kind`` ("values" | "scales") as uint8 [file bytes] on ``target``."""
    entry = m.files[kind]
    path = m.path / entry.name
    check_file_size(path, entry.bytes)
    dev = torch.device(target) if target not in ("ram", "pinned") else torch.device("cpu")
    bar = _bar(progress, entry.bytes, f"load {m.path.name}/{entry.name}")
    if target == "pinned" and torch.cuda.is_available():
        # Source is the page cache (a copy-on-write map), so the pinned copy is the only resident one.
        src = np.memmap(path, dtype=np.uint8, mode="c", shape=(entry.bytes,))
        if verify:
            _verify_chunks(path, src, m.chunk_bytes, entry.crc32, bar)
        out = pin_tensor(torch.from_numpy(src))
        del src
        if bar is not None:
            bar.close()
        return out
    out = torch.empty(entry.bytes, dtype=torch.uint8, device=dev)
    host = out if dev.type == "cpu" else torch.empty(min(m.chunk_bytes, entry.bytes), dtype=torch.uint8,
                                                     pin_memory=True)
    with open(path, "rb", buffering=0) as f:
        for i, off in enumerate(range(0, entry.bytes, m.chunk_bytes)):
            n = min(m.chunk_bytes, entry.bytes - off)
            buf = host[off:off + n] if dev.type == "cpu" else host[:n]
            mv = memoryview(buf.numpy()).cast("B")
            got = 0
            while got < n:
                r = f.readinto(mv[got:])
                if not r:
                    raise TableFormatError(path, off + got, f"truncated while loading (expected {entry.bytes} bytes)")
                got += r
            if verify and zlib.crc32(mv) != entry.crc32[i]:
                raise checksum_error(path, i, off, n)
            if dev.type != "cpu":
                out[off:off + n].copy_(buf)  # synchronous: the bounce buffer is reused next chunk
            if bar is not None:
                bar.update(n)
    if bar is not None:
        bar.close()
    return out


def _verify_chunks(path, data: np.ndarray, chunk_bytes: int, crcs: list[int], bar) -> None:
    """CRC-check every chunk of ``data`` (the file's bytes, uint8 [size]) against the manifest's ``crcs``."""
    for i, off in enumerate(range(0, data.size, chunk_bytes)):
        n = min(chunk_bytes, data.size - off)
        if zlib.crc32(data[off:off + n]) != crcs[i]:
            raise checksum_error(path, i, off, n)
        if bar is not None:
            bar.update(n)


def load_table(m: TableManifest, target: str | torch.device = "ram", verify: bool = True,
               progress: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values uint8 [rows, row_stride], scales uint8 [rows, scale_cols] | None) on ``target``."""
    values = load_file(m, "values", target, verify, progress)[: m.rows * m.row_stride].view(m.rows, m.row_stride)
    scales = None
    if "scales" in m.files:
        scales = load_file(m, "scales", target, verify, progress).view(m.rows, m.scale_cols)
    return values, scales
