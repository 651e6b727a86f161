"""Read a table's files into memory (RAM, pinned RAM or device memory), checking CRCs on the way. ``load_file`` loads
one data file, ``load_table`` a whole table in the "split" layout (the files' own) or, for MXFP8 tables in host memory,
"packed" (``load_packed``). Host targets are filled in one parallel pass: workers pread checksum chunks straight into
the destination and CRC them, so no second copy of the table is held; a device target goes through two alternating
pinned windows. A bad chunk raises TableFormatError naming the file and byte offset (for values.bin, its first page
failing the CRC32C), and nothing loaded so far is kept."""
from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from engram.store.crc32c import crc32c_pages
from engram.store.format import TableFormatError, TableManifest, check_file_size, checksum_error
from engram.store.page_crc import CorruptPageError, page_error
from engram.store.pinning import pinned_empty_filled
from engram.store.shared_host import SharedTarget, shared_buffer

LOAD_THREADS = 8
LAYOUTS = ("split", "packed")
PACKED_ALIGN = 16  # packed rows start on 16 B: 16-byte vector loads, and an 8-aligned scale view for V4.1
_PIECE = 4 << 20  # a chunk is read, CRC'd and placed in pieces that stay in cache between the three steps


def packed_row_bytes(value_bytes: int, scale_cols: int) -> int:
    """Bytes per row of the packed layout: values + scale bytes rounded up to 16 (V4.1: 256 + 8 -> 272)."""
    return -(-(value_bytes + scale_cols) // PACKED_ALIGN) * PACKED_ALIGN


def _bar(progress: bool, total: int, desc: str, tty_only: bool = False):
    """A byte progress bar when ``progress`` (with ``tty_only``: shown only when stderr is a terminal)."""
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None if tty_only else False)


def _pread_into(fd: int, buf: torch.Tensor, off: int, path, size: int) -> None:
    """Fill ``buf`` (uint8 [n], contiguous CPU) with the file's bytes [off, off + n); os.preadv drops the GIL."""
    mv = memoryview(buf.numpy()).cast("B")
    got = 0
    while got < len(mv):
        r = os.preadv(fd, [mv[got:]], off + got)
        if not r:
            raise TableFormatError(path, off + got, f"truncated while loading: the file is {os.fstat(fd).st_size} "
                                                    f"bytes now, the manifest says {size}")
        got += r


def _scatter_rows(dst: np.ndarray, piece: np.ndarray, start: int, fstride: int) -> None:
    """Place ``piece`` (file bytes [start, start + len)) into ``dst`` [rows, width], row r at r * fstride in the file
    (numpy copies release the GIL; torch's would start an OpenMP team inside every worker)."""
    rows, width = dst.shape
    end = start + piece.size
    first, last = start // fstride, min(rows - 1, (end - 1) // fstride)
    full_lo = -(-start // fstride)  # first row whose bytes start inside the piece
    full_hi = min(rows, (end - width) // fstride + 1) if end >= width else 0  # rows whose used bytes end by `end`
    if full_lo < full_hi:
        n = full_hi - full_lo
        src = np.lib.stride_tricks.as_strided(piece[full_lo * fstride - start:], (n, width), (fstride, 1))
        dst[full_lo:full_hi] = src  # [n, width] from rows fstride bytes apart
    for r in {first, last}:
        if r > last or full_lo <= r < full_hi:
            continue
        lo, hi = max(start, r * fstride), min(end, r * fstride + width)
        if lo < hi:
            dst[r, lo - r * fstride:hi - r * fstride] = piece[lo - start:hi - start]


class _FileFill:
    """One data file's chunks and their destination: a flat image (``flat``, from ``base``) or rows ``rows_dst``
    (``fstride`` apart, ``pad`` columns zeroed); ``only``: the chunk indices to run."""

    def __init__(self, m: TableManifest, kind: str, flat: torch.Tensor | None = None,
                 rows_dst: torch.Tensor | None = None, fstride: int = 0, pad: torch.Tensor | None = None,
                 base: int = 0, only: range | None = None) -> None:
        self.entry = m.files[kind]
        self.path = m.path / self.entry.name
        # values.bin's page CRCs (the sidecar) name the bad page when a chunk fails: (sidecar path, page size)
        crcs = m.files.get("page_crc") if kind == "values" else None
        self.pages = (m.path / crcs.name, m.page_size) if crcs is not None else None
        self.chunk_bytes = m.chunk_bytes
        self.flat, self.fstride, self.base, self.only = flat, fstride, base, only
        self.pad = pad.numpy() if pad is not None else None  # [rows, k] view
        self.rows_dst = rows_dst.numpy() if rows_dst is not None else None  # [rows, width] view, numpy copies

    def chunks(self) -> list[tuple[int, int, int]]:
        """(index, offset, bytes) of every checksum chunk to run."""
        size, cb = self.entry.bytes, self.chunk_bytes
        idx = self.only if self.only is not None else range(-(-size // cb))
        return [(i, i * cb, min(cb, size - i * cb)) for i in idx]

    def run_chunk(self, fd: int, i: int, off: int, n: int, verify: bool, bounce: Callable[[], torch.Tensor],
                  bar) -> None:
        crc = 0
        for p in range(off, off + n, _PIECE):
            k = min(_PIECE, off + n - p)
            buf = self.flat[p - self.base:p - self.base + k] if self.flat is not None else bounce()[:k]
            _pread_into(fd, buf, p, self.path, self.entry.bytes)
            if verify:
                crc = zlib.crc32(memoryview(buf.numpy()), crc)  # releases the GIL on big buffers
            if self.rows_dst is not None:
                _scatter_rows(self.rows_dst, buf.numpy(), p, self.fstride)
            if bar is not None:
                bar.update(k)
        if verify and crc != self.entry.crc32[i]:
            raise self._checksum_error(fd, i, off, n)
        if self.pad is not None and self.pad.shape[1]:
            rows = self.pad.shape[0]
            self.pad[min(rows, -(-off // self.fstride)):min(rows, -(-(off + n) // self.fstride))] = 0


    def _checksum_error(self, fd: int, i: int, off: int, n: int) -> TableFormatError:
        """Chunk ``i`` failed its CRC32 -> the error, naming its first page failing the page CRC32C when there are page
        CRCs (CorruptPageError, read again to look)."""
        err = checksum_error(self.path, i, off, n)
        if self.pages is None:
            return err
        sidecar, page_size = self.pages
        first, count = off // page_size, n // page_size
        try:
            with open(sidecar, "rb") as f:
                f.seek(first * 4)
                stored = np.frombuffer(f.read(count * 4), dtype="<u4")  # [count]
            got = crc32c_pages(np.frombuffer(os.pread(fd, count * page_size, off), dtype=np.uint8), page_size)
        except OSError:
            return err
        if len(stored) != count or len(got) != count or not (bad := np.flatnonzero(stored != got)).size:
            return err
        k = int(bad[0])
        page = page_error(self.path, first + k, page_size, int(stored[k]), int(got[k]))
        return CorruptPageError(self.path, page.offset, f"{page.why}; {err.why}")


def _fill(fills: list[_FileFill], verify: bool, threads: int, bar) -> None:
    """Run ``fills``' chunks on ``threads`` workers in file order; a failure skips the rest and raises the first."""
    local = threading.local()
    stop = threading.Event()
    fds = {}

    def bounce() -> torch.Tensor:
        if not hasattr(local, "buf"):
            local.buf = torch.empty(_PIECE, dtype=torch.uint8)  # per worker, reused for every piece
        return local.buf

    def job(f: _FileFill, i: int, off: int, n: int) -> None:
        if stop.is_set():
            return
        try:
            f.run_chunk(fds[f.path], i, off, n, verify, bounce, bar)
        except BaseException:
            stop.set()
            raise

    try:
        for f in fills:
            check_file_size(f.path, f.entry.bytes)
            fds[f.path] = os.open(f.path, os.O_RDONLY)
        jobs = [(f, *c) for f in fills for c in f.chunks()]
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs)))) as pool:
            futures = [pool.submit(job, *j) for j in jobs]
        for fut in futures:
            fut.result()
    finally:
        for fd in fds.values():
            os.close(fd)


HostTarget = "str | SharedTarget"  # "ram", "pinned", or one copy per node (shared_host.py)


def is_host_target(target) -> bool:
    """Whether ``target`` is host memory: "ram", "pinned" or a SharedTarget."""
    return isinstance(target, SharedTarget) or target in ("ram", "pinned")


def _host_buffer(nbytes: int, target: HostTarget, fill: Callable[[torch.Tensor], None], part: str) -> torch.Tensor:
    """uint8 [nbytes] in RAM, pinned memory or (a SharedTarget) segment ``part`` of the node's shared copy, written by
    ``fill`` before it is pinned (a shared segment that exists already is mapped, and ``fill`` is not called)."""
    if isinstance(target, SharedTarget) and nbytes:  # nothing to share in an empty file: RAM below
        return shared_buffer(target, part, nbytes, fill)
    if target == "pinned":
        return pinned_empty_filled(nbytes, fill)
    out = torch.empty(nbytes, dtype=torch.uint8)
    fill(out)
    return out


def _check_threads(threads: int) -> None:
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")


def load_file(m: TableManifest, kind: str, target: HostTarget | torch.device = "ram", verify: bool = True,
              progress: bool = False, threads: int = LOAD_THREADS) -> torch.Tensor:
    """Data file ``kind`` ("values" | "scales") as uint8 [file bytes] on ``target`` (host: ``threads`` workers)."""
    _check_threads(threads)
    entry = m.files[kind]
    path = m.path / entry.name
    check_file_size(path, entry.bytes)
    bar = _bar(progress, entry.bytes, f"load {m.path.name}/{entry.name}")
    try:
        if is_host_target(target):
            return _host_buffer(entry.bytes, target,
                                lambda dst: _fill([_FileFill(m, kind, flat=dst)], verify, threads, bar), kind)
        return _load_to_device(m, kind, torch.device(target), verify, bar, threads)
    finally:
        if bar is not None:
            bar.close()


DEVICE_WINDOW = 256 << 20  # bytes of a file read (in parallel) into one pinned window before its copy


def _load_to_device(m: TableManifest, kind: str, dev: torch.device, verify: bool, bar,
                    threads: int = LOAD_THREADS) -> torch.Tensor:
    """One data file into device memory: workers read and CRC one pinned window while the other's copy runs."""
    size, cb = m.files[kind].bytes, m.chunk_bytes
    out = torch.empty(size, dtype=torch.uint8, device=dev)
    span = max(cb, DEVICE_WINDOW // cb * cb)  # whole chunks per window

    def fill(hosts: list[torch.Tensor], w0: int, w1: int) -> None:
        _fill([_FileFill(m, kind, flat=hosts[0], base=w0, only=range(w0 // cb, -(-w1 // cb)))], verify, threads, bar)

    _through_windows([out], span, fill)
    return out


def _through_windows(outs: list[torch.Tensor], span: int,
                     fill: Callable[[list[torch.Tensor], int, int], None]) -> None:
    """Write ``outs`` (one device, sharing dim 0) ``span`` entries at a time through two alternating host windows
    (``fill(hosts, w0, w1)``) copied on a side stream; the caller's stream follows the copies, also after an error."""
    dev, n = outs[0].device, outs[0].shape[0]
    cuda = dev.type == "cuda"
    windows = [[torch.empty((min(span, n), *o.shape[1:]), dtype=o.dtype, pin_memory=cuda) for o in outs]
               for _ in range(2)]
    copied = [None, None]  # the event after each window's last copy
    stream = torch.cuda.Stream(dev) if cuda else None
    try:
        for k, w0 in enumerate(range(0, n, span)):
            w1 = min(n, w0 + span)
            hosts = [h[:w1 - w0] for h in windows[k % 2]]
            if copied[k % 2] is not None:
                copied[k % 2].synchronize()  # its previous copy has read it
            fill(hosts, w0, w1)
            if not cuda:
                for o, h in zip(outs, hosts):
                    o[w0:w1].copy_(h)
                continue
            with torch.cuda.stream(stream):
                for o, h in zip(outs, hosts):
                    o[w0:w1].copy_(h, non_blocking=True)
                copied[k % 2] = torch.cuda.Event()
                copied[k % 2].record(stream)
        if cuda:
            torch.cuda.current_stream(dev).wait_stream(stream)  # `outs` are ready for the caller's stream
    except BaseException:
        if cuda:
            stream.synchronize()  # no copy may still write into `outs` once they are freed
        raise


def fill_packed(m: TableManifest, dst: torch.Tensor, verify: bool = True, threads: int = LOAD_THREADS,
                bar=None) -> None:
    """Write MXFP8 table ``m``'s packed layout into ``dst`` (rows * S bytes of host memory), every chunk CRC-checked."""
    _check_threads(threads)
    vb, sc = m.value_bytes, m.scale_cols
    stride = packed_row_bytes(vb, sc)
    if dst.dtype != torch.uint8 or dst.device.type != "cpu" or dst.numel() != m.rows * stride:
        raise ValueError(f"dst must be uint8 host memory of {m.rows} x {stride} bytes, got {dst.dtype} "
                         f"{tuple(dst.shape)} on {dst.device}")
    packed = dst.view(m.rows, stride)  # [rows, S]
    _fill([_FileFill(m, "values", rows_dst=packed[:, :vb], fstride=m.row_stride, pad=packed[:, vb + sc:]),
           _FileFill(m, "scales", rows_dst=packed[:, vb:vb + sc], fstride=sc)], verify, threads, bar)


def load_packed(m: TableManifest, target: HostTarget = "pinned", verify: bool = True, progress: bool = False,
                threads: int = LOAD_THREADS) -> torch.Tensor:
    """An MXFP8 table as one host buffer uint8 [rows, S], S = ``packed_row_bytes`` (272 for V4.1)::

        row r: | value bytes (value_bytes) | scale bytes (scale_cols) | zeros to S |
               0                          value_bytes               +scale_cols  S

    A row's values and scales then usually share one page, which is what a UVA gather pays for. Pinned when ``target``
    is "pinned" and CUDA exists, the node's shared copy for a SharedTarget, RAM otherwise."""
    if not m.scale_cols:
        raise ValueError(f"layout='packed' needs an mxfp8 table with scales; {m.path} is {m.row_dtype}")
    if not is_host_target(target):
        raise ValueError(f"target={target!r}: the packed layout is built in host memory ('ram' or 'pinned')")
    _check_threads(threads)
    stride = packed_row_bytes(m.value_bytes, m.scale_cols)
    bar = _bar(progress, sum(m.files[k].bytes for k in ("values", "scales")), f"load {m.path.name} (packed)")
    try:
        return _host_buffer(m.rows * stride, target,
                            lambda dst: fill_packed(m, dst, verify, threads, bar), "packed").view(m.rows, stride)
    finally:
        if bar is not None:
            bar.close()


def load_table(m: TableManifest, target: HostTarget | torch.device = "ram", verify: bool = True,
               progress: bool = False, layout: str = "split",
               threads: int = LOAD_THREADS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values uint8 [rows, >= value_bytes], scales | None) on ``target``: "split", one buffer per file; "packed" (MXFP8
    in host memory), views of one ``load_packed`` buffer."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if layout == "packed" and m.scale_cols:
        packed = load_packed(m, target, verify, progress, threads)  # [rows, S]
        vb = m.value_bytes
        return packed[:, :vb], packed[:, vb:vb + m.scale_cols]
    values = load_file(m, "values", target, verify, progress, threads)
    values = values[: m.rows * m.row_stride].view(m.rows, m.row_stride)
    scales = None
    if "scales" in m.files:
        try:
            scales = load_file(m, "scales", target, verify, progress, threads).view(m.rows, m.scale_cols)
        except BaseException:
            del values  # a bad scales file frees (unpins) the values now, not when the error is collected
            raise
    return values, scales
