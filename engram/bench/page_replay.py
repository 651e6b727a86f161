"""Offline replay of a row trace (engine/row_trace.py) against a table file's layout: per step, the rows an LRU hot-row
cache of ``cache_rows`` misses (stack distances over the whole trace: stack_distance.py; the engine's set-associative
cache can only do worse than this fully associative one), and the distinct 4 KiB pages of values.bin holding them,
which a step must read. Row r lives at byte r * row_stride, so in page r // (page_size // row_stride)::

    values.bin  | page 0: rows 0 .. k-1 | page 1: rows k .. 2k-1 | ...      k = page_size // row_stride
    step s      rows {3, 5, k+1}  ->  misses {3, k+1} (5 hit)  ->  pages {0, 1}: 2 reads

``layer_pages`` is one layer's replay; ``trace_pages`` every layer of a trace, counted over a window of steps."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engram.bench.stack_distance import lru_hits, stack_distances

PAGE = 4096  # the raw read rate is measured in 4 KiB reads (disk_bound.measure_raw_reads)


def rows_per_page(layout: dict) -> int:
    """Rows per 4 KiB page of a table file layout (DiskTable.file_layout); ValueError naming the file when its rows
    are not packed in 4 KiB pages (a 4 KiB random-read rate would not price its reads)."""
    stride, page = int(layout["row_stride"]), int(layout["page_size"])
    if page != PAGE or stride > page or page % stride:
        raise ValueError(f"{layout['values']}: row_stride={stride}, page_size={page}: the replay prices reads of rows "
                         f"packed in {PAGE}-byte pages")
    return page // stride


@dataclass
class LayerPages:
    """One layer's replay: per step of the trace."""

    distinct: np.ndarray  # [S] distinct rows the step looked up
    misses: np.ndarray  # [S] of which the LRU missed
    pages: np.ndarray  # [S] distinct pages holding the misses: the reads the step needs


def layer_pages(rows: np.ndarray, bounds: np.ndarray, per_page: int, cache_rows: int) -> LayerPages:
    """``rows`` [A] each step's distinct ids, step after step (``bounds`` [S + 1] the steps' starts), through an LRU of
    ``cache_rows`` rows started empty (0: no cache, every row misses) -> LayerPages."""
    if cache_rows < 0 or per_page < 1:
        raise ValueError(f"cache_rows={cache_rows} must be >= 0 and rows per page={per_page} >= 1")
    n_steps = bounds.size - 1
    distinct = np.diff(bounds)
    hit = lru_hits(stack_distances(rows), cache_rows) if cache_rows else np.zeros(rows.size, dtype=bool)
    step = np.repeat(np.arange(n_steps, dtype=np.int64), distinct)  # [A]
    miss_step, miss_page = step[~hit], rows[~hit] // per_page
    span = int(miss_page.max()) + 1 if miss_page.size else 1
    keys = np.unique(miss_step * span + miss_page)  # distinct (step, page)
    return LayerPages(distinct=distinct, misses=np.bincount(miss_step, minlength=n_steps),
                      pages=np.bincount(keys // span, minlength=n_steps))


def trace_pages(trace, window: np.ndarray | None = None) -> dict:
    """Every layer of ``trace`` (a RowTrace) through its table's LRU (the header's ``table_files``: cache_rows, row
    layout), counted over the steps whose ids are in ``window`` (None: all): per layer and in all, steps, distinct rows,
    misses, pages, the LRU's hit rate and the planned ids ÷ distinct ids (what the per-step dedup saved); ``pages``
    [S] per step summed over layers, and ``kinds`` per step, for the window. ValueError naming the layer when the
    header lacks its table file."""
    files = trace.header.get("table_files", {})
    keep = np.isin(trace.step_ids, window) if window is not None else np.ones(len(trace.step_ids), dtype=bool)
    per_step = np.zeros(int(keep.sum()), dtype=np.int64)
    layers = []
    for i, lid in enumerate(trace.layer_ids):
        layout = files.get(str(lid))
        if layout is None:
            raise ValueError(f"row trace: layer {lid} has no table file in its header (the disk tier's tables report "
                             "theirs; tensor-parallel column shards do not)")
        rows, bounds = trace.layer(i)
        got = layer_pages(rows, bounds, rows_per_page(layout), int(layout["cache_rows"]))
        distinct, misses, pages = (int(x[keep].sum()) for x in (got.distinct, got.misses, got.pages))
        planned = int(trace.planned(i)[keep].sum())
        per_step += got.pages[keep]
        layers.append({"layer": lid, "values": layout["values"], "cache_rows": int(layout["cache_rows"]),
                       "rows_per_page": rows_per_page(layout), "ids": planned, "distinct_rows": distinct,
                       "misses": misses, "pages": pages, "hit_rate": 1 - misses / distinct if distinct else None,
                       "dedup_ratio": planned / distinct if distinct else None})
    total = {k: sum(x[k] for x in layers) for k in ("ids", "distinct_rows", "misses", "pages")}
    total["hit_rate"] = 1 - total["misses"] / total["distinct_rows"] if total["distinct_rows"] else None
    total["dedup_ratio"] = total["ids"] / total["distinct_rows"] if total["distinct_rows"] else None
    kinds = [k for k, m in zip(trace.kinds, keep) if m]
    return {"steps": int(keep.sum()), "layers": layers, **total, "pages_per_step": per_step, "kinds": kinds}
