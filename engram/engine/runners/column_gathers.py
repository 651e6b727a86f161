"""A graph step's Engram gathers over tensor-parallel column shards (parallel/engram_tp.py ``ColumnShard``), split
around their one collective so that it runs where NCCL needs it: ``gather_columns`` is the one place a graph issues
the rows' all-gathers. NCCL requires collectives on one communicator in the same order on every rank and none on
another stream overlapping them, so::

    lookup stream: [ local reads, every layer ]         [ decode (+ WKV projection), layer by layer ] ...
    main stream:            join ─► [ all-gather L1 ][ all-gather L2 ] ─► fork ─► layer 0 ─► Engram L1 waits

The lookup stream does only rank-local work (each layer's read of the rank's own columns, then the decode of every
column and the projection); the all-gathers run on the main stream in layer order, after the fork and before the
model's first layer, whatever the timing; the lookup stream waits for them (a second fork) before decoding. With no
lookup stream (the CPU, or ``lookup_overlap`` off) the same three phases run in the same order on one stream."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from engram.engine.lookup_stream import LookupStream


def gather_columns(tables: dict, ids: dict[int, torch.Tensor], outs: dict[int, torch.Tensor],
                   stream: LookupStream | None, finish: Callable[[int, int], None]) -> None:
    """Fill ``outs[layer]`` (rows [T, n_cols, D]) with the rows of ``ids[layer]`` [T, n_cols] through every column
    shard of ``tables`` ({layer: ColumnShard}, in layer order); ``finish(i, layer)`` runs after layer ``layer``'s
    rows are written (on the lookup stream when there is one: the projection, the row tag, ``stream.done``)."""
    with _on(stream):  # rank-local: no collective on this stream
        pieces = [table.local(ids[lid].reshape(-1)) for lid, table in tables.items()]  # [T, pad_cols, row_bytes]
    if stream is not None:
        stream.join()  # the main stream waits for the reads it all-gathers
    raws = [table.all_gather(piece) for table, piece in zip(tables.values(), pieces)]  # the step's fixed point
    with _on(stream):  # forked again: after the all-gathers queued on the main stream
        for i, ((lid, table), raw) in enumerate(zip(tables.items(), raws)):
            rows = outs[lid]
            table.decode(raw, rows.dtype, out=rows.view(-1, rows.shape[-1]))
            finish(i, lid)


def _on(stream: LookupStream | None):
    return stream.issue() if stream is not None else contextlib.nullcontext()
