"""Disk tier: value rows stay in ``values.bin`` and are read on demand; scales and page CRCs stay in RAM (with
``shared_memory``, the node's one copy: store/shared_host.py).

A lookup dedupes its ids, reads the distinct 4 KiB pages (``PageReader``), checks each against its CRC32C (a
corrupt page raises CorruptPageError naming file and offset and never reaches the cache) and decodes through
the shared kernels, bitwise the gpu tier's. ``submit`` runs lookups on the table's thread (at most
``max_inflight``); slab reads for decode graphs are its ``SlabReader`` (disk_slabs.py)::

    values.bin  |<- page p (4096 B) ->|      row r lives in page r // (4096 // stride), slot r % (4096 // stride)
                | r0 | r1 | ... | r15 |      (V4.1: 256-B rows, 16 per page: a cold row costs a whole page)"""
from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from engram.store import kernels
from engram.store.base import TableBackend, Tier
from engram.store.disk_lookup import DiskLookup, InflightLimitError
from engram.store.format import TableManifest, read_manifest
from engram.store.load import load_file
from engram.store.options import StoreOptions
from engram.store import slab_plan
from engram.store.page_checker import PageChecker
from engram.store.page_crc import CorruptPageError, page_error
from engram.store.disk_slabs import SlabReader, check_fits, uva_decodes
from engram.store.page_slabs import PageSlab, SlabPool
from engram.store import reader
from engram.store.reader import PAGE, PageReader, aligned_pages
from engram.store.scrub import Scrubber
from engram.store.shared_host import shared_target
from engram.store.kernels import uva


class DiskTable(TableBackend):
    """One table served from its files (resident: scales and page CRCs, ``resident_bytes``, plus the cache);
    ``background_verify`` starts a ``Scrubber``. Slab reads (``new_slab``, ``read_slab``, ``decode_slab``,
    ``admit_probed``) go to ``slab_reader``."""

    tier = Tier.DISK
    reads_from_disk = True

    def __init__(self, manifest: TableManifest, device: str | torch.device = "cpu", cache: Any = None,
                 options: StoreOptions | None = None):
        super().__init__(manifest, device, cache, options)
        self.stride = manifest.row_stride
        self.page = manifest.page_size
        if self.page % PAGE:
            raise ValueError(f"{manifest.path}: page_size={self.page} is not a multiple of the reader's {PAGE}")
        # resident copies in RAM, or (shared_memory) the node's one copy that every process opening the table maps
        resident = shared_target(manifest, self.options.advanced.shm_dir) if self.options.shared_memory else "ram"
        verify = self.options.advanced.verify
        self.pages = PageChecker(manifest, verify, resident)  # page CRCs, resident (refuses format 1)
        self.reader = PageReader(manifest.values_path, io=self.options.io, queue_depth=self.options.queue_depth,
                                 prompt_queue_depth=self.options.advanced.prompt_queue_depth)
        # uint8 [rows, scale_cols] resident (CRC-checked while read, like the gpu/host tiers' loads), or None
        self.scales = (load_file(manifest, "scales", resident, verify).view(self.rows, self.scale_cols)
                       if "scales" in manifest.files else None)
        self._scales_np = self.scales.numpy() if self.scales is not None else None
        # one-read lookups (_gather_direct): pinned on CUDA, where the decode kernel reads them over UVA
        self._slabs = (SlabPool(self.page, self.stride, self.scale_cols, pinned=self.device.type == "cuda")
                       if self.stride <= self.page else None)
        self.slab_reader = SlabReader(self._slabs, self.cache, self._cache_mutex, self.stride, self.device,
                                      manifest.path, self._read_into, self._fetch, self._decode_slab, self._count)
        self._extra = {"disk_rows": 0, "inflight": 0, "inflight_bytes": 0, "corrupt_pages": 0}
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-disk")  # submit()
        self._io = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="engram-disk-io")  # 2 chunks queued
        self.scrubber = (Scrubber(self.reader, self.pages, self._count_corrupt)
                         if self.options.advanced.background_verify else None)

    @classmethod
    def open(cls, directory: str | os.PathLike, **kwargs: Any) -> "DiskTable":
        """Open a table directory on the disk tier (``kwargs``: device, cache, options)."""
        return cls(read_manifest(directory), **kwargs)

    @property
    def resident_bytes(self) -> int:
        """RAM this tier keeps for the table: the scales and the page CRCs (the memory preflight counts them)."""
        return (0 if self.scales is None else self.scales.numel()) + self.pages.nbytes

    def _count_corrupt(self, pages: int) -> None:
        with self._lock:
            self._extra["corrupt_pages"] += pages

    def _check_pages(self, offsets: np.ndarray, buf: torch.Tensor, size: int, crcs: np.ndarray | None = None) -> None:
        """The pages of one read against their CRC32Cs (``crcs``: the reader's); a corrupt one is counted and raises."""
        try:
            self.pages.check(offsets, buf, size, crcs)
        except CorruptPageError as e:
            self._count_corrupt(e.bad_pages)
            raise

    def check_ids(self, ids: torch.Tensor | Any) -> torch.Tensor:
        """As TableBackend.check_ids after moving GPU ids to the CPU, where reads are planned: every id is checked."""
        if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
            ids = ids.cpu()
        return super().check_ids(ids)

    # ----------------------------------------------------------------- slab reads (disk_slabs.py)
    @property
    def slab_reads(self) -> bool:
        """Whether this table reads into slabs (rows of at most a page: ``new_slab`` works)."""
        return self.slab_reader.enabled

    def new_slab(self, rows: int, probe: bool = True) -> PageSlab:
        """``SlabReader.new_slab``: a caller-owned slab for lookups of up to ``rows`` ids."""
        return self.slab_reader.new_slab(rows, probe)

    def read_slab(self, ids: torch.Tensor | Any, slab: PageSlab, plan: int | None = None) -> None:
        """``SlabReader.read_slab`` of the checked ``ids``: rows into ``slab``, not decoded."""
        return self.slab_reader.read_slab(self.check_ids(ids), slab, plan)

    def decode_slab(self, slab: PageSlab, n: int, out: torch.Tensor, ids: torch.Tensor | None = None,
                    plan: torch.Tensor | None = None, status: torch.Tensor | None = None) -> torch.Tensor:
        """``SlabReader.decode_slab``: the first ``n`` slots of ``slab`` dequantized into ``out`` [n, dim]."""
        return self.slab_reader.decode_slab(slab, n, out, ids, plan, status)

    def admit_probed(self, slab: PageSlab) -> int:
        """``SlabReader.admit_probed``: end the slab's last probed lookup -> the rows it read from disk."""
        return self.slab_reader.admit_probed(slab)

    # ----------------------------------------------------------------- the backing-store read
    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows [N, dim]; on the CPU without a cache, each chunk is decoded while the next chunk's pages are read."""
        return self._gather_checked(self.check_ids(ids), out, dtype)

    def _gather_checked(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``gather`` of ids that ``check_ids`` returned (``submit`` checks them once, on the caller's thread)."""
        n = ids.numel()
        self._check_out(out, n, dtype)
        if 0 < n <= self.options.advanced.chunk_pages and self.cache is None and self._slabs is not None:
            return self._gather_direct(ids, out, dtype)
        if self.cache is not None:
            self.slab_reader.late.settle()  # rows of a probed lookup not yet cached go in first
        if self.cache is not None or self.device.type != "cpu" or n == 0:
            return self._gather_deduped(ids, out, dtype)
        uniq, inverse = self._dedupe(ids)  # [U], [N]
        rows = torch.empty(uniq.numel(), self.dim, dtype=dtype)  # [U, dim], filled chunk by chunk

        def decode(r0: int, r1: int, vals: torch.Tensor, scales: torch.Tensor | None) -> None:
            kernels.gather_rows(vals, scales, torch.arange(r1 - r0), self.row_dtype, self.dim, out=rows[r0:r1],
                                dtype=dtype)

        self._fetch(uniq, on_rows=decode)
        return torch.index_select(rows, 0, inverse, out=out) if out is not None else rows.index_select(0, inverse)

    def _gather_direct(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """A lookup of at most ``chunk_pages`` ids: one read of its pages into a reused slab, checked, scales placed,
        and one gather decodes every id into [N, dim] (on CUDA over UVA from the pinned slab)."""
        ids_np = ids.numpy()
        n = len(ids_np)
        slab = self._slabs.acquire(n, n)
        try:
            n_pages = self._read_into(ids_np, slab)
            rows_used = n_pages * self._slabs.rows_per_page
            scales = slab.scales[:rows_used] if slab.scales is not None else None
            values = slab.data.view(-1, self.stride)[:rows_used]  # [P * rows_per_page, stride]
            return self._decode_slab(values, scales, slab.slots[:n], slab.pinned, out, dtype)
        finally:  # on CUDA the slab is reused only once the work queued on this stream has run
            self._slabs.release(slab, torch.cuda.current_stream(self.device) if slab.pinned else None)

    def _read_into(self, ids_np: np.ndarray, slab: PageSlab, count: bool = True) -> int:
        """A one-read lookup's host part: plan, read, check (before any decode), place scales; counts the lookup unless
        ``count`` is False -> the pages read."""
        n = len(ids_np)
        n_pages, n_unique = slab_plan.plan(ids_np, self._slabs.rows_per_page, self.page, slab)
        if count:
            self._count(lookups=1, rows=n, unique_rows=n_unique)
        offsets = slab.offsets[:n_pages]
        self.reader.read(offsets, slab.data, self.page, slab.crcs, self.page)
        n_bad, first_bad = slab_plan.check(slab, n_pages, n_unique, self.page, self.pages.crcs, self._scales_np)
        if n_bad:
            self._count_corrupt(n_bad)
            p = int(offsets[first_bad]) // self.page
            err = page_error(self.pages.path, p, self.page, int(self.pages.crcs[p]), int(slab.crcs[first_bad]))
            err.bad_pages = n_bad
            raise err
        self._count(read_ops=n_pages, bytes_read=n_pages * self.page)
        with self._lock:
            self._extra["disk_rows"] += n_unique
        return n_pages

    def _decode_slab(self, values: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, pinned: bool,
                     out: torch.Tensor | None, dtype: torch.dtype, runs: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``slots`` of a slab -> [N, dim] on ``self.device`` (UVA kernel from a pinned slab, else
        ``gather_rows``); with ``runs`` only positions with runs[i] == i are written. Keep the slab until it ran."""
        if out is None and self.device.type != "cpu":
            out = torch.empty(slots.numel(), self.dim, dtype=dtype, device=self.device)
        if uva_decodes(pinned) and (runs is None or slots.is_cuda):
            from engram.store.kernels import triton_gather
            return triton_gather.gather_rows(values, scales, slots, self.row_dtype, self.dim, out=out, dtype=dtype,
                                             cfg=uva.UVA_CONFIG, ids_pinned=runs is None, runs=runs)
        if runs is not None:  # the reference of runs: the positions that are their own run
            keep = torch.nonzero(runs == torch.arange(len(runs), device=runs.device)).reshape(-1)
            out[keep] = kernels.gather_rows(values, scales, slots[keep], self.row_dtype, self.dim, dtype=dtype).to(
                out.device)
            return out
        return kernels.gather_rows(values, scales, slots, self.row_dtype, self.dim, out=out, dtype=dtype)

    def _plan(self, ids: torch.Tensor) -> tuple[list[tuple[np.ndarray, int, int, torch.Tensor | None]], int, int]:
        """Read plan for unique ascending ``ids``: chunks of (file offsets [k], first row, end row, buffer slots |
        None), read size, buffer pages."""
        chunk = self.options.advanced.chunk_pages
        m = ids.numel()
        if self.stride <= self.page:  # numpy: a lookup plans a few dozen to a few thousand rows
            per_page = self.page // self.stride
            ids_np = ids.numpy()
            page_of_row = ids_np // per_page  # [M], ascending
            first = np.empty(m, dtype=bool)  # the first row of each distinct page
            first[:1] = True
            np.not_equal(page_of_row[1:], page_of_row[:-1], out=first[1:])
            row_page = np.cumsum(first) - 1  # [M]: which of the read pages holds each row
            pages = page_of_row[first]  # [P]
            n = len(pages)
            # slot of each row inside its chunk's buffer [chunk * per_page, stride] (ids sorted: chunks hold
            # contiguous row ranges)
            slot = torch.from_numpy((row_page % chunk) * per_page + ids_np % per_page)  # [M] int64
            bounds = np.searchsorted(row_page, np.arange(0, n + chunk, chunk)).tolist()
            offsets = pages * self.page
            plan = [(offsets[a:a + chunk], bounds[k], bounds[k + 1], slot[bounds[k]:bounds[k + 1]])
                    for k, a in enumerate(range(0, n, chunk))]
            return plan, self.page, min(n, chunk) * (self.page // PAGE)
        per_chunk = max(1, chunk * self.page // self.stride)  # rows over a page: one read of stride B per row
        offsets = (ids * self.stride).numpy()
        plan = [(offsets[a:a + per_chunk], a, min(m, a + per_chunk), None) for a in range(0, m, per_chunk)]
        return plan, self.stride, min(m, per_chunk) * (self.stride // PAGE)

    def _fetch(self, ids: torch.Tensor, on_rows: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids int64 [M] unique ascending -> (values uint8 [M, stride], scales | None), ``chunk_pages`` at a time into
        two alternating buffers: while chunk k+1 is read, chunk k's rows go to ``on_rows(r0, r1, vals, scales)``."""
        plan, size, buf_pages = self._plan(ids)
        vals = torch.empty(ids.numel(), self.stride, dtype=torch.uint8)  # [M, stride]
        scales = self.scales.index_select(0, ids) if self.scales is not None else None  # [M, scale_cols]
        bufs = [aligned_pages(buf_pages) for _ in range(min(2, len(plan)))]
        crcs = [np.empty(buf_pages * PAGE // self.page, dtype=np.uint32) for _ in bufs]  # each page's CRC32C, read
        pending: dict[int, cf.Future] = {}
        read = reader.with_priority(reader.current_priority(), self.reader.read)  # the caller's, on the I/O thread

        def start(k: int) -> None:  # chunk k reads into bufs[k % 2] on an I/O thread
            pending[k] = self._io.submit(read, plan[k][0], bufs[k % 2], size, crcs[k % 2], self.page)

        # prompt-priority reads (prefetch) stay on the caller's thread: the I/O threads are the step reads'
        pipelined = len(plan) > 1 and reader.current_priority() == reader.DECODE
        try:
            if pipelined:
                start(0)
                start(1)  # two jobs queued in the pread pool: its threads go from one to the next undrained
            for k, (offsets, r0, r1, slot) in enumerate(plan):
                buf = bufs[k % 2]
                fut = pending.pop(k, None)
                if fut is not None:
                    fut.result()  # chunk k is in buf (or its read error is raised here)
                else:  # a single chunk: read it on this thread
                    self.reader.read(offsets, buf, size, crcs[k % 2], self.page)
                self._check_pages(offsets, buf, size, crcs[k % 2])  # before any row is cut out of these pages
                src = buf.view(-1, self.stride)  # [buffer rows, stride]
                if slot is not None:
                    torch.index_select(src, 0, slot, out=vals[r0:r1])  # memcpy per row
                else:
                    vals[r0:r1] = src[: r1 - r0]
                if pipelined and k + 2 < len(plan):
                    start(k + 2)  # buf is free again
                if on_rows is not None:
                    on_rows(r0, r1, vals[r0:r1], scales[r0:r1] if scales is not None else None)
        finally:
            cf.wait(list(pending.values()))  # never leave while a read still writes into bufs
        n_reads = sum(len(p[0]) for p in plan)
        self._count(read_ops=n_reads, bytes_read=n_reads * size)
        with self._lock:
            self._extra["disk_rows"] += ids.numel()
        return vals, scales  # host memory: the caller moves them to self.device

    # ----------------------------------------------------------------- bounded prefetch
    def submit(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               into: PageSlab | None = None, plan: int | None = None) -> DiskLookup:
        """Start a lookup on the worker thread (InflightLimitError past ``max_inflight``); ``into``: read into that slab
        (``read_slab``, signalling ``plan``), ``wait`` then returns None."""
        ids = self.check_ids(ids)
        if into is not None:
            check_fits(ids, into)
        nbytes = 0 if into is not None else ids.numel() * self.dim * dtype.itemsize
        with self._lock:
            if self._extra["inflight"] >= self.options.advanced.max_inflight:
                raise InflightLimitError(
                    f"{self.manifest.path}: {self._extra['inflight']} lookups are already in flight "
                    f"(max_inflight={self.options.advanced.max_inflight}); wait() or cancel() one before submitting "
                    "more")
            self._extra["inflight"] += 1
            self._extra["inflight_bytes"] += nbytes
        try:
            future = self._pool.submit(self._lookup, ids, dtype, into, plan)
        except RuntimeError:  # executor shut down by close()
            self._release_slot(nbytes)
            raise RuntimeError(f"table {self.manifest.path} is closed") from None
        return DiskLookup(self, future, nbytes)

    def _lookup(self, ids: torch.Tensor, dtype: torch.dtype, into: PageSlab | None = None,
                plan: int | None = None) -> tuple[torch.Tensor | None, "torch.cuda.Event | None"]:
        """A submitted lookup on the table's thread -> the rows and, on CUDA, an event after the work that made them;
        with ``into``, (None, None) once in the slab ((None, event) with a cache on CUDA)."""
        if into is not None:
            self.slab_reader.read_owned(ids, into, plan)
            if self.cache is None or self.device.type != "cuda" or (into.probe is not None and plan is not None):
                return None, None
            ready = torch.cuda.Event()  # after the cache's inserts, which the slab's slots may point at
            ready.record(torch.cuda.current_stream(self.device))
            return None, ready
        rows = self._gather_checked(ids, None, dtype)
        if rows.device.type != "cuda":
            return rows, None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(rows.device))
        return rows, ready

    def _release_slot(self, nbytes: int) -> None:
        with self._lock:
            self._extra["inflight"] -= 1
            self._extra["inflight_bytes"] -= nbytes

    def file_layout(self) -> dict[str, Any]:
        """values.bin and how rows sit in it (row r at byte r * row_stride, read in page_size pages), the reader's io
        and depth, and the hot-row cache's capacity in rows (0: none) and policy: what a replay of lookups needs."""
        return {"values": str(self.manifest.values_path), "rows": self.rows, "row_stride": self.stride,
                "page_size": self.page, "io": self.reader.io, "io_requested": self.reader.io_requested,
                "queue_depth": self.reader.queue_depth, "queue_per_thread": reader.queue_per_thread(self.reader.io),
                "cache_rows": self.cache.capacity if self.cache is not None else 0,
                "cache_policy": self.options.cache_policy}

    # ----------------------------------------------------------------- stats and lifetime
    def stats(self) -> dict[str, Any]:
        """Base counters plus disk_rows, page_amplification, inflight, inflight_bytes, io, corrupt_pages and, with
        background_verify, verify_state and verified_pages."""
        out = super().stats()
        with self._lock:
            out.update(self._extra)
        if self.scrubber is not None:
            out.update(self.scrubber.status())
        useful = out["disk_rows"] * self.value_bytes
        out["page_amplification"] = out["bytes_read"] / useful if useful else 0.0
        out["io"] = self.reader.io
        return out

    def reset_stats(self) -> None:
        super().reset_stats()
        with self._lock:
            self._extra["disk_rows"] = self._extra["corrupt_pages"] = 0

    def close(self) -> None:
        if self._closed:
            return
        if self.scrubber is not None:
            self.scrubber.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True)
        self.slab_reader.close()
        super().close()
        self.reader.close()


def open_disk_table(directory: str | Path, device: str | torch.device = "cpu", cache: Any = None,
                    **options: Any) -> DiskTable:
    """A DiskTable without ``open_table``'s placement checks (tests, benches); ``options``: StoreOptions fields."""
    return DiskTable.open(directory, device=device, cache=cache, options=StoreOptions().replace(**options))
