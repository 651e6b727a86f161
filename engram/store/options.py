"""``StoreOptions``: every runtime option of an opened table, validated once, in one place.

``open_table(dir, tier, device, options=StoreOptions(...))`` (or the same names as keywords) opens a
table with them; ``StoreOptions.from_dict(d)`` builds them from the ``--engram-config`` JSON and refuses
unknown keys; ``StoreOptions.KEYS`` lists the names that JSON may carry. Nothing else in the store reads
options from the environment: the variables that remain are debugging switches (docs/store.md lists them).
Errors are ValueError naming the key and the value, e.g. ``engram_config.queue_depth=0: must be in [1, 1024]``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from engram.store.cache import POLICIES
from engram.store.kernels.uva import RouteBands
from engram.store.load import LAYOUTS, LOAD_THREADS
from engram.store.reader import IO_MODES, MAX_QUEUE_DEPTH

PREFIX = "engram_config"  # how errors name a key: as the --engram-config JSON spells it


@dataclass(frozen=True)
class StoreOptions:
    """Runtime options of one table (all tiers; each tier reads the ones that concern it)."""

    # hot-row cache in front of the host and disk tiers (the gpu tier takes none)
    cache_rows: int = 0  # capacity in rows (0: no cache)
    cache_bytes: int = 0  # capacity in bytes incl. 24 B of bookkeeping per row; the larger of the two wins
    cache_policy: str = "lru"  # "lru" | "lfu" (LFU with aging resists scans of cold rows)
    cache_ways: int = 8  # ways per set of the set-associative cache
    # disk tier
    io: str = "direct"  # "direct" (O_DIRECT, bypasses the page cache) | "buffered" (page cache)
    queue_depth: int = 64  # preads in flight per batched read (threads of the shared pread pool)
    max_inflight: int = 8  # submitted lookups not yet waited or cancelled; one more raises
    chunk_pages: int = 2048  # pages per batched read: bounds a lookup's page buffers (2 x 8 MiB)
    background_verify: bool = False  # after open, read values.bin once in the background checking every page
    # host tier
    host_layout: str = "packed"  # "packed" (values + scales per row in one buffer) | "split" (the files')
    staged_min_rows: int = RouteBands.staged_min_rows  # CPU-ids batches from this size take the staged route
    sorted_min_rows: int = RouteBands.sorted_min_rows  # batches from this size take the sorted route
    staged_chunk_rows: int = RouteBands.staged_chunk_rows  # rows per pipelined copy of the staged route
    uva_max_programs: int = 0  # cap on the UVA gather's grid (0: none), so it holds fewer SMs
    # each UVA gather program takes up to this many 16-row tiles, at least 8 programs (1: one program per
    # tile): a gather beside the main stream holds few SMs (docs/store.md, "The UVA gather's grid")
    uva_tiles_per_program: int = 24
    # loading and checks
    load_threads: int = LOAD_THREADS  # workers reading + CRC-checking the files (gpu and host tiers)
    verify: bool = True  # CRC-check every chunk while loading (gpu, host; the disk tier's resident files)
    check_memory: bool = True  # memory preflight before loading
    check_device_ids: bool = False  # range-check ids that arrive on the device (a host sync per lookup)
    count_unique: bool = False  # count distinct ids on the resident tiers (a device sort per lookup)

    KEYS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kind = bool if f.type == "bool" else int if f.type == "int" else str
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                expected = "true or false" if kind is bool else kind.__name__
                raise ValueError(f"{PREFIX}.{f.name}={v!r}: must be {expected}")
        _one_of(self, "cache_policy", POLICIES)
        _one_of(self, "io", IO_MODES)
        _one_of(self, "host_layout", LAYOUTS)
        _in_range(self, "cache_rows", 0)
        _in_range(self, "cache_bytes", 0)
        _in_range(self, "cache_ways", 1)
        _in_range(self, "queue_depth", 1, MAX_QUEUE_DEPTH)
        _in_range(self, "max_inflight", 1)
        _in_range(self, "chunk_pages", 1)
        _in_range(self, "staged_min_rows", 1)
        _in_range(self, "sorted_min_rows", self.staged_min_rows)
        _in_range(self, "staged_chunk_rows", 1)
        _in_range(self, "uva_max_programs", 0)
        _in_range(self, "uva_tiles_per_program", 1)
        _in_range(self, "load_threads", 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "StoreOptions":
        """Options from a JSON object; ValueError naming unknown keys and listing the known ones."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"{PREFIX} has unknown key(s) {unknown}; known keys: {list(cls.KEYS)}")
        return cls(**d)

    def replace(self, **changes: Any) -> "StoreOptions":
        """A copy with ``changes`` applied (validated like ``from_dict``)."""
        return StoreOptions.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def route_bands(self) -> RouteBands:
        """The host tier's batch-size bands (``engram.store.kernels.uva.RouteBands``)."""
        return RouteBands(self.staged_min_rows, self.sorted_min_rows, self.staged_chunk_rows)


StoreOptions.KEYS = tuple(f.name for f in dataclasses.fields(StoreOptions))


def _one_of(o: StoreOptions, name: str, allowed: tuple[str, ...]) -> None:
    v = getattr(o, name)
    if v not in allowed:
        raise ValueError(f"{PREFIX}.{name}={v!r}: must be one of {list(allowed)}")


def _in_range(o: StoreOptions, name: str, lo: int, hi: int | None = None) -> None:
    v = getattr(o, name)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{PREFIX}.{name}={v!r}: must be " + (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"))
