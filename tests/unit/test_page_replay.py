"""The row-trace replay (bench/page_replay.py) against a brute-force LRU and page count on small traces, and its two
ends: no cache misses every row; a cache of the whole table misses only first accesses. The trace file round trip
(engine/row_trace.py) and its errors name the file and byte."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from engram.bench.page_replay import layer_pages, rows_per_page, trace_pages
from engram.engine.row_trace import RowTrace, check_trace_path, read_row_trace


def _steps(rng, n_steps: int, table_rows: int, skew: float) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ascending ids per step (Zipf-ish so rows repeat across steps), step after step, and the bounds."""
    steps = []
    for _ in range(n_steps):
        k = int(rng.integers(0, 40))
        ids = np.minimum((rng.pareto(skew, size=k) * 30).astype(np.int64), table_rows - 1)
        steps.append(np.unique(ids))
    bounds = np.concatenate([[0], np.cumsum([s.size for s in steps])])
    return (np.concatenate(steps) if steps else np.empty(0, np.int64)), bounds


def _brute(rows, bounds, per_page, cache_rows):
    """A plain LRU (OrderedDict) fed each step's rows in order; per step the misses and their distinct pages."""
    lru: OrderedDict[int, None] = OrderedDict()
    misses, pages = [], []
    for s in range(bounds.size - 1):
        missed = []
        for r in rows[bounds[s]:bounds[s + 1]].tolist():
            if r in lru:
                lru.move_to_end(r)
            else:
                missed.append(r)
                if cache_rows:
                    lru[r] = None
                    if len(lru) > cache_rows:
                        lru.popitem(last=False)
        misses.append(len(missed))
        pages.append(len({r // per_page for r in missed}))
    return np.array(misses), np.array(pages)


@pytest.mark.parametrize("seed,cache_rows,per_page", [(0, 0, 16), (1, 7, 16), (2, 50, 8), (3, 200, 1), (4, 33, 128)])
def test_pages_equal_a_brute_force_lru_and_page_count(seed, cache_rows, per_page):
    rng = np.random.default_rng(seed)
    rows, bounds = _steps(rng, 120, 5_000, 1.2)
    got = layer_pages(rows, bounds, per_page, cache_rows)
    misses, pages = _brute(rows, bounds, per_page, cache_rows)
    assert got.misses.tolist() == misses.tolist()
    assert got.pages.tolist() == pages.tolist()
    assert got.distinct.tolist() == np.diff(bounds).tolist()
    assert 0 < got.pages.sum() <= got.misses.sum() <= rows.size


def test_no_cache_misses_all_and_a_whole_table_cache_only_first_accesses():
    rng = np.random.default_rng(5)
    table_rows, per_page = 3_000, 16
    rows, bounds = _steps(rng, 200, table_rows, 1.0)
    none = layer_pages(rows, bounds, per_page, 0)
    assert none.misses.tolist() == np.diff(bounds).tolist()  # every distinct row of every step
    assert none.pages.tolist() == [len(np.unique(rows[a:b] // per_page)) for a, b in zip(bounds[:-1], bounds[1:])]
    whole = layer_pages(rows, bounds, per_page, table_rows)
    seen: set[int] = set()
    first_pages = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        new = [r for r in rows[a:b].tolist() if r not in seen]
        seen.update(new)
        first_pages.append(len({r // per_page for r in new}))
    assert whole.misses.sum() == len(np.unique(rows))  # compulsory misses only
    assert whole.pages.tolist() == first_pages
    assert whole.pages.sum() < none.pages.sum()


def _trace(steps_rows: list[list[list[int]]], files: dict) -> RowTrace:
    """A RowTrace of per step, per layer id lists (kinds all decode)."""
    n_layers = len(steps_rows[0])
    table = [[i, 0, 1, *(len(x) for x in s), *(len(x) for x in s)] for i, s in enumerate(steps_rows)]
    ids = np.array([r for s in steps_rows for layer in s for r in layer], dtype=np.int64)
    return RowTrace({"layer_ids": list(range(n_layers)), "table_files": files}, np.array(table, dtype=np.int64), ids)


def test_trace_pages_counts_the_window_after_warming_the_cache_on_the_steps_before():
    files = {str(i): {"values": f"/t{i}/values.bin", "row_stride": 256, "page_size": 4096, "cache_rows": 100}
             for i in range(2)}
    # step 0 warms the cache with rows 0..15 (page 0) of layer 0; step 1 reads them again plus page 1's row 16
    trace = _trace([[list(range(16)), [40]], [list(range(17)), [40, 41]]], files)
    all_steps = trace_pages(trace)
    assert all_steps["pages"] == 4 and all_steps["pages_per_step"].tolist() == [2, 2]
    window = trace_pages(trace, np.array([1]))
    assert window["steps"] == 1 and window["misses"] == 2  # rows 16 and 41
    assert window["layers"][0]["pages"] == 1  # page 1 for row 16; page 0's rows all hit
    assert window["layers"][1]["pages"] == 1  # row 41 misses: its page is read although row 40 of it is cached
    assert window["pages"] == 2 and window["kinds"] == ["decode"]
    assert window["distinct_rows"] == 19 and window["hit_rate"] == pytest.approx(1 - 2 / 19)
    assert window["ids"] == 19 and window["dedup_ratio"] == 1.0
    cold = {k: {**v, "cache_rows": 0} for k, v in files.items()}
    assert trace_pages(_trace([[list(range(16)), [40]], [list(range(17)), [40, 41]]], cold), np.array([1]))[
        "pages"] == 2 + 1


def test_layouts_it_cannot_price_and_a_missing_table_file_are_named():
    with pytest.raises(ValueError, match="/x/values.bin: row_stride=8192"):
        rows_per_page({"values": "/x/values.bin", "row_stride": 8192, "page_size": 8192})
    assert rows_per_page({"values": "v", "row_stride": 256, "page_size": 4096}) == 16
    with pytest.raises(ValueError, match="layer 1 has no table file"):
        trace_pages(_trace([[[1], [2]]], {"0": {"values": "v", "row_stride": 256, "page_size": 4096,
                                                 "cache_rows": 0}}))


def test_bad_trace_paths_and_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_trace_path(tmp_path / "no" / "such" / "t.trace")
    with pytest.raises(ValueError, match="is a directory"):
        check_trace_path(tmp_path)
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"not a trace")
    with pytest.raises(ValueError, match=f"{bad}: byte 0"):
        read_row_trace(bad)
