"""One copy per node of a table's resident host bytes (the host tier's rows, the disk tier's scales and page CRCs): a
segment file in a tmpfs directory (``/dev/shm``) that the first process to open the table creates and every other
process on the node maps, so M data-parallel replicas hold one copy, not M. Under CUDA each process registers its
mapping for UVA (``cudaHostRegister``, mapped + portable); on the CPU it is only mapped.

A segment is named by the table's content (``table_key``: geometry, fingerprint, the files' chunk CRCs) and a part
("packed", "values", "scales", "page_crc")::

    <dir>/engram-<key>-<part>   | header (HEADER_BYTES) | data (nbytes) |
    header: magic "ENGRAMSH" | version u32 | header bytes u32 | data bytes u64 | key | part | creator pid u64 |
            created (ns) u64 | CRC32 of all the preceding header bytes u32

Creation runs under an exclusive ``flock`` on the directory's ``engram-shared.lock``: leftover ``<name>.tmp-*``
files (a creator that was killed) are removed, a new one is allocated to its full size (no space is a clear error,
never a SIGBUS while filling), mapped shared, filled by the loader (which CRC-checks what it reads), its header
written last, then renamed to ``<name>``: the final name only ever holds a whole segment, and a mapper checks the
header (magic, version, CRC, key, part, size) before it uses one. Every mapper holds a shared ``flock`` on the
segment while mapped; the last one to let go (an exclusive lock then succeeds) unlinks it. The lock file stays
(empty; deleting a lock file others may hold open would let two creators in at once). A process killed while it maps
a segment drops its lock with it; if it was the last, the segment stays until the next process to open the table
maps it (and, in time, unlinks it)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from engram.store.format import TableManifest
from engram.store.sizes import fmt_bytes

_log = logging.getLogger(__name__)

MAGIC = b"ENGRAMSH"
VERSION = 1
HEADER_BYTES = 4096  # one page: the data starts page-aligned, as cudaHostRegister and UVA reads want
_HEAD = struct.Struct("<8sIIQ32s16sQQ")  # magic, version, header bytes, data bytes, key, part, creator pid, created ns
_CRC = struct.Struct("<I")
PARTS = ("packed", "values", "scales", "page_crc")
LOCK_NAME = "engram-shared.lock"  # one per directory: creating, attaching and unlinking segments hold it
_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped: every context, kernel-addressable
_HELD = threading.local()  # the creation locks this thread holds, by directory (_creation_lock)
_STATS_LOCK = threading.Lock()
_STATS = {"created": 0, "mapped": 0, "created_bytes": 0, "mapped_bytes": 0}


class SharedMemoryError(RuntimeError):
    """The shared segment cannot be made or used (no room in the directory, a segment of the same name in use that
    does not match); the message names the file, the sizes and the option to change."""


@dataclass(frozen=True)
class SharedTarget:
    """Where a table's host buffers go instead of private memory: segments ``<directory>/engram-<key>-<part>``."""

    directory: str  # a tmpfs directory (engram_config.advanced.shm_dir)
    key: str  # table_key of the table
    label: str  # the table's directory, for messages


def shared_stats() -> dict:
    """Segments this process created or mapped (someone else's) since it started, and their bytes."""
    with _STATS_LOCK:
        return dict(_STATS)


def table_key(m: TableManifest) -> str:
    """A digest of what decides a table's bytes: geometry, layer, fingerprint, meta, and each file's size and chunk
    CRCs (the directory only for a table built in memory, which has no files)."""
    ident = {"rows": m.rows, "dim": m.dim, "row_dtype": m.row_dtype, "row_stride": m.row_stride,
             "layer_id": m.layer_id, "fingerprint": m.fingerprint, "meta": m.meta, "chunk_bytes": m.chunk_bytes,
             "page_size": m.page_size,
             "files": {k: [f.name, f.bytes, list(f.crc32)] for k, f in sorted(m.files.items())}}
    if not m.files:
        ident["path"] = str(m.path)
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def shared_target(m: TableManifest, directory: str) -> SharedTarget:
    return SharedTarget(str(directory), table_key(m), str(m.path))


def segment_path(target: SharedTarget, part: str) -> Path:
    if part not in PARTS:
        raise ValueError(f"part={part!r} is not one of {PARTS}")
    return Path(target.directory) / f"engram-{target.key}-{part}"


def check_capacity(needs: Iterable[tuple[SharedTarget, str, int]]) -> None:
    """Before anything is filled: the segments of ``needs`` ((target, part, data bytes)) that do not exist yet must fit
    in their directory's free space (statvfs), else SharedMemoryError with the sizes. Sizes are the tables'."""
    missing: dict[str, int] = {}
    for target, part, nbytes in needs:
        if nbytes and not segment_path(target, part).exists():
            missing[target.directory] = missing.get(target.directory, 0) + HEADER_BYTES + nbytes
    for directory, want in missing.items():
        st = _statvfs(directory)
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if want > free:
            raise SharedMemoryError(
                f"engram_config.shared_memory: {directory} has {fmt_bytes(free)} free of {fmt_bytes(size)}, but the "
                f"tables' shared copies need {fmt_bytes(want)} more; enlarge it (e.g. docker run --shm-size, or "
                f"mount -o remount,size=... {directory}), choose another tmpfs with engram_config.advanced.shm_dir, "
                f"or turn engram_config.shared_memory off")


def _statvfs(directory: str) -> os.statvfs_result:
    try:
        return os.statvfs(directory)
    except OSError as e:
        raise SharedMemoryError(f"engram_config.advanced.shm_dir={directory!r}: {e.strerror}") from None


def shared_buffer(target: SharedTarget, part: str, nbytes: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """uint8 [nbytes] backed by segment ``part`` of ``target``: mapped when a whole one exists, else created (``fill``
    writes the bytes; a raising ``fill`` leaves no segment). Registered with CUDA when CUDA is available."""
    if nbytes < 1:
        raise ValueError(f"nbytes={nbytes} must be >= 1 (an empty buffer has nothing to share)")
    path = segment_path(target, part)
    _statvfs(target.directory)  # a missing directory is named before any file is tried
    with _creation_lock(path.parent):  # one creator at a time; mappers wait for it
        fd, creator = _open_whole(path, target, part, nbytes)
        created = fd is None
        if created:
            fd = _create(path, target, part, nbytes, fill)
            creator = os.getpid()
        # A shared lock held while mapped, on a description of its own: mmap dups the fd it maps, and that dup may
        # outlive _release (a view still exported at exit), which must not keep the lock.
        held = os.open(path, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)
    mapped = _map(fd, held, path, nbytes)
    how = "created" if created else f"mapped (created by pid {creator})"
    _log.info("%s %s: %s %s, %s in pid %d", target.label, part, how, path, fmt_bytes(nbytes), os.getpid())
    with _STATS_LOCK:
        _STATS["created" if created else "mapped"] += 1
        _STATS["created_bytes" if created else "mapped_bytes"] += nbytes
    return mapped


def made_with(target: SharedTarget, part: str, beside: str) -> Callable[[torch.Tensor], None]:
    """A ``fill`` for segment ``part``, which is made inside segment ``beside``'s fill: it raises, naming both (the
    segment ``beside`` exists while ``part`` does not: someone removed it)."""
    def fill(_: torch.Tensor) -> None:
        raise SharedMemoryError(f"{segment_path(target, beside)} exists without {segment_path(target, part)}, which "
                                "is made with it; remove it (no process may map it) and start again")
    return fill


@contextlib.contextmanager
def _creation_lock(directory: Path) -> Iterator[None]:
    """The directory's exclusive creation lock (flock on LOCK_NAME, made on first use and never removed); re-entrant
    in a thread, as a split table's fill makes its scales segment inside its values segment's."""
    held = _HELD.__dict__.setdefault("depth", {})
    key = str(directory)
    if held.get(key):
        held[key] += 1
        try:
            yield
        finally:
            held[key] -= 1
        return
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held[key] = 1
        try:
            yield
        finally:
            held[key] = 0
    finally:
        os.close(fd)  # drops the lock


def _header(target: SharedTarget, part: str, nbytes: int) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, nbytes, target.key.encode(), part.encode(), os.getpid(),
                      _now_ns())
    return head + _CRC.pack(zlib.crc32(head))


def _now_ns() -> int:
    return time.time_ns()


def _check_header(raw: bytes, target: SharedTarget, part: str, nbytes: int, size: int) -> tuple[str | None, int]:
    """(why the segment cannot be used, or None; its creator's pid)."""
    if len(raw) < _HEAD.size + _CRC.size:
        return f"{len(raw)} bytes, shorter than a header", 0
    head, (crc,) = raw[:_HEAD.size], _CRC.unpack_from(raw, _HEAD.size)
    if zlib.crc32(head) != crc:
        return "its header fails its CRC32", 0
    magic, version, hbytes, data, key, got_part, pid, _ = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or hbytes != HEADER_BYTES:
        return f"magic {magic!r} version {version} header {hbytes} B, expected {MAGIC!r} {VERSION} {HEADER_BYTES}", pid
    if key.rstrip(b"\0").decode() != target.key or got_part.rstrip(b"\0").decode() != part:
        return "its header names another table", pid
    if data != nbytes or size != HEADER_BYTES + nbytes:
        return f"it holds {data} data bytes in a {size}-byte file, the table needs {nbytes}", pid
    return None, pid


def _open_whole(path: Path, target: SharedTarget, part: str, nbytes: int) -> tuple[int | None, int]:
    """(an fd of the whole segment at ``path``, its creator) or (None, 0) when there is none to map (a bad one that no
    process maps is removed; one in use that does not match raises). Called under the creation lock."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None, 0
    why, pid = _check_header(os.pread(fd, HEADER_BYTES, 0), target, part, nbytes, os.fstat(fd).st_size)
    if why is None:
        return fd, pid
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SharedMemoryError(f"{path}: {why}, and a process maps it; stop that process or remove the file") from None
    _log.warning("%s: %s; nothing maps it, so it is removed and built again", path, why)
    os.unlink(path)
    os.close(fd)
    return None, 0


def _create(path: Path, target: SharedTarget, part: str, nbytes: int, fill: Callable[[torch.Tensor], None]) -> int:
    """A new whole segment at ``path`` (through ``<path>.tmp-<pid>``) -> its fd. Called under the creation lock."""
    for stale in path.parent.glob(f"{path.name}.tmp-*"):  # a creator killed before its rename
        _log.warning("%s: removing %s, left by a process that did not finish creating it", path, stale.name)
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)  # tmpfs pages now: no SIGBUS while filling
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            st = os.statvfs(path.parent)
            raise SharedMemoryError(f"{path}: cannot allocate {fmt_bytes(HEADER_BYTES + nbytes)} in {path.parent} "
                                    f"({fmt_bytes(st.f_bavail * st.f_frsize)} free): {e.strerror}; enlarge it or "
                                    "turn engram_config.shared_memory off") from None
        region = mmap.mmap(fd, HEADER_BYTES + nbytes, flags=mmap.MAP_SHARED)
        try:
            _advise_huge(region, nbytes)
            view = memoryview(region)
            dst = torch.frombuffer(view[HEADER_BYTES:], dtype=torch.uint8)  # [nbytes] in the segment
            try:
                fill(dst)
            finally:
                del dst
                view.release()
            region[:HEADER_BYTES] = _header(target, part, nbytes).ljust(HEADER_BYTES, b"\0")  # written last
        finally:
            region.close()
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


def _advise_huge(region: mmap.mmap, nbytes: int) -> None:
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 2 << 20:
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # shmem THP off on this kernel: 4 KiB pages still work
            pass


def _map(fd: int, held: int, path: Path, nbytes: int) -> torch.Tensor:
    """The data of the whole segment ``fd`` (closed here) as uint8 [nbytes], registered with CUDA when available;
    ``held`` (the shared lock) lives as long as the mapping, and ``_release`` runs when the last tensor viewing it
    goes."""
    try:
        region = mmap.mmap(fd, HEADER_BYTES + nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(held)
        raise
    finally:
        os.close(fd)
    view = memoryview(region)
    window = view[HEADER_BYTES:]
    dst = torch.frombuffer(window, dtype=torch.uint8)  # [nbytes]; keeps `window` (and the map) alive
    ptr = dst.data_ptr() if torch.cuda.is_available() else None
    if ptr is not None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
        if int(getattr(err, "value", err)) != 0:
            del dst
            _release(None, region, held, path, nbytes, window, view)
            raise SharedMemoryError(f"{path}: cudaHostRegister(ptr=0x{ptr:x}, bytes={nbytes}) failed with CUDA "
                                    f"error {err}")
    weakref.finalize(window, _release, ptr, region, held, path, nbytes)
    view.release()
    return dst


def _release(ptr: int | None, region: mmap.mmap, held: int, path: Path, nbytes: int, *views: memoryview) -> None:
    """Unregister and unmap a segment, drop this process's shared lock (``held``), and unlink the segment if no other
    process holds one."""
    if ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    try:
        for v in views:
            v.release()
        region.close()
    except BufferError:  # a view still exported (at exit): the map goes with the process
        pass
    os.close(held)
    if not path.parent.is_dir():  # the directory is gone: nothing to unlink
        return
    with _creation_lock(path.parent):  # no mapper attaches meanwhile
        try:
            seg = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(seg, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process maps it: it unlinks it after its last use
            return
        finally:
            os.close(seg)
        path.unlink(missing_ok=True)
        _log.info("%s: unlinked (no process maps it)", path)
