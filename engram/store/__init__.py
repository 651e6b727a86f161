"""Engram table store: ``write_table`` writes a table directory, ``open_table`` opens one on a tier ("gpu" | "host" |
"disk") as a ``Table`` (``gather`` / ``gather_raw`` / ``submit`` / ``stats``); a bad table raises ``TableFormatError``
naming file and byte offset. See docs/store.md."""
from __future__ import annotations

from engram.store.base import LookupHandle, TableBackend, Tier
from engram.store.cache import RowCache
from engram.store.format import TableFormatError, TableManifest, read_manifest
from engram.store.options import StoreOptions
from engram.store.placement import open_table
from engram.store.preflight import MemoryPreflightError
from engram.store.verify import verify_table
from engram.store.writer import TableWriter, write_table

Table = TableBackend

__all__ = ["LookupHandle", "MemoryPreflightError", "RowCache", "StoreOptions", "Table", "TableBackend",
           "TableFormatError",
           "TableManifest", "TableWriter", "Tier", "open_table", "read_manifest", "verify_table", "write_table"]
