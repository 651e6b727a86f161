"""A disk table's slabs owned by a caller (a decode graph keeps one per Engram layer): a step's lookup only reads the
rows' pages into the slab (``read_slab``) and the graph's piece decodes them (``decode_slab``). Over a hot-row cache the
slots index the cache's storage, and a probed slab lets the piece find its rows itself (store/kernels/cache_probe.py);
``admit_probed`` caches what the lookup read once no piece waits. ``SlabReader`` is a component ``DiskTable`` (disk.py)
builds and holds: it gets the table's slab pool, cache, cache mutex and page reads through its constructor, and owns the
late caching of probed rows and the cache stream."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from engram.store import kernels
from engram.store.kernels import cache_probe
from engram.store.late_caching import LateCaching, TakenRows
from engram.store.page_slabs import PageSlab, SlabPool, SlotProbe
from engram.transfer import to_device
from engram.store.kernels import uva as uva_kernels


class SlabReader:
    """One disk table's reads into a caller's slab, and their decode. ``pool``: the table's slabs (None when rows span
    pages: no slab reads); ``cache`` / ``cache_mutex``: its hot-row cache (or None) and the lock of every cache use;
    ``read_into(ids_np, slab, count=)``: the table's one-read lookup into a slab (-> pages read); ``fetch``: its backing
    read for cache misses; ``decode(values, scales, slots, pinned, out, dtype, runs=)``: its slab decode; ``count``:
    its lookup counters; ``path`` names the table in errors. ``late``: the rows of probed lookups cached late (the table
    settles it before any other use of the cache)."""

    def __init__(self, pool: SlabPool | None, cache: Any, cache_mutex: Any, stride: int, device: torch.device,
                 path: Path, read_into: Callable[..., int], fetch: Callable, decode: Callable[..., torch.Tensor],
                 count: Callable[..., None]):
        self._slabs, self.cache, self._cache_mutex = pool, cache, cache_mutex
        self.stride, self.device, self._path = stride, device, path
        self._read_into, self._fetch, self._decode_slab, self._count = read_into, fetch, decode, count
        self._cache_stream: "torch.cuda.Stream | None" = None  # a probed slab's cache work (_probe_stream)
        self.late = LateCaching(self._cache_taken, device)  # a probed slab's rows cached late (DEFER)

    def close(self) -> None:
        """Settle and stop the late caching, then drop the cache (as the table's close does)."""
        self.late.close()
        self.cache = None

    @property
    def enabled(self) -> bool:
        """Whether the table reads into slabs (rows of at most a page: ``new_slab`` works)."""
        return self._slabs is not None

    def new_slab(self, rows: int, probe: bool = True) -> PageSlab:
        """A caller-owned slab for lookups of up to ``rows`` ids: pinned on CUDA, zero-filled, every slot row 0. With a
        hot-row cache its slots index the cache's storage and, unless ``probe`` is False, it gets a ``SlotProbe`` (the
        cache's tags mirrored on its device from now on)."""
        if self._slabs is None:
            raise ValueError(f"{self._path}: rows of {self.stride} B span pages; no slab reads")
        if self.cache is not None:
            self.cache.reserve_overflow(rows)
        slab = self._slabs.new(rows, rows)
        slab.data.zero_()
        slab.slots.zero_()
        if slab.scales is not None:
            slab.scales.zero_()
        if self.cache is not None and probe:
            self.cache.mirror_tags()
            pin = self.cache.device.type == "cuda"
            plan = torch.zeros(3, rows, dtype=torch.int64, pin_memory=pin)
            plan[cache_probe.RUNS] = -1
            slab.probe = SlotProbe(torch.zeros(3, rows, dtype=torch.int64, device=self.cache.device), plan,
                                   torch.full((1,), -1, dtype=torch.int64, pin_memory=pin))
        return slab

    def read_slab(self, ids: torch.Tensor, slab: PageSlab, plan: int | None = None) -> None:
        """Read rows ``ids`` (as the table's ``check_ids`` returns them) into ``slab`` without decoding them
        (``decode_slab`` does), after the device work that last read it (``slab.done``); ValueError unless they fit.
        With a cache the rows go through it; with a probe and the step's ``plan`` id the lookup only writes the plan
        into the probe and signals it (``_read_probed``)."""
        check_fits(ids, slab)
        self.read_owned(ids, slab, plan)

    def read_owned(self, ids: torch.Tensor, slab: PageSlab, plan: int | None = None) -> None:
        """``read_slab`` of checked ids that fit: after the device work that last read the slab."""
        if not slab.ready():
            slab.done.synchronize()
        if self.cache is None:
            self._read_into(ids.numpy(), slab)
            return
        if slab.probe is not None and plan is not None:
            self._read_probed(ids.numpy(), slab, plan)
            return
        ids_np = ids.numpy()  # numpy from here: a few dozen ids a step, microseconds a call (cache.py)
        uniq, inverse = np.unique(ids_np, return_inverse=True)  # [U], [N]
        self._count(lookups=1, rows=len(ids_np), unique_rows=len(uniq))
        self.late.settle()  # rows of a probed lookup not yet cached go in first
        with self._cache_mutex:
            where = self.cache.slots_np(uniq, self._fetch)  # [U]
        np.take(where, inverse, out=slab.slots.numpy()[:len(ids_np)])

    def _read_probed(self, ids_np: np.ndarray, slab: PageSlab, plan: int) -> None:
        """A probed slab's lookup, host work only (cache_probe: deadlock freedom): bookkeeping of the hits, the misses'
        pages read into the slab, the plan (cache slot, slab row, run per position) and the flag written into the
        probe's pinned memory; the rows read are kept for ``admit_probed``."""
        probe = slab.probe
        if probe.pending is not None:  # never admitted (its step failed): counted, its rows not cached
            miss_ids, _, looked_up = probe.pending
            probe.pending = None
            with self._cache_mutex:
                self.cache.admit(miss_ids[:0], None, None, looked_up, missed=len(miss_ids))
        uniq, inverse = np.unique(ids_np, return_inverse=True)  # [U], [N]
        n, u = len(ids_np), len(uniq)
        self._count(lookups=1, rows=n, unique_rows=u)
        try:
            with self._cache_mutex:
                hit_pos, hit_slots, miss_pos = self.cache.split(uniq)
            self.late.hand_over()  # rows held from this table's last lookup: cached beside this one's reads
            slot_u, row_u = np.zeros(u, dtype=np.int64), np.full(u, -1, dtype=np.int64)
            slot_u[hit_pos] = hit_slots
            m = len(miss_pos)
            if m:
                self._read_into(uniq[miss_pos], slab, count=False)  # pages + slab.slots[:M]
                row_u[miss_pos] = slab.slots.numpy()[:m]
            host = probe.plan.numpy()
            host[cache_probe.SLOTS, :n] = slot_u[inverse]
            rows = row_u[inverse]
            host[cache_probe.ROWS, :n] = np.maximum(rows, 0)
            host[cache_probe.RUNS, :n] = np.where(rows >= 0, np.arange(n), -1)
        except BaseException:
            cache_probe.signal(probe.flag, plan, ok=False)  # a piece waiting for it fails, not hangs
            raise
        # the misses' slots in the slab's pages (pinned on CUDA: admit_probed uploads them without a copy) stay
        # until this slab's next lookup, which comes after admit_probed or drops what is pending first (above)
        probe.pending = (uniq[miss_pos], slab.slots[:m], u)
        cache_probe.signal(probe.flag, plan)

    def admit_probed(self, slab: PageSlab) -> int:
        """End the slab's last probed lookup: take the rows it read out of the slab to be cached during the table's next
        probed lookup (store/late_caching.py; the lookup before's rows first). Called by the slab's owner once no piece
        waits for its flag (DecodePieces.finish_lookups), so nothing here waits for a piece that waits for the host.
        Returns the rows that lookup read from disk (0 without one).

        On CUDA with Triton the rows go from the pinned pages to the device over UVA on the cache stream, after the
        slab's decode, and ``slab.done`` becomes that gather's event; elsewhere the host copies them out. Both give the
        cache the same bytes."""
        self.late.settle()
        pending, slab.probe.pending = slab.probe.pending, None
        if pending is None:
            return 0
        miss_ids, where, looked_up = pending
        if not len(miss_ids):  # every row was cached: only the count (no device work)
            with self._cache_mutex:
                self.cache.admit(miss_ids, None, None, looked_up)
            return 0
        self.late.hold(self._take_rows(slab, miss_ids, where, looked_up))
        return len(miss_ids)

    def _take_rows(self, slab: PageSlab, miss_ids: np.ndarray, where: torch.Tensor,
                   looked_up: int) -> TakenRows:
        """The rows ``where`` out of the slab before its next read may overwrite them: over UVA on the cache stream
        (``slab.done`` becomes the gather's event), else host copies."""
        pages = slab.data.view(-1, self.stride)  # [pages * rows_per_page, stride]
        stream = self._probe_stream(slab)
        if stream is None or not uva_decodes(slab.pinned):
            values = pages.index_select(0, where)  # [M, stride], host copies of the pages' rows
            scales = slab.scales.index_select(0, where) if slab.scales is not None else None
        else:
            with torch.cuda.stream(stream):
                if slab.done is not None:  # after the slab's decode, so the event below stands for both
                    stream.wait_event(slab.done)
                dev_where = to_device(where, self.device)
                values = uva_kernels.gather_raw(pages, dev_where, route="direct")
                scales = (uva_kernels.gather_raw(slab.scales, dev_where, route="direct")
                          if slab.scales is not None else None)
                slab.done = torch.cuda.Event()
                slab.done.record(stream)
        consumer = torch.cuda.current_stream(self.device) if stream is not None else None
        return TakenRows(miss_ids, values, scales, looked_up, stream, consumer)

    def _cache_taken(self, rows: TakenRows) -> None:
        """``rows`` into the cache, on their stream, which their consumer stream then waits for."""
        with torch.cuda.stream(rows.stream) if rows.stream is not None else contextlib.nullcontext():
            with self._cache_mutex:
                self.cache.admit(rows.miss_ids, rows.values, rows.scales, rows.looked_up, recheck=self.late.used)
        if rows.stream is not None:
            rows.consumer.wait_stream(rows.stream)

    def _probe_stream(self, slab: PageSlab) -> "torch.cuda.Stream | None":
        """The stream of a probed slab's cache work on CUDA (one per table, made on first use), else None."""
        if slab.probe is None or self.device.type != "cuda":
            return None
        if self._cache_stream is None:
            self._cache_stream = torch.cuda.Stream(self.device)
        return self._cache_stream

    def decode_slab(self, slab: PageSlab, n: int, out: torch.Tensor, ids: torch.Tensor | None = None,
                    plan: torch.Tensor | None = None, status: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``n`` slots of ``slab`` dequantized into ``out`` [n, dim] by one gather over the whole slab
        (graph-capturable; unread slots hold row 0). With a cache the slots index its storage; with ``ids`` [n] (-1
        padding), ``plan`` [1] and ``status`` int32 [1] the rows are found in the mirrored tags and the decode waits for
        the lookup's plan only on a miss (cache_probe.resolve_slots)."""
        if self.cache is None:
            values, scales = slab.data.view(-1, self.stride), slab.scales  # [pages * rows_per_page, stride]
            return self._decode_slab(values, scales, slab.slots[:n], slab.pinned, out, out.dtype)
        values, scales = self.cache.storage()  # the slots index the cache's storage (read_slab)
        if ids is None:
            return self._decode_slab(values, scales, slab.slots[:n], slab.pinned, out, out.dtype)
        where = cache_probe.resolve_slots(ids, self.cache.dev_tags, slab.probe.plan, slab.probe.flag, plan,
                                          slab.probe.resolved, status)
        self._decode_slab(values, scales, where[cache_probe.SLOTS, :n], False, out, out.dtype)
        # then the rows read this step, from the slab's pages (positions whose run is -1 are skipped)
        return self._decode_slab(slab.data.view(-1, self.stride), slab.scales, where[cache_probe.ROWS, :n],
                                 slab.pinned, out, out.dtype, runs=where[cache_probe.RUNS, :n])


def check_fits(ids: torch.Tensor, slab: PageSlab) -> None:
    """ValueError unless ``ids`` fit ``slab`` (``read_slab``, ``DiskTable.submit(into=)``)."""
    if ids.numel() > slab.rows:
        raise ValueError(f"{ids.numel()} ids do not fit a slab of {slab.rows}")


def uva_decodes(pinned: bool) -> bool:
    """Whether a slab's rows are gathered by the UVA kernel (pinned, Triton usable, backend not "torch"), for its decode
    and for the copies into a cache."""
    return pinned and kernels.get_backend() != "torch" and kernels.triton_available()
