"""``StoreOptions``: every runtime option of an opened table, validated once, in one place.

The options a user chooses sit at the top level: the hot-row cache (``cache_rows`` / ``cache_bytes``,
``cache_policy``) and the disk tier's reads (``io``, ``queue_depth``). Tuning knobs with measured defaults
(docs/store.md explains each) sit in ``advanced``, an ``AdvancedOptions``, which the ``--engram-config`` JSON
spells as a nested object: ``{"cache_rows": 200000, "advanced": {"load_threads": 16}}``.

``open_table(dir, tier, device, options=StoreOptions(...))`` (or the same names as keywords, either level)
opens a table with them; ``StoreOptions.from_dict(d)`` builds them from the JSON and refuses unknown keys;
``StoreOptions.KEYS`` lists the top-level names that JSON may carry. Errors are ValueError naming the key and
the value, e.g. ``engram_config.queue_depth=0: must be in [1, 1024]``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from engram.store.cache import POLICIES
from engram.store.kernels.uva import RouteBands
from engram.store.load import LAYOUTS, LOAD_THREADS
from engram.store.reader import IO_MODES, MAX_QUEUE_DEPTH

PREFIX = "engram_config"  # how errors name a key: as the --engram-config JSON spells it


@dataclass(frozen=True)
class AdvancedOptions:
    """Tuning knobs of the tiers, the loaders and the checks (docs/store.md)."""

    cache_ways: int = 8  # ways per set of the set-associative hot-row cache
    max_inflight: int = 8  # disk tier: submitted lookups not yet waited or cancelled; one more raises
    # disk tier: preads in flight of a prompt-priority read (the prompt prefetch), 0 = queue_depth; fewer leave the
    # device's queue shorter for a decode read arriving behind them (benchmarks/decode_reads_under_load.py)
    prompt_queue_depth: int = 0
    chunk_pages: int = 2048  # disk tier: pages per batched read, bounding a lookup's page buffers (2 x 8 MiB)
    background_verify: bool = False  # disk tier: after open, read values.bin once in the background checking pages
    host_layout: str = "packed"  # host tier: "packed" (values + scales per row in one buffer) / "split" (the files')
    staged_min_rows: int = RouteBands.staged_min_rows  # host tier: CPU-id batches from this size take the staged route
    sorted_min_rows: int = RouteBands.sorted_min_rows  # host tier: batches from this size take the sorted route
    staged_chunk_rows: int = RouteBands.staged_chunk_rows  # host tier: rows per pipelined copy of the staged route
    uva_max_programs: int = 0  # host tier: cap on the UVA gather's grid (0: none), so it holds fewer SMs
    # host tier: each UVA gather program takes up to this many 16-row tiles, at least 8 programs (1: one
    # program per tile), so a gather beside the main stream holds few SMs
    uva_tiles_per_program: int = 24
    load_threads: int = LOAD_THREADS  # workers reading + CRC-checking the files (gpu and host tiers)
    verify: bool = True  # CRC-check every chunk while loading (gpu, host; the disk tier's resident files)
    check_memory: bool = True  # memory preflight before loading
    check_device_ids: bool = False  # range-check ids that arrive on the device (a host sync per lookup)
    count_unique: bool = False  # count distinct ids on the resident tiers (a device sort per lookup)
    shm_dir: str = "/dev/shm"  # shared_memory: the tmpfs directory of the node's one copy (store/shared_host.py)

    KEYS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        _check_types(self, f"{PREFIX}.advanced")
        _one_of(self, "host_layout", LAYOUTS, ".advanced")
        _in_range(self, "prompt_queue_depth", 0, MAX_QUEUE_DEPTH, where=".advanced")
        for name, lo in (("cache_ways", 1), ("max_inflight", 1), ("chunk_pages", 1), ("staged_min_rows", 1),
                         ("sorted_min_rows", self.staged_min_rows), ("staged_chunk_rows", 1),
                         ("uva_max_programs", 0), ("uva_tiles_per_program", 1), ("load_threads", 1)):
            _in_range(self, name, lo, where=".advanced")
        if not self.shm_dir.startswith("/"):
            raise ValueError(f"{PREFIX}.advanced.shm_dir={self.shm_dir!r}: must be an absolute path (a tmpfs "
                             "directory such as /dev/shm)")

    @property
    def route_bands(self) -> RouteBands:
        """The host tier's batch-size bands (``engram.store.kernels.uva.RouteBands``)."""
        return RouteBands(self.staged_min_rows, self.sorted_min_rows, self.staged_chunk_rows)


@dataclass(frozen=True)
class StoreOptions:
    """Runtime options of one table (all tiers; each tier reads the ones that concern it)."""

    cache_rows: int = 0  # hot-row cache in front of the host and disk tiers: capacity in rows (0: no cache)
    cache_bytes: int = 0  # ... or in bytes incl. 24 B of bookkeeping per row; the larger of the two wins
    cache_policy: str = "lru"  # "lru" / "lfu" (LFU with aging resists scans of cold rows)
    io: str = "direct"  # disk tier: "direct" (O_DIRECT, bypasses the page cache) / "buffered" (page cache)
    queue_depth: int = 64  # disk tier: preads in flight per batched read
    # one copy per node: the host tier's rows (the disk tier's resident scales and page CRCs) in a shm_dir segment
    # that the first process creates and every process opening the same table maps (data-parallel replicas: on)
    shared_memory: bool = False
    advanced: AdvancedOptions = field(default_factory=AdvancedOptions)  # tuning knobs (docs/store.md)

    KEYS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        if not isinstance(self.advanced, AdvancedOptions):
            raise ValueError(f"{PREFIX}.advanced={self.advanced!r}: must be an object of advanced options")
        _check_types(self, PREFIX, skip=("advanced",))
        _one_of(self, "cache_policy", POLICIES)
        _one_of(self, "io", IO_MODES)
        _in_range(self, "cache_rows", 0)
        _in_range(self, "cache_bytes", 0)
        _in_range(self, "queue_depth", 1, MAX_QUEUE_DEPTH)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "StoreOptions":
        """Options from a JSON object (advanced knobs under "advanced"); ValueError naming unknown keys and
        listing the known ones."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            hint = [k for k in unknown if k in AdvancedOptions.KEYS]
            raise ValueError(f"{PREFIX} has unknown key(s) {unknown}; known keys: {list(cls.KEYS)}"
                             + (f" ({hint} go under \"advanced\")" if hint else ""))
        advanced = d.pop("advanced", None) or {}
        if not isinstance(advanced, Mapping):
            raise ValueError(f"{PREFIX}.advanced={advanced!r}: must be an object of advanced options")
        bad = sorted(set(advanced) - set(AdvancedOptions.KEYS))
        if bad:
            raise ValueError(f"{PREFIX}.advanced has unknown key(s) {bad}; known: {list(AdvancedOptions.KEYS)}")
        return cls(advanced=AdvancedOptions(**advanced), **d)

    def replace(self, **changes: Any) -> "StoreOptions":
        """A copy with ``changes`` applied, named at either level (``io=``, ``load_threads=``), validated like
        ``from_dict``."""
        top = {k: v for k, v in changes.items() if k not in AdvancedOptions.KEYS}
        adv = {k: v for k, v in changes.items() if k in AdvancedOptions.KEYS}
        merged = {**self.to_dict(), **top}
        merged["advanced"] = {**merged["advanced"], **adv}
        return StoreOptions.from_dict(merged)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


AdvancedOptions.KEYS = tuple(f.name for f in dataclasses.fields(AdvancedOptions))
StoreOptions.KEYS = tuple(f.name for f in dataclasses.fields(StoreOptions))


def _check_types(o, where: str, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(o):
        if f.name in skip:
            continue
        v = getattr(o, f.name)
        kind = bool if f.type == "bool" else int if f.type == "int" else str
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            expected = "true or false" if kind is bool else kind.__name__
            raise ValueError(f"{where}.{f.name}={v!r}: must be {expected}")


def _one_of(o, name: str, allowed: tuple[str, ...], where: str = "") -> None:
    v = getattr(o, name)
    if v not in allowed:
        raise ValueError(f"{PREFIX}{where}.{name}={v!r}: must be one of {list(allowed)}")


def _in_range(o, name: str, lo: int, hi: int | None = None, where: str = "") -> None:
    v = getattr(o, name)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{PREFIX}{where}.{name}={v!r}: must be "
                         + (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"))
