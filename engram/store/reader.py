"""Batched page reads from one file: ``PageReader.read(offsets, out)`` fills ``out`` with whole pages, through the C
pthread pool (csrc/pread_pool.c, GIL released), its Linux AIO reader for ``io="direct"`` (O_DIRECT), or a Python thread
pool with identical bytes when the extension is missing. A failed, short or stale read raises ``DiskReadError`` naming
file and offset; only that call fails."""
from __future__ import annotations

import contextlib
import errno as errno_mod
import itertools
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engram.fast_path import FastPathSwitch
from engram.store.crc32c import crc32c_pages

PAGE = 4096  # read unit and O_DIRECT alignment: 4 KiB covers every logical block size in use
IO_MODES = ("direct", "buffered")
BACKENDS = ("auto", "c", "python")
MAX_QUEUE_DEPTH = 1024

try:
    from engram.store import _pread_pool
except ImportError as _e:  # built without a compiler: the Python reader takes over (warned at first use)
    _pread_pool = None
    _IMPORT_ERROR: str | None = str(_e)
else:
    _IMPORT_ERROR = None

SWITCH = FastPathSwitch(
    "reader backend", "reader", BACKENDS, fast="c", available=lambda: _pread_pool is not None,
    missing=f"the C reader engram.store._pread_pool is not built: {_IMPORT_ERROR}",
    fallback_warning=f"engram: the C disk reader is not built ({_IMPORT_ERROR}); using the slower pure-Python "
                     "thread-pool reader (reinstall with a C compiler to build csrc/pread_pool.c)")
_pools: dict[tuple[str, int], object] = {}  # (backend, queue depth) -> pool shared by every reader
# O_DIRECT reads go through Linux AIO (csrc/aio_reader.c: one io_submit per batch, no thread woken per read)
# where the kernel gives a context; buffered reads always use the pool: AIO reads the page cache synchronously.
_aio_local = threading.local()
_aio_broken = False  # io_setup failed once: the pool reads O_DIRECT too
_pools_pid = os.getpid()
_pools_lock = threading.Lock()


_read_start = threading.local()  # per thread: the hook ``on_read_start`` set

DECODE, PROMPT = 0, 1  # read priorities: a step's own reads, then reads ahead of a prompt's prefill (prefetch)
_priority = threading.local()  # per thread: the priority ``read_priority`` set (DECODE unless set)


@contextlib.contextmanager
def read_priority(level: int):
    """``PageReader.read`` calls on this thread inside run at ``level`` (DECODE or PROMPT): the C pool serves every
    queued DECODE read before a PROMPT one, and PROMPT reads claim no new page while a DECODE read is in flight."""
    if level not in (DECODE, PROMPT):
        raise ValueError(f"read priority {level!r}: must be reader.DECODE or reader.PROMPT")
    before = current_priority()
    _priority.level = level
    try:
        yield
    finally:
        _priority.level = before


def current_priority() -> int:
    return getattr(_priority, "level", DECODE)


def with_priority(level: int, fn: Callable) -> Callable:
    """``fn`` run under ``read_priority(level)`` (for reads handed to another thread)."""
    def run(*args, **kwargs):
        with read_priority(level):
            return fn(*args, **kwargs)
    return run


def on_read_start(hook: Callable[[], None] | None) -> Callable[[], None] | None:
    """Call ``hook()`` here before each ``PageReader.read`` hands its pages to the pool (None stops) -> the old hook."""
    before = getattr(_read_start, "hook", None)
    _read_start.hook = hook
    return before


class DiskReadError(OSError):
    """A page read failed: ``path``, byte ``offset``, ``errno`` (0 for a short or stale read)."""

    def __init__(self, path: str, offset: int, err: int, detail: str):
        message = f"{path}: read at byte offset {offset} failed: {detail}"
        if err:
            super().__init__(err, message)
        else:
            super().__init__(message)
            self.errno = 0
        self.path, self.offset = path, offset


@dataclass(frozen=True)
class Fault:
    """An injected failure of block ``index`` of one read: errno ``err`` != 0, else a short read of ``got``."""

    index: int  # which block of the read fails
    err: int = errno_mod.EIO  # errno to report; 0 means a short read
    got: int = 0  # bytes the short read returned (< block size)


def set_backend(name: str) -> str:
    """Choose "auto" (C when built), "c" (required) or "python"; returns the previous choice."""
    return SWITCH.set(name)


def active_backend() -> str:
    """The backend reads use now: "c" or "python"."""
    return SWITCH.active()


def c_available() -> bool:
    """Whether the C extension engram.store._pread_pool was built (whatever the backend choice)."""
    return _pread_pool is not None


class _PythonPool:
    """Same contract as the C Pool: ``threads`` workers each claim blocks from a shared counter."""

    def __init__(self, threads: int):
        self.threads = threads
        self._ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-pread")

    def read(self, fd: int, offsets: np.ndarray, size: int, out, inject_index: int = -1,
             inject_errno: int = 0, inject_got: int = 0, priority: int = DECODE):
        """``priority`` is accepted and not acted on: this fallback serves its callers in one FIFO."""
        n = len(offsets)
        if n == 0:
            return None
        mv = memoryview(out).cast("B")
        offs = offsets.tolist()
        counter = itertools.count()  # next() is atomic under the GIL
        failed: list[tuple[int, int, int]] = []

        def work() -> None:
            for i in iter(counter.__next__, None):
                if i >= n:
                    return
                if failed:
                    continue
                if i == inject_index:
                    failed.append((i, inject_errno, 0 if inject_errno else min(inject_got, size - 1)))
                    continue
                have, dst = 0, mv[i * size:(i + 1) * size]
                while have < size:
                    try:
                        r = os.preadv(fd, [dst[have:]], offs[i] + have)
                    except OSError as e:
                        failed.append((i, e.errno or errno_mod.EIO, have))
                        break
                    if r == 0:
                        failed.append((i, 0, have))
                        break
                    have += r

        for f in [self._ex.submit(work) for _ in range(min(self.threads, n))]:
            f.result()
        return min(failed) if failed else None

    def close(self) -> None:
        self._ex.shutdown(wait=True)


def _aio(queue_depth: int):
    """This thread's Linux AIO context of ``queue_depth`` slots, or None where the kernel refuses one (one per thread: a
    context hands completions to whoever waits)."""
    global _aio_broken
    per = getattr(_aio_local, "by_depth", None)
    if per is None or _aio_local.pid != os.getpid():  # a forked child builds its own
        per = _aio_local.by_depth = {}
        _aio_local.pid = os.getpid()
    ctx = per.get(queue_depth)
    if ctx is None and not _aio_broken:
        try:
            ctx = per[queue_depth] = _pread_pool.Aio(queue_depth)
        except OSError as e:
            _aio_broken = True
            warnings.warn(f"engram: Linux AIO is unavailable ({e}); O_DIRECT reads go through the thread pool",
                          RuntimeWarning, stacklevel=3)
    return ctx


def queue_per_thread(io: str) -> bool:
    """Whether each thread keeps its own ``queue_depth`` in flight with ``io`` (C backend, "direct": AIO per thread)."""
    return io == "direct" and not _aio_broken and SWITCH.active() == "c"


def _pool(queue_depth: int, io: str = "buffered", priority: int = DECODE):
    """This thread's AIO context (C backend, io="direct", decode priority), else the process-wide pool (rebuilt after
    a fork): prompt-priority reads always take the pool, whose queues let decode reads go first."""
    global _pools_pid
    kind = "c" if SWITCH.use_fast(stacklevel=2) else "python"  # the first fallback under "auto" warns
    if queue_per_thread(io) and priority == DECODE:
        ctx = _aio(queue_depth)
        if ctx is not None:
            return ctx
    with _pools_lock:
        if os.getpid() != _pools_pid:
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get((kind, queue_depth))
        if pool is None:
            pool = _pread_pool.Pool(queue_depth) if kind == "c" else _PythonPool(queue_depth)
            _pools[(kind, queue_depth)] = pool
        return pool


def aligned_pages(n: int, pin: bool = False) -> torch.Tensor:
    """A page-aligned uint8 buffer [n, PAGE] (O_DIRECT), pinned with ``pin`` (needs CUDA)."""
    raw = torch.empty(n * PAGE + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + n * PAGE].view(n, PAGE)  # keeps `raw` alive through the view's storage


def _file_bytes(fd: int) -> int | str:
    """The size of the open file now (a short read means it shrank since it was opened)."""
    try:
        return os.fstat(fd).st_size
    except OSError as e:
        return f"unknown ({e.strerror})"


class PageReader:
    """Reads whole pages of one file through a shared queue_depth-wide pool; ``fault_hook(offsets)`` lets tests inject
    faults. A read after ``path`` was replaced raises, and the reader reopens the new file."""

    def __init__(self, path: str | os.PathLike, io: str = "direct", queue_depth: int = 64,
                 prompt_queue_depth: int = 0):
        if io not in IO_MODES:
            raise ValueError(f"io={io!r}: must be one of {IO_MODES}")
        for name, depth, lo in (("queue_depth", queue_depth, 1), ("prompt_queue_depth", prompt_queue_depth, 0)):
            if not lo <= depth <= MAX_QUEUE_DEPTH:
                raise ValueError(f"{name}={depth}: must be in [{lo}, {MAX_QUEUE_DEPTH}]")
        self.path = os.fspath(path)
        self.io_requested = io
        self.queue_depth = queue_depth
        self.prompt_queue_depth = prompt_queue_depth or queue_depth  # preads in flight of a PROMPT-priority read
        self.fault_hook: Callable[[np.ndarray], Fault | None] | None = None
        self._lock = threading.Lock()
        self._fd = -1
        self._retired: list[int] = []  # fds of replaced files, closed by close()
        self._open()

    @property
    def io(self) -> str:
        """The mode in effect: "buffered" when O_DIRECT was asked for but the file system refused it."""
        return self._io

    @property
    def size(self) -> int:
        return self._size

    def _open(self) -> None:
        self._io = self.io_requested
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if self._io == "direct":
            try:
                fd = os.open(self.path, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno_mod.EINVAL:
                    raise
                warnings.warn(f"engram: {self.path}: the file system refuses O_DIRECT; reading through "
                              "the page cache instead (io='buffered')", RuntimeWarning, stacklevel=3)
                self._io = "buffered"
                fd = os.open(self.path, flags)
        else:
            fd = os.open(self.path, flags)
        if self._io == "buffered" and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: lookups are random pages
        st = os.fstat(fd)
        if self._fd >= 0:  # a read in flight may still use the old fd: close it with the reader
            self._retired.append(self._fd)
        self._fd = fd
        self._ident, self._size = (st.st_dev, st.st_ino), st.st_size

    def _check_same_file(self, first_offset: int) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise DiskReadError(self.path, first_offset, e.errno or 0, f"file is gone ({e.strerror})") from e
        if (st.st_dev, st.st_ino) != self._ident:
            old = self._ident[1]
            self._open()
            raise DiskReadError(self.path, first_offset, 0,
                                f"file was replaced under the reader (inode {old} -> {self._ident[1]}); "
                                "this lookup is dropped, the next one reads the new file")

    def drop_cache(self) -> None:
        """Evict this file's pages from the page cache (benchmarks of cold buffered reads)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read(self, offsets: np.ndarray, out: torch.Tensor, size: int = PAGE, crcs: np.ndarray | None = None,
             crc_page: int = PAGE) -> None:
        """Read ``size`` bytes at each of ``offsets`` (int64 [n]) into ``out`` (uint8, n*size); ``crcs`` (uint32)
        receives each ``crc_page``'s CRC32C, computed by the reading thread."""
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        n = len(offsets)
        if n == 0:
            return
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < n * size:
            raise ValueError(f"out must be a contiguous uint8 tensor of >= {n * size} bytes, got "
                             f"{out.dtype} {tuple(out.shape)}")
        if self._io == "direct" and (out.data_ptr() % PAGE or size % PAGE or (offsets % PAGE).any()):
            raise ValueError(f"{self.path}: io='direct' needs page-aligned buffers, sizes and offsets "
                             f"(buffer at {out.data_ptr():#x}, size {size}); use aligned_pages()")
        fault = self.fault_hook(offsets) if self.fault_hook is not None else None
        with self._lock:  # a reopen swaps the fd; reads themselves run concurrently
            self._check_same_file(int(offsets[0]))
            fd = self._fd
        priority = current_priority()
        pool = _pool(self.queue_depth if priority == DECODE else self.prompt_queue_depth, self._io, priority)
        buf = out.numpy()
        kw = {"priority": priority}
        if fault is not None:
            kw.update(inject_index=fault.index, inject_errno=fault.err, inject_got=fault.got)
        in_pool = crcs is not None and isinstance(pool, (_pread_pool.Pool, _pread_pool.Aio) if _pread_pool else ())
        if crcs is not None:
            if crc_page < 1 or size % crc_page or crcs.dtype != np.uint32 or len(crcs) < n * (size // crc_page):
                raise ValueError(f"crcs must be uint32 with >= {n * max(1, size // max(1, crc_page))} entries and "
                                 f"crc_page={crc_page} must divide size={size}")
            if in_pool:
                kw.update(crc_out=crcs, crc_page=crc_page)
        hook = getattr(_read_start, "hook", None)
        if hook is not None:
            hook()
        res = pool.read(fd, offsets, size, buf, **kw)
        if res is not None:
            i, err, got = res
            detail = (f"[Errno {err}] {os.strerror(err)}" if err else
                      f"short read: {got} of {size} bytes (file is {_file_bytes(fd)} bytes now)")
            raise DiskReadError(self.path, int(offsets[i]), err, detail)
        if crcs is not None and not in_pool:  # the Python pool: checksummed here, after the reads
            crcs[: n * (size // crc_page)] = crc32c_pages(buf.reshape(-1)[: n * size], crc_page)

    def close(self) -> None:
        for fd in self._retired + [self._fd]:
            if fd >= 0:
                os.close(fd)
        self._retired, self._fd = [], -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
