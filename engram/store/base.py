"""The one interface every table tier implements: ``Tier``, ``TableBackend`` and ``LookupHandle``. A backend serves rows
of one table by id: ``gather`` -> dequantized rows [N, dim], ``gather_raw`` -> packed row bytes [N, row_bytes] (values
then scales), ``submit`` -> a handle, ``stats`` -> counters. CPU ids are range-checked (IndexError naming id and size);
GPU ids are trusted unless ``check_device_ids`` (ids.py). The base class holds the shared path; a tier provides
``_fetch`` and may override ``gather`` (``ResidentTable``). Tiers know nothing about models."""
from __future__ import annotations

import enum
import threading
import time
from typing import Any, Callable

import torch

from engram.store import kernels
from engram.store.format import TableManifest
from engram.store.ids import as_ids, check_range
from engram.store.load import load_table
from engram.store.options import StoreOptions
from engram.transfer import to_device

STAT_KEYS = ("lookups", "rows", "unique_rows", "hits", "misses", "evictions", "bytes_read", "read_ops")


class Tier(str, enum.Enum):
    """Where a table's rows live: ``gpu`` device memory, ``host`` pinned host memory read over PCIe (both RAM without
    CUDA), ``disk`` the table files read on demand."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"

    @classmethod
    def parse(cls, value: "str | Tier") -> "Tier":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"tier={value!r} is not one of {[t.value for t in cls]}") from None


class LookupHandle:
    """A lookup in flight: ``wait()`` returns the rows or raises what the lookup raised (``CancelledError`` once
    cancelled), ``done()`` whether ``wait`` returns at once, ``cancel()`` drops work not yet started (-> whether)."""

    def wait(self) -> torch.Tensor:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def cancel(self) -> bool:
        raise NotImplementedError


class CompletedLookup(LookupHandle):
    """The handle of a lookup that ran synchronously inside ``submit`` (gpu and host tiers)."""

    def __init__(self, rows: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        self._rows, self._error = rows, error
        self.finished_at = time.monotonic()  # when the rows existed (engine/lookup_timing.py)

    def wait(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        return self._rows

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False  # already finished: nothing left to drop


class TableBackend:
    """Base class of the tiers (set up storage, implement ``_fetch``). ``count_unique``: resident lookups count distinct
    ids for ``unique_rows`` (a device sort per call; off by default, unique_rows then stays 0 there)."""

    tier: Tier
    host_backed = True  # the rows live host-side (RAM, pinned, disk): _fetch takes CPU ids
    # a lookup waits for disk reads (the disk tier): the engine runs the first such layer's lookup only when
    # the model reaches that layer, so the layers before it run meanwhile (engine/lookup.py)
    reads_from_disk = False

    def __init__(self, manifest: TableManifest, device: torch.device, cache: Any = None,
                 options: StoreOptions | None = None) -> None:
        self.options = options if options is not None else StoreOptions()
        self.count_unique = self.options.advanced.count_unique
        self.manifest = manifest
        self.rows = manifest.rows
        self.dim = manifest.dim
        self.row_dtype = manifest.row_dtype
        self.value_bytes = manifest.value_bytes
        self.scale_cols = manifest.scale_cols
        self.row_bytes = self.value_bytes + self.scale_cols
        self.device = torch.device(device)
        self.cache = cache
        self._lock = threading.Lock()  # counters
        self._cache_mutex = threading.RLock()  # cache lookups + inserts (re-entrant: subclasses may hold it)
        self._counts = dict.fromkeys(STAT_KEYS, 0)
        self._unique_acc: dict[torch.device, torch.Tensor] = {}  # distinct-id counts not yet read back, per device
        self._closed = False

    # ----------------------------------------------------------------- subclass hooks
    def _fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed rows of ``ids`` (int64 [M], in range, distinct, ascending) on the store's device: (values uint8 [M, >=
        value_bytes], scales uint8 [M, scale_cols] | None). Adds bytes_read/read_ops."""
        raise NotImplementedError

    # ----------------------------------------------------------------- public API
    def check_ids(self, ids: torch.Tensor | Any) -> torch.Tensor:
        """int64 [N] view of ``ids`` where they are; CPU ids: IndexError outside [0, rows); GPU ids unchecked (a sync)
        unless ``check_device_ids``."""
        if self._closed:
            raise RuntimeError(f"table {self.manifest.path} is closed")
        ids = as_ids(ids)
        if ids.device.type == "cpu" or self.options.advanced.check_device_ids:
            check_range(ids, self.rows, self.manifest.path)
        return ids

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dequantized rows [N, dim] in ``dtype`` on ``self.device`` (written into ``out`` when given)."""
        ids = self.check_ids(ids)
        self._check_out(out, ids.numel(), dtype)
        return self._gather_deduped(ids, out, dtype)

    def gather_raw(self, ids: torch.Tensor, cached: bool = True) -> torch.Tensor:
        """Packed row bytes uint8 [N, row_bytes] on ``self.device``: values, then scale bytes (mxfp8). ``cached``
        False reads past the hot-row cache (neither probed nor filled, its lock not taken: prompt prefetch)."""
        ids = self.check_ids(ids)
        if ids.numel() == 0:
            self._count(lookups=1)
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.device)
        vals, scales, inverse = self._unique_rows(ids, cached)
        raw = vals[:, : self.value_bytes].index_select(0, inverse)  # [N, value_bytes]
        if scales is None:
            return raw
        return torch.cat([raw, scales.index_select(0, inverse)], dim=1)  # [N, row_bytes]

    def decode_raw(self, raw: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows from ``gather_raw`` bytes [N, row_bytes] -> [N, dim] ``dtype``, bitwise equal to ``gather``."""
        if raw.dim() != 2 or raw.shape[1] != self.row_bytes or raw.dtype != torch.uint8:
            raise ValueError(f"raw rows must be uint8 [N, {self.row_bytes}], got {raw.dtype} {tuple(raw.shape)}")
        vals = raw[:, : self.value_bytes]
        scales = raw[:, self.value_bytes:] if self.scale_cols else None
        idx = torch.arange(raw.shape[0], device=raw.device)
        return kernels.gather_rows(vals, scales, idx, self.row_dtype, self.dim, dtype=dtype)

    def submit(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> LookupHandle:
        """Start a lookup; here it runs at once and the handle is complete (the disk tier runs it async)."""
        try:
            return CompletedLookup(self.gather(ids, dtype=dtype))
        except Exception as e:  # surfaced by wait(), as an async tier would
            return CompletedLookup(error=e)

    def file_layout(self) -> dict[str, Any] | None:
        """Where a lookup's rows are read from when they are read from a file (the disk tier), else None."""
        return None

    @property
    def gathers_on_device(self) -> bool:
        """Whether ``gather`` of GPU ids into a GPU ``out`` is device work alone, so a CUDA graph can capture it."""
        return False

    def record_lookups(self, lookups: int, rows: int) -> None:
        """Count lookups served by a captured gather (a CUDA-graph replay runs no Python to count them)."""
        self._count(lookups=lookups, rows=rows, bytes_read=rows * (self.manifest.row_stride + self.scale_cols),
                    read_ops=lookups if rows else 0)

    def stats(self) -> dict[str, int]:
        """Counters since open: lookups, rows, unique_rows, hits / misses / evictions, bytes_read and read_ops."""
        with self._lock:
            pending, self._unique_acc = self._unique_acc, {}
            self._counts["unique_rows"] += sum(int(t) for t in pending.values())
            out = dict(self._counts)
        if self.cache is not None:
            out.update(self.cache.counters())
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(STAT_KEYS, 0)
            self._unique_acc = {}
        if self.cache is not None:
            self.cache.reset_counters()

    def close(self) -> None:
        """Release storage; later calls raise RuntimeError."""
        self._closed = True
        self.cache = None

    def __enter__(self) -> "TableBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(path={str(self.manifest.path)!r}, rows={self.rows}, dim={self.dim}, "
                f"row_dtype={self.row_dtype!r}, device={self.device}, cache={self.cache!r})")

    # ----------------------------------------------------------------- shared path
    def _check_out(self, out: torch.Tensor | None, n: int, dtype: torch.dtype) -> None:
        if out is not None and (tuple(out.shape) != (n, self.dim) or out.dtype != dtype):
            raise ValueError(f"out has shape {tuple(out.shape)} {out.dtype}, expected [{n}, {self.dim}] {dtype}")

    def _gather_deduped(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``gather`` after the id and ``out`` checks: dedupe, fetch (through the cache), decode, expand."""
        if ids.numel() == 0:
            self._count(lookups=1)
            return out if out is not None else torch.empty(0, self.dim, dtype=dtype, device=self.device)
        vals, scales, inverse = self._unique_rows(ids)
        # vals [U, >= value_bytes] uint8, inverse [N] -> dequantized [N, dim]
        return kernels.gather_rows(vals, scales, inverse, self.row_dtype, self.dim, out=out, dtype=dtype)

    def _count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                self._counts[k] += int(v)

    def _dedupe(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct ``ids`` ascending [U] and the position of each id among them [N]; counts the lookup."""
        uniq, inverse = torch.unique(ids, return_inverse=True)
        self._count(lookups=1, rows=ids.numel(), unique_rows=uniq.numel())
        return uniq, inverse

    def _unique_rows(self, ids: torch.Tensor, cached: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Each distinct row of ``ids`` [N] fetched once (through the cache unless ``cached`` is False) -> (values
        [U, >= value_bytes], scales, inverse [N] into U) on ``self.device``."""
        uniq, inverse = self._dedupe(ids)
        if self.cache is None or not cached:
            vals, scales = self._fetch(uniq.cpu() if self.host_backed else uniq)
        else:
            with self._cache_mutex:  # the cache's tag/stamp update is one critical section
                vals, scales = self.cache.fetch(uniq, self._fetch)
        if vals.device != self.device:  # a backing tier that returned host bytes: move the packed rows once
            vals = to_device(vals, self.device)  # CUDA: from pinned memory, without making the host wait
            scales = to_device(scales, self.device) if scales is not None else None
        return vals, scales, to_device(inverse, self.device)


# Makes a resident table's storage in memory instead of reading files: called as
# build(target, layout=, progress=, threads=) with ``load_table``'s meaning of each, it returns what
# ``load_table`` would (e.g. ``functools.partial(engram.store.build.build_table, manifest, chunks)``).
StorageBuild = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]


class ResidentTable(TableBackend):
    """A tier whose bytes are all tensors (gpu, host): ``values`` uint8 [rows, row_stride], ``scales`` | None; uncached
    lookups are one fused kernel call."""

    values: torch.Tensor
    scales: torch.Tensor | None

    def _storage(self, target: str | torch.device, layout: str, progress: bool,
                 build: StorageBuild | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values, scales) on ``target`` in ``layout``, as ``load.load_table`` returns them: from ``build`` when given,
        else the manifest's files."""
        threads = self.options.advanced.load_threads
        if build is not None:
            return build(target, layout=layout, progress=progress, threads=threads)
        return load_table(self.manifest, target, verify=self.options.advanced.verify, progress=progress, layout=layout,
                          threads=threads)

    def _kernel_gather(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (checked, int64 [N >= 1]) dequantized by one kernel call, into ``out`` when given."""
        raise NotImplementedError

    def _gather_resident(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """One fused kernel call over the table: no dedupe, cache or host sync (``count_unique`` sorts on device)."""
        ids = self.check_ids(ids)
        n = ids.numel()
        self._check_out(out, n, dtype)
        self.record_lookups(1, n)
        if n == 0:
            return out if out is not None else torch.empty(0, self.dim, dtype=dtype, device=self.device)
        if self.count_unique:
            s = ids.sort().values
            distinct = (s[1:] != s[:-1]).sum() + 1  # 0-dim int64 on the ids' device
            with self._lock:
                acc = self._unique_acc.get(distinct.device)
                self._unique_acc[distinct.device] = distinct if acc is None else acc + distinct
        rows = self._kernel_gather(ids, out, dtype)
        if rows.device != self.device:  # torch path over host memory: move the [N, dim] rows once
            rows = rows.to(self.device)
            if out is not None:
                out.copy_(rows)
                return out
        return rows

    def _fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._count(bytes_read=ids.numel() * (self.manifest.row_stride + self.scale_cols), read_ops=1)
        return self._rows_by_id(ids)

    def _rows_by_id(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_fetch`` without the counting: (values uint8 [M, >= value_bytes], scales | None) of ``ids``."""
        ids = ids.to(self.values.device)
        scales = self.scales.index_select(0, ids) if self.scales is not None else None
        return self.values.index_select(0, ids), scales  # [M, row_stride], [M, scale_cols], where the table is

    def close(self) -> None:
        super().close()
        self.values = self.scales = None
