"""``open_table``: the one placement function — manifest checks, layout fingerprint, memory preflight, tier.

Order of checks, cheapest first: the manifest and file sizes (TableFormatError naming file and offset),
the expected layout (``expect``, an EngramConfig.fingerprint), the memory preflight (MemoryPreflightError
with the sizes and an option that fits), then the tier loads (gpu/host verify every chunk's CRC32 while
reading; the disk tier checks the scales it keeps resident, reads values on demand, and ``verify_table``
checks its files in full).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from engram.store.base import TableBackend, Tier
from engram.store.cache import POLICIES, RowCache
from engram.store.format import check_fingerprint, read_manifest
from engram.store.gpu import default_device
from engram.store.load import LAYOUTS
from engram.store.preflight import preflight, preflight_enabled
from engram.store.reader import IO_MODES


def open_table(directory: str | os.PathLike, tier: str | Tier = "gpu", device: torch.device | str | None = None,
               cache_rows: int = 0, cache_policy: str = "lru", io: str = "direct", queue_depth: int = 64,
               expect: dict[str, Any] | None = None, *, cache_bytes: int | None = None, cache_ways: int = 8,
               verify: bool = True, progress: bool = False, check_memory: bool = True,
               count_unique: bool = True, host_layout: str = "packed") -> TableBackend:
    """Open a table directory on ``tier`` ("gpu" | "host" | "disk"); rows are returned on ``device``
    (default: the current CUDA device, else the CPU).

    cache_rows / cache_bytes: hot-row cache in front of host or disk (capacity in rows, or in bytes
    including bookkeeping); cache_policy "lru" | "lfu". io / queue_depth: disk tier reads. expect: the
    layout fingerprint the table must have been built for. verify: CRC-check chunks while loading (gpu,
    host; the disk tier's resident scales). check_memory: run the memory preflight (also off with
    ENGRAM_PREFLIGHT=0). count_unique: count distinct ids on the resident paths (a device sort per lookup;
    see TableBackend.count_unique). host_layout: "packed" (each MXFP8 row's values and scales side by side
    in one buffer, so a row read touches one host page) or "split" (the files' own layout); host tier only.
    """
    tier = Tier.parse(tier)
    if cache_policy not in POLICIES:
        raise ValueError(f"cache_policy={cache_policy!r} must be one of {POLICIES}")
    if io not in IO_MODES:
        raise ValueError(f"io={io!r} must be one of {IO_MODES}")
    if queue_depth < 1:
        raise ValueError(f"queue_depth={queue_depth} must be >= 1")
    if host_layout not in LAYOUTS:
        raise ValueError(f"host_layout={host_layout!r} must be one of {LAYOUTS}")
    if cache_rows < 0 or (cache_bytes is not None and cache_bytes < 0):
        raise ValueError(f"cache_rows={cache_rows} / cache_bytes={cache_bytes} must be >= 0")
    m = read_manifest(directory)
    if expect is not None:
        check_fingerprint(m, expect)
    if cache_bytes:
        cache_rows = max(cache_rows, RowCache.rows_for_bytes(cache_bytes, m.value_bytes, m.scale_cols))
    if cache_rows and tier is Tier.GPU:
        raise ValueError(f"cache_rows={cache_rows}: the gpu tier holds the whole table and takes no cache; "
                         "caches go in front of tier='host' or 'disk'")
    dev = default_device(device)
    if check_memory and preflight_enabled():
        preflight(m, tier.value, dev, cache_rows, host_layout=host_layout)
    cache = (RowCache(min(cache_rows, m.rows), m.value_bytes, m.scale_cols, policy=cache_policy, ways=cache_ways,
                      device=dev) if cache_rows else None)
    if tier is Tier.GPU:
        from engram.store.gpu import GpuTable
        table: TableBackend = GpuTable(m, dev, verify=verify, progress=progress)
    elif tier is Tier.HOST:
        from engram.store.host import HostTable
        table = HostTable(m, dev, cache, verify=verify, progress=progress, layout=host_layout)
    else:
        from engram.store.disk import DiskConfig, DiskTable
        table = DiskTable(m, device=dev, cache=cache, config=DiskConfig(io=io, queue_depth=queue_depth),
                          verify=verify)
    table.count_unique = count_unique
    return table
