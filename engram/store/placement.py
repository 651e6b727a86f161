"""``open_table``: the one placement function — options, manifest checks, layout fingerprint, memory
preflight, tier.

Order of checks, cheapest first: the options (``StoreOptions``, ValueError naming the key and value), the
manifest and file sizes (TableFormatError naming file and offset), the expected layout (``expect``, an
EngramConfig.fingerprint), the memory preflight (MemoryPreflightError with the sizes and an option that
fits), then the tier loads (gpu/host verify every chunk's CRC32 while reading; the disk tier checks the
files it keeps resident and every page it reads against its page checksums; ``verify_table`` checks
everything).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from engram.store.base import TableBackend, Tier
from engram.store.cache import RowCache
from engram.store.format import check_fingerprint, read_manifest
from engram.store.gpu import default_device
from engram.store.options import StoreOptions
from engram.store.preflight import preflight
from engram.store.shared_preflight import check_shared
from engram.store.disk import DiskTable
from engram.store.gpu import GpuTable
from engram.store.host import HostTable


def resolve_options(options: StoreOptions | None, **given: Any) -> StoreOptions:
    """``options`` (default: StoreOptions()) with the keyword options in ``given`` applied; ``None`` values
    count as not given. Unknown names raise ValueError listing the known ones."""
    changes = {k: v for k, v in given.items() if v is not None}
    base = options if options is not None else StoreOptions()
    return base.replace(**changes) if changes else base


def open_table(directory: str | os.PathLike, tier: str | Tier = "gpu", device: torch.device | str | None = None,
               cache_rows: int | None = None, cache_policy: str | None = None, io: str | None = None,
               queue_depth: int | None = None, expect: dict[str, Any] | None = None, *,
               options: StoreOptions | None = None, progress: bool = False, **more_options: Any) -> TableBackend:
    """Open a table directory on ``tier`` ("gpu" | "host" | "disk"); rows are returned on ``device``
    (default: the current CUDA device, else the CPU).

    ``options``: a StoreOptions (engram/store/options.py lists and validates every runtime option: cache,
    disk reads, host layout and routes, verification, preflight, counters). The same options may be given
    as keywords (``cache_rows``, ``cache_policy``, ``io``, ``queue_depth`` positionally as before, or any other
    StoreOptions field, e.g. ``cache_bytes=``, ``count_unique=``); keywords override ``options``, and
    ``open_table(d, options=StoreOptions(io="buffered"))`` equals ``open_table(d, io="buffered")``.
    ``expect``: the layout fingerprint the table must have been built for. ``progress``: progress bars
    while loading.
    """
    tier = Tier.parse(tier)
    opts = resolve_options(options, cache_rows=cache_rows, cache_policy=cache_policy, io=io,
                           queue_depth=queue_depth, **more_options)
    m = read_manifest(directory)
    if expect is not None:
        check_fingerprint(m, expect)
    return place_table(m, tier, device, opts, progress)


def place_table(m, tier: Tier, device, opts: StoreOptions, progress: bool = True, build=None) -> TableBackend:
    """The table object of manifest ``m`` on ``tier``: the hot-row cache the options ask for (refused on the
    gpu tier, which holds the whole table), the memory preflight, then the tier's class. ``build`` (tiers gpu
    and host): makes the storage instead of reading the manifest's files (a table built in memory)."""
    cache_rows = max(opts.cache_rows, RowCache.rows_for_bytes(opts.cache_bytes, m.value_bytes, m.scale_cols))
    if cache_rows and tier is Tier.GPU:
        raise ValueError(f"engram_config.cache_rows={cache_rows}: the gpu tier holds the whole table and takes no "
                         "cache; caches go in front of tier='host' or 'disk'")
    dev = default_device(device)
    mapped = check_shared([m], tier, opts) if opts.shared_memory else 0  # room for the node's copy, else an error
    if opts.advanced.check_memory:
        adv = opts.advanced
        preflight(m, tier.value, dev, cache_rows, host_layout=adv.host_layout, chunk_pages=adv.chunk_pages,
                  mapped_bytes=mapped)
    cache = (RowCache(min(cache_rows, m.rows), m.value_bytes, m.scale_cols, policy=opts.cache_policy,
                      ways=opts.advanced.cache_ways, device=dev) if cache_rows else None)
    if tier is Tier.GPU:
        return GpuTable(m, dev, opts, progress=progress, build=build)
    if tier is Tier.HOST:
        return HostTable(m, dev, cache, opts, progress=progress, build=build)
    if build is not None:
        raise ValueError(f"{m.path}: tier 'disk' serves tables from their files, not from storage built in memory")
    return DiskTable(m, device=dev, cache=cache, options=opts)
