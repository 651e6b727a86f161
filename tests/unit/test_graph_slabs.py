"""engine/graph_slabs.py's ``SlabSteps`` on the CPU, the real mixin over real disk tables with hot-row caches
and probed slabs (DecodeGraphs without its CUDA state): a step's lookups, then caching the rows they read after
the step's last lookup. Every decode gives the table's rows, the caches hold the rows read, and
``last_step_read`` says whether a step read from disk. The streams and events: the GPU test
tests/gpu/test_piecewise_graphs.py."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from engram.engine.cuda_graphs import DecodeGraphs
from engram.store.cache import RowCache
from engram.store.kernels import cache_probe

LAYERS = (1, 3)


class _Staged:
    """A step's staged rows as the executor's: asking for a slab layer's rows runs its probed lookup (pages
    into the slab, the plan, the flag). Logs what each table's cache held when each lookup ran."""

    def __init__(self, graphs, ids: dict, log: list):
        self.graphs, self.ids, self.log = graphs, ids, log
        self.released = False

    def rows(self, lid: int, step_id: int) -> None:
        self.log.append((step_id, lid, {t: len(self.graphs.slab_tables[t].cache) for t in LAYERS}))
        self.graphs.slab_tables[lid].read_slab(self.ids[lid], self.graphs.slabs[lid], plan=step_id)

    def release(self) -> None:
        self.released = True


def _graphs(tables: dict) -> DecodeGraphs:
    """A DecodeGraphs with only what SlabSteps uses: a probed slab per layer, no CUDA state."""
    graphs = object.__new__(DecodeGraphs)
    graphs.slab_tables = tables
    graphs.slabs = {lid: t.new_slab(16) for lid, t in tables.items()}
    graphs.probed = list(LAYERS)
    graphs.ranges = [(0, 1, None), (1, 2, 1), (2, 4, 3)]  # a piece without an Engram layer, then one a layer
    graphs._slab_decoded = {lid: [None, None] for lid in LAYERS}
    graphs._slab_turn, graphs.last_step_read = 0, True
    return graphs


@pytest.fixture
def table_dirs(tmp_path):
    from engram.store.writer import write_table
    from tests.unit.test_disk import make_rows

    refs = {}
    for lid in LAYERS:
        vals, scales, refs[lid] = make_rows(2000, 256, "mxfp8", seed=lid)
        write_table(tmp_path / f"layer{lid}", vals, scales)
    return tmp_path, refs


# per step, each layer's row ids: new rows for both, then new rows for layer 1 only, then nothing new
STEPS = [{1: [5, 9, 5, 700, 41], 3: [8, 1500, 8, 77]}, {1: [5, 1999, 3], 3: [77, 8]}, {1: [3, 9], 3: [1500]}]


def test_rows_cached_after_the_last_lookup_fill_the_caches_with_the_rows_read(table_dirs, monkeypatch):
    """Rows cached at ``finish_lookups`` (late caching, the default, off: tests/unit/test_late_caching.py and
    test_worker_slab_steps.py cover it)."""
    from engram.store import late_caching
    from engram.store.disk import open_disk_table

    monkeypatch.setattr(late_caching, "DEFER", False)

    root, refs = table_dirs
    tables = {lid: open_disk_table(root / f"layer{lid}", io="buffered", cache=RowCache(64, 256, 8, ways=4))
              for lid in LAYERS}
    try:
        graphs, log, read = _graphs(tables), [], []
        for step_id, ids in enumerate(STEPS, start=1):
            ids = {lid: torch.tensor(v, dtype=torch.int64) for lid, v in ids.items()}
            staged = _Staged(graphs, ids, log)
            graphs.read_lookups(types.SimpleNamespace(step_id=step_id), staged)
            assert staged.released
            for lid in LAYERS:  # what the pieces decode, following the step's plan: the table's rows
                out = torch.empty(len(ids[lid]), 256)
                status = torch.zeros(1, dtype=torch.int32)
                tables[lid].decode_slab(graphs.slabs[lid], len(ids[lid]), out, ids=ids[lid],
                                        plan=torch.tensor([step_id]), status=status)
                assert int(status) != cache_probe.FAILED
                assert torch.equal(out.view(torch.uint8), refs[lid](ids[lid], torch.float32).view(torch.uint8))
            graphs.finish_lookups()
            read.append(graphs.last_step_read)
        # layer 3's lookup of a step comes before layer 1's rows of that step are cached
        first = {step: held[1] for step, lid, held in log if lid == 3}
        assert first[1] == 0
        assert read == [True, True, False]  # step 2 read for layer 1 only; step 3 found every row cached
        assert [len(t.cache) for t in tables.values()] == [6, 3]
        assert all(t.stats()["misses"] == {1: 6, 3: 3}[lid] for lid, t in tables.items())
        for lid, t in tables.items():  # the caches hold the rows read (step 3's decode above found their bytes)
            rows = np.array(sorted({r for step in STEPS for r in step[lid]}))
            assert len(rows) == len(t.cache) and np.isin(rows, t.cache.tags.numpy()).all()
    finally:
        for t in tables.values():
            t.close()


def test_a_failed_later_lookup_fails_the_waiting_pieces_and_the_first_layers_rows_are_still_cached(table_dirs,
                                                                                                  monkeypatch):
    """The second layer's lookup fails: the failure reaches the caller, the pieces still waiting are failed
    (their flags), and finishing the step caches the rows the first layer's lookup read, once (cached at
    ``finish_lookups``: rows held for late caching and never handed over are tests/unit/test_late_caching.py's)."""
    from engram.store import late_caching
    from engram.store.disk import open_disk_table

    monkeypatch.setattr(late_caching, "DEFER", False)

    root, _ = table_dirs
    tables = {lid: open_disk_table(root / f"layer{lid}", io="buffered", cache=RowCache(64, 256, 8, ways=4))
              for lid in LAYERS}
    try:
        graphs = _graphs(tables)
        staged = _Staged(graphs, {1: torch.tensor([4, 6]), 3: torch.tensor([2000])}, [])  # row 2000: out of range
        with pytest.raises(Exception, match="2000"):
            graphs.read_lookups(types.SimpleNamespace(step_id=1), staged)
        assert int(graphs.slabs[3].probe.flag) == 2 * 1 + 1  # layer 3's piece gives up instead of waiting
        assert len(tables[1].cache) == 0
        graphs.finish_lookups()
        assert graphs.last_step_read and len(tables[1].cache) == 2 and len(tables[3].cache) == 0
        graphs.finish_lookups()  # nothing pending: nothing cached twice
        assert not graphs.last_step_read and len(tables[1].cache) == 2
    finally:
        for t in tables.values():
            t.close()
