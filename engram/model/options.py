"""``RuntimeOptions``: the ``--engram-config`` JSON (``LLM(engram_config=...)``) validated once into types.
``cpu_offload`` (tier "host" unless one was chosen), ``lookup_overlap``, ``wkv_tp`` (tensor parallelism's WKV layout),
``table_rows`` (4b-like / 8b-like / v4-small-like), ``seed`` and ``tables_in_memory`` (tiers gpu and host); every other
key is a table option (StoreOptions). An unknown key or bad value raises ValueError before anything loads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from engram.store.options import StoreOptions

ENGINE_KEYS = ("cpu_offload", "lookup_overlap", "wkv_tp")
WKV_TP = ("replicated", "column")
LOADER_KEYS = ("table_rows", "seed", "tables_in_memory")


@dataclass(frozen=True)
class RuntimeOptions:
    cpu_offload: bool = False  # vLLM's name: tables in pinned host memory (tier "host")
    # lookups (and each layer's projection of its rows, WKV) on their own stream, overlapping earlier layers
    # (CUDA; docs/engine.md)
    lookup_overlap: bool = True
    # tensor parallelism: "replicated" wkv on every rank, or "column" (each rank its hidden slice; docs/parallel.md)
    wkv_tp: str = "replicated"
    table_rows: int | None = None  # rows per Engram layer of a preset model (None: the preset's)
    seed: int = 0  # preset weights and tables
    tables_in_memory: bool = False  # preset tables built in memory (tier gpu / host), no files (model/tables.py)
    store: StoreOptions = field(default_factory=StoreOptions)  # options of every opened table

    def __post_init__(self) -> None:
        if self.wkv_tp not in WKV_TP:
            raise ValueError(f"engram_config.wkv_tp={self.wkv_tp!r}: must be one of {list(WKV_TP)}")
        for key in ("cpu_offload", "lookup_overlap", "tables_in_memory"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"engram_config.{key}={getattr(self, key)!r}: must be true or false")
        if self.table_rows is not None and (isinstance(self.table_rows, bool) or not isinstance(self.table_rows, int)
                                            or self.table_rows < 1):
            raise ValueError(f"engram_config.table_rows={self.table_rows!r}: must be an int >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"engram_config.seed={self.seed!r}: must be an int >= 0")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> "RuntimeOptions":
        options = dict(options or {})
        known = ENGINE_KEYS + LOADER_KEYS + StoreOptions.KEYS
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"engram_config has unknown key(s) {unknown}; known keys: {sorted(known)}")
        own = {k: options.pop(k) for k in ENGINE_KEYS + LOADER_KEYS if k in options}
        return cls(store=StoreOptions.from_dict(options), **own)

    def tier(self, tier: str) -> str:
        """The tier: "host" for ``cpu_offload`` unless one was chosen; ValueError for ``tables_in_memory`` on "disk"."""
        tier = "host" if self.cpu_offload and tier == "gpu" else tier
        if self.tables_in_memory and tier == "disk":
            raise ValueError("engram_config.tables_in_memory=true: tier 'disk' serves tables from their files; "
                             "tables built in memory go on tier 'gpu' or 'host'")
        return tier
