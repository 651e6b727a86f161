"""Streaming table writer: rows go to disk chunk by chunk, never the whole table in RAM. ``TableWriter`` fills a hidden
temporary directory next to the target (CRCs and writes on background threads), writes manifest.json last, fsyncs and
renames it into place: a crash leaves no table at the target. Temporary directories name their writer
(``.NAME.partial-HOST-PID-N``, ``.NAME.old-HOST-PID-N``), so the next writer removes those of dead writers
(``remove_stale_partials``). ``write_table`` writes in-memory tensors."""
from __future__ import annotations

import os
import queue
import re
import shutil
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram.store.format import (DEFAULT_CHUNK_BYTES, ITEMSIZE, MANIFEST, PAGE_CRC_FILE, PAGE_SIZE, SCALE_BLOCK,
                                 SCALES_FILE, VALUES_FILE, ChunkCrc, FileEntry, TableManifest, row_stride,
                                 values_file_bytes)
from engram.store.page_crc import PageCrcStream, sidecar_bytes
from engram.store.kernels.reference import ROW_TORCH_DTYPES

# append() may keep references to the arrays it was given until IN_FLIGHT more appends have returned: each
# file's writer thread works on one buffer while at most two wait in its queue.
IN_FLIGHT = 3
FLUSH_BYTES = 256 << 20  # a data file starts background writeback every this many bytes
TORCH_ROW_DTYPES = {dt: name for name, dt in ROW_TORCH_DTYPES.items()}  # torch dtype -> row dtype


def as_bytes(x: torch.Tensor | np.ndarray, width: int, what: str) -> np.ndarray:
    """A uint8 numpy view [n, width] of a 2-D tensor/array of any dtype (CPU, contiguous)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu").contiguous()
        x = x.view(torch.uint8).numpy() if x.dtype != torch.uint8 else x.numpy()
    arr = np.ascontiguousarray(x).view(np.uint8)
    if arr.ndim != 2 or arr.shape[1] != width:
        raise ValueError(f"{what} must be [n, {width}] bytes per row, got a {arr.shape} byte view")
    return arr


class _FileSink:
    """A data file fed by one producer: CRC and write threads per buffer, a background fdatasync every FLUSH_BYTES, page
    CRC32Cs with ``page_size``; errors resurface on the next put or on close."""

    def __init__(self, path: Path, chunk_bytes: int, sync: bool = True, page_size: int = 0) -> None:
        self.path = path
        self.crc = ChunkCrc(chunk_bytes)
        self.pages = PageCrcStream(page_size) if page_size else None
        self.size = 0
        self._f = open(path, "wb", buffering=0)
        self._error: BaseException | None = None
        self._queues = [queue.Queue(maxsize=IN_FLIGHT - 1) for _ in range(2)]  # + one in hand = IN_FLIGHT
        self._threads = [threading.Thread(target=self._loop, args=(q, work), daemon=True,
                                          name=f"engram-{what}-{path.name}")
                         for q, work, what in zip(self._queues, (self._write, self._checksum), ("write", "crc"))]
        self._sync = sync
        self._flush_wanted = threading.Event()
        self._written = 0
        self._flusher = threading.Thread(target=self._flush_loop, daemon=True, name=f"engram-flush-{path.name}")
        self._closing = False
        for t in (*self._threads, self._flusher):
            t.start()

    def _loop(self, q: queue.Queue, work) -> None:
        while True:
            buf = q.get()
            if buf is None:
                return
            if self._error is None:
                try:
                    work(memoryview(buf).cast("B"))
                except BaseException as e:  # noqa: BLE001 - handed back to the producer thread
                    self._error = e

    def _checksum(self, mv: memoryview) -> None:
        self.crc.update(mv)
        if self.pages is not None:
            self.pages.update(mv)

    def _write(self, mv: memoryview) -> None:
        before = self._written // FLUSH_BYTES
        while mv:
            n = self._f.write(mv)
            mv = mv[n:]
            self._written += n
        if self._sync and self._written // FLUSH_BYTES != before:
            self._flush_wanted.set()

    def _flush_loop(self) -> None:
        while True:
            self._flush_wanted.wait()
            self._flush_wanted.clear()
            if self._closing:
                return
            try:
                os.fdatasync(self._f.fileno())  # writeback overlaps the next buffers' production
            except OSError as e:
                self._error = self._error or e

    def put(self, buf: np.ndarray) -> None:
        if self._error is not None:
            raise self._error
        self.size += buf.nbytes
        for q in self._queues:
            q.put(buf)

    def close(self, sync: bool = True) -> list[int]:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._closing = True
        self._flush_wanted.set()
        self._flusher.join()
        try:
            if self._error is None and sync:
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
        if self._error is not None:
            raise self._error
        return self.crc.finish()


class TableWriter:
    """Write one table of ``rows`` x ``dim`` ``row_dtype`` rows to ``directory`` in appended pieces.
    ``append(values, scales=None)``: values [n, dim] of the row dtype or raw bytes uint8 [n, value_bytes]; scales [n,
    dim/32] for mxfp8, referenced until IN_FLIGHT later appends return. A context manager (removes all on error) or
    ``finish()``; an existing table is replaced only once the new one is complete."""

    def __init__(self, directory: str | os.PathLike, rows: int, dim: int, row_dtype: str = "mxfp8", *,
                 layer_id: int | None = None, fingerprint: dict[str, Any] | None = None,
                 meta: dict[str, Any] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 progress: bool = False, desc: str | None = None, sync: bool = True) -> None:
        if row_dtype not in ITEMSIZE:
            raise ValueError(f"row_dtype={row_dtype!r} must be one of {sorted(ITEMSIZE)}")
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1")
        if dim < 1 or (row_dtype == "mxfp8" and dim % SCALE_BLOCK):
            raise ValueError(f"dim={dim} must be >= 1 (a multiple of {SCALE_BLOCK} for mxfp8)")
        if chunk_bytes < PAGE_SIZE or chunk_bytes % PAGE_SIZE:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {PAGE_SIZE}")
        self.target = Path(directory)
        _check_target(self.target)
        self.rows, self.dim, self.row_dtype = rows, dim, row_dtype
        self.value_bytes = dim * ITEMSIZE[row_dtype]
        self.stride = row_stride(self.value_bytes)
        self.scale_cols = dim // SCALE_BLOCK if row_dtype == "mxfp8" else 0
        self.layer_id, self.fingerprint, self.meta = layer_id, fingerprint, dict(meta or {})
        self.chunk_bytes, self.sync = chunk_bytes, sync
        self.written = 0
        self.target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(self.target.parent)
        self.tmp = self.target.parent / f".{self.target.name}.partial-{owner_tag()}"
        self.tmp.mkdir()
        self._values = _FileSink(self.tmp / VALUES_FILE, chunk_bytes, sync, page_size=PAGE_SIZE)
        self._scales = _FileSink(self.tmp / SCALES_FILE, chunk_bytes, sync) if self.scale_cols else None
        self._bar = None
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=rows, unit="row", unit_scale=True, desc=desc or self.target.name)
        self._done = False

    def append(self, values: torch.Tensor | np.ndarray, scales: torch.Tensor | np.ndarray | None = None) -> None:
        """Append n rows (see the class docstring for the accepted forms)."""
        if self._done:
            raise RuntimeError(f"writer for {self.target} is already finished")
        v = as_bytes(values, self.value_bytes, "values")  # [n, value_bytes]
        n = v.shape[0]
        if self.written + n > self.rows:
            raise ValueError(f"{self.target}: appending {n} rows after {self.written} exceeds rows={self.rows}")
        if self.scale_cols:
            if scales is None:
                raise ValueError(f"{self.target}: mxfp8 rows need scales [n, {self.scale_cols}]")
            s = as_bytes(scales, self.scale_cols, "scales")
            if s.shape[0] != n:
                raise ValueError(f"scales have {s.shape[0]} rows but values have {n}")
        elif scales is not None:
            raise ValueError(f"{self.target}: {self.row_dtype} rows take no scales")
        if self.stride != self.value_bytes:  # pad each row to the stride: [n, value_bytes] -> [n, stride]
            padded = np.zeros((n, self.stride), dtype=np.uint8)
            padded[:, : self.value_bytes] = v
            v = padded
        self._values.put(np.ascontiguousarray(v))
        if self.scale_cols:
            self._scales.put(np.ascontiguousarray(s))
        self.written += n
        if self._bar is not None:
            self._bar.update(n)

    def finish(self) -> TableManifest:
        """Pad, checksum, write the manifest last, fsync and rename into place; returns the manifest."""
        if self._done:
            raise RuntimeError(f"writer for {self.target} is already finished")
        try:
            if self.written != self.rows:
                raise ValueError(f"{self.target}: {self.written} rows written, the table was declared with "
                                 f"{self.rows}")
            pad = values_file_bytes(self.rows, self.stride) - self.rows * self.stride
            if pad:
                self._values.put(np.zeros(pad, dtype=np.uint8))
            files = {"values": FileEntry(VALUES_FILE, self._values.size, self._values.close(self.sync))}
            files["page_crc"] = write_sidecar(self.tmp / PAGE_CRC_FILE, self._values.pages.finish(),
                                              self.chunk_bytes, self.sync)
            self._values = None
            if self._scales is not None:
                files["scales"] = FileEntry(SCALES_FILE, self._scales.size, self._scales.close(self.sync))
                self._scales = None
            m = TableManifest(path=self.target, rows=self.rows, dim=self.dim, row_dtype=self.row_dtype,
                              row_stride=self.stride, files=files, layer_id=self.layer_id,
                              fingerprint=self.fingerprint, meta=self.meta, chunk_bytes=self.chunk_bytes)
            write_synced(self.tmp / MANIFEST, m.to_json().encode(), self.sync)
            _install(self.tmp, self.target, self.sync)
            return m
        except BaseException:
            self.abort()
            raise
        finally:
            self._done = True
            if self._bar is not None:
                self._bar.close()

    def abort(self) -> None:
        """Drop everything written so far (the target is left as it was)."""
        for sink in (self._values, self._scales):
            if sink is not None:
                try:
                    sink.close(sync=False)
                except BaseException:  # noqa: BLE001 - aborting anyway
                    pass
        self._values = self._scales = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done = True

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._done:
                self.finish()
        else:
            self.abort()


def _check_target(target: Path) -> None:
    """Only a missing path, an empty directory or an existing table may be (re)placed."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / MANIFEST).is_file())):
        raise FileExistsError(f"{target} exists and is not an engram table; refusing to replace it")


def write_sidecar(path: Path, crcs: np.ndarray, chunk_bytes: int, sync: bool = True) -> FileEntry:
    """Write the page-CRC sidecar of ``crcs`` to ``path`` -> its manifest entry (PAGE_CRC_FILE)."""
    data = sidecar_bytes(crcs)
    crc = ChunkCrc(chunk_bytes)
    crc.update(data)
    write_synced(path, data, sync)
    return FileEntry(PAGE_CRC_FILE, len(data), crc.finish())


def write_synced(path: Path, data: bytes, sync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, target: Path, sync: bool) -> None:
    """Rename the finished temp directory onto ``target``, replacing an old table only after that."""
    _check_target(target)
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{owner_tag()}"
        os.rename(target, old)
    os.rename(tmp, target)
    if sync:
        fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# .NAME.partial-HOST-PID-N / .NAME.old-HOST-PID-N (and HOST- missing in directories of older writers)
_TEMP_DIR = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old)-(?:(?P<host>[A-Za-z0-9_]+)-)?(?P<pid>\d+)-\d+")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:64] or "host"


def owner_tag() -> str:
    """HOST-PID-N naming a temporary file or directory this process makes (N tells them apart)."""
    return f"{_host()}-{os.getpid()}-{time.monotonic_ns()}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this machine is alive (a zombie is not: it can never finish a table)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_partials(directory: str | os.PathLike) -> list[Path]:
    """Remove each ``.NAME.partial-*`` in ``directory`` (a table directory, or a file a table upgrade was writing)
    whose writer no longer runs on this machine, and each such ``.NAME.old-*`` once NAME exists (else rename it back
    to NAME); others are left. Each action warns (RuntimeWarning naming path, size, writer); returns the paths
    removed or restored."""
    root, here, done = Path(directory), _host(), []
    for path in sorted(root.iterdir(), key=lambda p: ".old-" not in p.name):  # restore before removing
        m = _TEMP_DIR.fullmatch(path.name)
        is_file = m is not None and m["kind"] == "partial" and path.is_file() and not path.is_symlink()
        if m is None or not (path.is_dir() or is_file) or (m["host"] or here) != here or _running(int(m["pid"])):
            continue
        target = root / m["name"]
        size = (path.stat().st_size if is_file
                else sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()))
        writer = f"process {m['pid']}, which is no longer running"
        try:
            if m["kind"] == "old" and not target.exists():
                os.rename(path, target)
                msg = f"restored the table {target} from {path.name} ({size} bytes), left by {writer}"
            else:
                path.unlink() if is_file else shutil.rmtree(path)
                what = ("an unfinished file" if is_file
                        else f"{'an unfinished' if m['kind'] == 'partial' else 'a replaced'} table")
                msg = f"removed {path} ({size} bytes): {what} left by {writer}"
        except OSError as e:  # another process cleaned it up first, or it is not ours to remove
            msg, path = f"could not clean up {path}: {e}", None
        warnings.warn(f"engram: {msg}", RuntimeWarning, stacklevel=2)
        if path is not None:
            done.append(path)
    return done


def write_table(directory: str | os.PathLike, values: torch.Tensor, scales: torch.Tensor | None = None,
                meta: dict[str, Any] | None = None, *, chunk_rows: int = 1 << 18,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                progress: bool = False) -> TableManifest:
    """Write an in-memory table: values [R, D] float8_e4m3fn (+ scales [R, D/32]) or bf16 / f16 / f32; ``meta``'s
    ``layer_id`` and ``fingerprint`` go to those manifest fields, the rest to its ``meta``."""
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [rows, dim], got shape {tuple(values.shape)}")
    if values.dtype == torch.uint8:
        if scales is None:
            raise ValueError("uint8 values are read as raw float8_e4m3fn bytes and need scales")
        values = values.view(torch.float8_e4m3fn)
    if values.dtype not in TORCH_ROW_DTYPES:
        raise ValueError(f"values dtype {values.dtype} is not a row dtype ({list(TORCH_ROW_DTYPES)})")
    row_dtype = TORCH_ROW_DTYPES[values.dtype]
    rows, dim = values.shape
    if row_dtype == "mxfp8":
        if scales is None:
            raise ValueError("float8_e4m3fn values need scales [rows, dim/32] (MXFP8)")
        if tuple(scales.shape) != (rows, dim // SCALE_BLOCK):
            raise ValueError(f"scales shape {tuple(scales.shape)} does not match values {(rows, dim)} "
                             f"(expected {(rows, dim // SCALE_BLOCK)})")
    meta = dict(meta or {})
    layer_id = meta.pop("layer_id", None)
    fingerprint = meta.pop("fingerprint", None)
    with TableWriter(directory, rows, dim, row_dtype, layer_id=layer_id, fingerprint=fingerprint, meta=meta,
                     chunk_bytes=chunk_bytes, progress=progress) as w:
        for a in range(0, rows, chunk_rows):
            b = min(rows, a + chunk_rows)
            w.append(values[a:b], scales[a:b] if scales is not None else None)
        return w.finish()
