"""Engram tables sharded by hash columns over tensor-parallel ranks (vLLM's layout). The n_cols columns of a layer are
split in contiguous runs, at most one column apart in size (``column_split``); a column's rows are contiguous in the
table, so rank r's columns are one row range and its table is that row shard (store/row_shard.py) on every tier. A
lookup reads only the rank's columns (``ColumnShard``: rank-local, its MXFP8 bytes), then one all-gather on the group
carries every rank's bytes, padded to ceil(n_cols / N) columns, and each rank decodes all columns: rows bitwise TP1's::

    columns of a layer, TP4 over 24:  | c0..c5 | c6..c11 | c12..c17 | c18..c23 |
    rows of the table:                | rank 0 | rank 1  |  rank 2  |  rank 3  |  (+ rows no column reaches: none)
    all-gather [N, T, ceil(24/N), row_bytes] uint8 -> [T, 24, row_bytes] -> decode -> [T, 24, head_dim]

Where the collective runs: on the thread that waits for the rows, never on a table's read thread, and at a point
that does not depend on timing: the first layer's rows when the step's lookups are staged, every later layer's when
the model asks for them (a ``ShardLookup`` never reports done before it was waited for, so every rank defers the same
layers and issues its all-gathers in the same order). In a graph step (runners/column_gathers.py) every layer's
all-gather runs before the forward, between ``local`` and ``decode``: a CUDA graph captures it on a gpu-tier shard."""
from __future__ import annotations

import concurrent.futures as cf
import functools
from typing import Callable

import torch
import torch.distributed as dist

from engram.config import EngramConfig
from engram.model.tables import layer_seed, random_manifest, random_rows
from engram.store.base import LookupHandle, Tier
from engram.store.build import build_table
from engram.store.options import StoreOptions
from engram.store.placement import open_table, place_table
from engram.store.row_shard import row_range_chunks, shard_manifest, write_row_shard


def column_split(n_cols: int, world: int) -> list[range]:
    """Each rank's columns: contiguous, sizes differing by at most one (so the all-gather pads to ceil(n_cols / N))."""
    if world > n_cols:
        raise ValueError(f"engram.n_cols={n_cols} hash columns over tensor_parallel_size={world}: a rank would own "
                         "none (sharding tables by column needs N <= n_cols)")
    return [range(r * n_cols // world, (r + 1) * n_cols // world) for r in range(world)]


def column_rows(cfg: EngramConfig, layer_id: int, cols: range) -> tuple[int, int]:
    """The table rows [lo, hi) of columns ``cols`` of layer ``layer_id`` (column c: [offset_c, offset_c + prime_c))."""
    bounds = cfg.column_offsets(layer_id) + [sum(cfg.primes(layer_id))]
    return bounds[cols.start], bounds[cols.stop]


def shard_fingerprint(cfg: EngramConfig, layer_id: int, cols: range) -> dict:
    """The layout fingerprint a rank's shard must carry: the layer's, plus its columns and rows."""
    return {**cfg.fingerprint(layer_id), "columns": [cols.start, cols.stop],
            "row_range": list(column_rows(cfg, layer_id, cols))}


def open_column_shards(loaded, rank: int, world: int, group, before_read: Callable[[int], None] | None = None,
                       progress: bool = False) -> dict[int, "ColumnShard"]:
    """Rank ``rank``'s table of every Engram layer of ``loaded`` (a LoadedModel, tables not opened): its columns' row
    shard on ``loaded.tier``, written once beside the full table (or built in memory for ``tables_in_memory``)."""
    cfg = loaded.engram_config
    if cfg is None:
        return {}
    splits = column_split(cfg.n_cols, world)
    cols = splits[rank]
    opts = loaded.store_options if loaded.store_options is not None else StoreOptions()
    out = {}
    for lid in loaded.table_layer_ids:  # a pipeline stage's own layers only
        lo, hi = column_rows(cfg, lid, cols)
        fp = shard_fingerprint(cfg, lid, cols)
        if loaded.memory_table_seed is not None:
            seed = loaded.memory_table_seed
            m = random_manifest(cfg, lid, seed)
            sm = shard_manifest(m, lo, hi, fp)
            chunks = row_range_chunks(random_rows(m.rows, m.dim, layer_seed(seed, lid), m.row_dtype), lo, hi)
            table = place_table(sm, Tier.parse(loaded.tier), loaded.device, opts, progress,
                                build=functools.partial(build_table, sm, chunks))
        else:
            directory = write_row_shard(loaded.table_dirs[lid], lo, hi, fp, progress=progress)
            table = open_table(directory, tier=loaded.tier, device=loaded.device, expect=fp, options=opts)
        out[lid] = ColumnShard(table, lid, cfg.n_cols, splits, rank, lo, group, before_read)
    return out


class ColumnShard:
    """Layer ``layer_id``'s table as rank ``rank`` serves it: ``gather(ids [T * n_cols])`` -> every column's rows [T *
    n_cols, D], bitwise a whole table's. ``table``: the rank's row shard (source row ``row_lo + i`` is its row i);
    ``before_read(layer_id)``: called before each local read (tests delay one rank's lookups with it)."""

    column_layout = True  # takes ids as [T * n_cols] (it reads its columns of them): never deduplicated ones

    def __init__(self, table, layer_id: int, n_cols: int, splits: list[range], rank: int, row_lo: int, group,
                 before_read: Callable[[int], None] | None = None):
        self.table, self.layer_id, self.n_cols, self.splits = table, layer_id, n_cols, splits
        self.cols, self.row_lo, self.group, self.before_read = splits[rank], row_lo, group, before_read
        self.pad_cols = max(len(s) for s in splits)  # ceil(n_cols / N): every rank's piece has this many
        self.row_bytes = table.row_bytes
        # a device-resident shard: its read, the all-gather (a device collective) and the decode are device work
        # alone, so a CUDA graph captures the whole gather (runners/column_gathers.py splits it around the collective)
        self.gathers_on_device = (bool(getattr(table, "gathers_on_device", False))
                                  and hasattr(table, "gather_raw_direct"))
        self.reads_from_disk = getattr(table, "reads_from_disk", False)
        self.cache = getattr(table, "cache", None)
        self._reads = cf.ThreadPoolExecutor(1, thread_name_prefix=f"engram-shard{layer_id}") \
            if self.reads_from_disk else None

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``ids`` [T * n_cols] read from its shard -> packed bytes uint8 [T, pad_cols,
        row_bytes] (the pad columns zero). Rank-local: safe on any thread. Id 0 in this rank's columns (a graph's
        padding row, runners/decode_inputs.py) reads the shard's first row: no real id of a column after the first
        is 0, so no real id is changed. On-device ids stay on the device (no deduplication: capturable)."""
        if self.before_read is not None:
            self.before_read(self.layer_id)
        mine = ids.reshape(-1, self.n_cols)[:, self.cols.start:self.cols.stop]  # [T, k]
        if self.row_lo:
            mine = torch.where(mine == 0, self.row_lo, mine)
        mine = (mine - self.row_lo).reshape(-1)
        if mine.device.type == "cpu" or not self.gathers_on_device:
            raw = self.table.gather_raw(mine)
        else:
            raw = self.table.gather_raw_direct(mine)
        raw = raw.view(-1, len(self.cols), self.row_bytes)
        piece = raw.new_zeros(raw.shape[0], self.pad_cols, self.row_bytes)  # [T, pad_cols, row_bytes]
        piece[:, :len(self.cols)] = raw
        return piece

    def all_gather(self, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` piece, all-gathered on the group -> packed bytes [T * n_cols, row_bytes] (the
        collective: issued by every rank at the same point of the step)."""
        if piece.shape[0] == 0:  # the same on every rank: no collective
            return piece.new_zeros(0, self.row_bytes)
        parts = [torch.empty_like(piece) for _ in self.splits]
        dist.all_gather(parts, piece, group=self.group)  # [N] x [T, pad_cols, row_bytes]
        raw = torch.cat([p[:, :len(s)] for p, s in zip(parts, self.splits)], dim=1)  # [T, n_cols, row_bytes]
        return raw.reshape(-1, self.row_bytes)

    def decode(self, raw: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """``all_gather``'s bytes decoded -> rows [T * n_cols, D] in ``dtype``, bitwise a whole table's gather
        (rank-local)."""
        rows = self.table.decode_raw(raw, dtype)
        if out is None:
            return rows
        out.copy_(rows)
        return out

    def assemble(self, piece: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``local`` piece all-gathered on the group, decoded -> rows [T * n_cols, D] in ``dtype``."""
        return self.decode(self.all_gather(piece), dtype, out)

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows of ``ids`` [T * n_cols] (every column), read here for this rank's columns and all-gathered; device
        ids stay where they are when the shard gathers on the device (a CUDA graph captures it)."""
        ids = torch.as_tensor(ids)
        return self.assemble(self.local(ids if self.gathers_on_device else ids.cpu()), dtype, out)

    def submit(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> "ShardLookup":
        """Start the local read (on this shard's thread when it reads from disk); ``wait`` all-gathers."""
        ids = torch.as_tensor(ids).cpu()
        if self._reads is None:
            future: cf.Future = cf.Future()
            try:
                future.set_result(self.local(ids))
            except Exception as e:  # surfaced by wait(), as a disk read's would be
                future.set_exception(e)
        else:
            future = self._reads.submit(self.local, ids)
        return ShardLookup(self, future, dtype)

    def stats(self) -> dict[str, int]:
        """The shard's own counters (this rank's columns only)."""
        return self.table.stats()

    def record_lookups(self, lookups: int, rows: int) -> None:
        """Count a graph replay's gather of ``rows`` rows of every column: this rank read its columns' share."""
        self.table.record_lookups(lookups, rows // self.n_cols * len(self.cols))

    def reset_stats(self) -> None:
        self.table.reset_stats()

    def close(self) -> None:
        if self._reads is not None:
            self._reads.shutdown(wait=True, cancel_futures=True)
        self.table.close()


class ShardLookup(LookupHandle):
    """A column shard's lookup: the local read in flight, the all-gather on ``wait``'s thread. ``done()`` is False
    until ``wait`` ran, whatever the read's progress, so no rank's staging takes a timing-dependent path."""

    def __init__(self, shard: ColumnShard, future: cf.Future, dtype: torch.dtype):
        self.shard, self.future, self.dtype = shard, future, dtype
        self._rows: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = self.shard.assemble(self.future.result(), self.dtype)
        return self._rows

    def done(self) -> bool:
        return self._rows is not None

    def cancel(self) -> bool:
        return self.future.cancel()
