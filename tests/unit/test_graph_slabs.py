"""engine/runners/pieces.py's ``DecodePieces`` on the CPU, its lookup half (``read_lookups``,
``finish_lookups``, ``abort_lookups``) over real disk tables with hot-row caches and probed slabs, without its
CUDA state: a step's lookups, then taking the rows they read out of the slabs after the step's last lookup, to
be cached during the tables' next lookups (store/late_caching.py). Every decode gives the table's rows, the
caches hold the rows read, and ``last_step_read`` says whether a step read from disk. The streams and events:
the GPU test tests/gpu/test_piecewise_graphs.py."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from engram.engine.runners.pieces import DecodePieces
from engram.store.cache import RowCache
from engram.store.kernels import cache_probe

LAYERS = (1, 3)


class _Staged:
    """A step's staged rows as the executor's: asking for a slab layer's rows runs its probed lookup (pages
    into the slab, the plan, the flag). Logs what each table's cache held when each lookup ran."""

    def __init__(self, pieces, ids: dict, log: list):
        self.pieces, self.ids, self.log = pieces, ids, log
        self.released = False

    def rows(self, lid: int, step_id: int) -> None:
        self.log.append((step_id, lid, {t: len(self.pieces.slab_tables[t].cache) for t in LAYERS}))
        self.pieces.slab_tables[lid].read_slab(self.ids[lid], self.pieces.slabs[lid], plan=step_id)

    def release(self) -> None:
        self.released = True


def _pieces(tables: dict) -> DecodePieces:
    """A DecodePieces with only what its lookups use: a probed slab per layer, no CUDA state."""
    pieces = object.__new__(DecodePieces)
    pieces.slab_tables = tables
    pieces.slabs = {lid: t.new_slab(16) for lid, t in tables.items()}
    pieces.probed = list(LAYERS)
    pieces.ranges = [(0, 1, None), (1, 2, 1), (2, 4, 3)]  # a piece without an Engram layer, then one a layer
    pieces._slab_decoded = {lid: [None, None] for lid in LAYERS}
    pieces._slab_turn, pieces.last_step_read = 0, True
    return pieces


@pytest.fixture
def table_dirs(tmp_path):
    from engram.store.writer import write_table
    from tests.unit.test_disk import make_rows

    refs = {}
    for lid in LAYERS:
        vals, scales, refs[lid] = make_rows(2000, 256, "mxfp8", seed=lid)
        write_table(tmp_path / f"layer{lid}", vals, scales)
    return tmp_path, refs


# per step, each layer's row ids: new rows for both, then new rows for layer 1 only, then rows read by the step
# before (cached during this step's lookup, after its split: read again), then nothing new
STEPS = [{1: [5, 9, 5, 700, 41], 3: [8, 1500, 8, 77]}, {1: [5, 1999, 3], 3: [77, 8]}, {1: [3, 9], 3: [1500]},
         {1: [3, 9], 3: [1500]}]


def test_rows_cached_during_the_next_lookup_fill_the_caches_with_the_rows_read(table_dirs):
    """A step's rows are taken out at ``finish_lookups`` and cached during the tables' next probed lookups,
    after their splits (tests/unit/test_late_caching.py: the order inside one table)."""
    from engram.store.disk import open_disk_table

    root, refs = table_dirs
    tables = {lid: open_disk_table(root / f"layer{lid}", io="buffered", cache=RowCache(64, 256, 8, ways=4))
              for lid in LAYERS}
    try:
        pieces, log, read = _pieces(tables), [], []
        for step_id, ids in enumerate(STEPS, start=1):
            ids = {lid: torch.tensor(v, dtype=torch.int64) for lid, v in ids.items()}
            staged = _Staged(pieces, ids, log)
            pieces.read_lookups(types.SimpleNamespace(step_id=step_id), staged)
            assert staged.released
            for lid in LAYERS:  # what the pieces decode, following the step's plan: the table's rows
                out = torch.empty(len(ids[lid]), 256)
                status = torch.zeros(1, dtype=torch.int32)
                tables[lid].decode_slab(pieces.slabs[lid], len(ids[lid]), out, ids=ids[lid],
                                        plan=torch.tensor([step_id]), status=status)
                assert int(status) != cache_probe.FAILED
                assert torch.equal(out.view(torch.uint8), refs[lid](ids[lid], torch.float32).view(torch.uint8))
            pieces.finish_lookups()
            read.append(pieces.last_step_read)
        held = {(step, lid): cached for step, lid, cached in log}  # the caches' sizes when each lookup ran
        # nothing is cached by a step's own lookups: layer 3's lookup of step 1 comes before any row is cached,
        # and step 1's rows wait for step 2's lookups, whose split comes first (the log is taken before it)
        assert held[1, 3] == {1: 0, 3: 0} and held[2, 1] == {1: 0, 3: 0}
        assert held[3, 1] == {1: 4, 3: 3}  # step 1's rows, cached during step 2's lookups; step 2's still held
        assert read == [True, True, True, False]  # step 3 read 3 again (held at its split); step 4 found all
        assert [len(t.cache) for t in tables.values()] == [6, 3]  # an id read twice is cached once
        assert all(t.stats()["misses"] == {1: 4 + 3 + 1, 3: 3 + 2}[lid] for lid, t in tables.items())
        for lid, t in tables.items():  # the caches hold the rows read (step 4's decode above found their bytes)
            rows = np.array(sorted({r for step in STEPS for r in step[lid]}))
            assert len(rows) == len(t.cache) and np.isin(rows, t.cache.tags.numpy()).all()
    finally:
        for t in tables.values():
            t.close()


def test_a_failed_later_lookup_fails_the_waiting_pieces_and_the_first_layers_rows_are_still_cached(table_dirs):
    """The second layer's lookup fails: the failure reaches the caller, the pieces still waiting are failed
    (their flags), and finishing the step takes out the rows the first layer's lookup read, which are cached
    once, before any other use of the cache (here the next ``finish_lookups``, with no lookup between)."""
    from engram.store.disk import open_disk_table

    root, _ = table_dirs
    tables = {lid: open_disk_table(root / f"layer{lid}", io="buffered", cache=RowCache(64, 256, 8, ways=4))
              for lid in LAYERS}
    try:
        pieces = _pieces(tables)
        staged = _Staged(pieces, {1: torch.tensor([4, 6]), 3: torch.tensor([2000])}, [])  # row 2000: out of range
        with pytest.raises(Exception, match="2000"):
            pieces.read_lookups(types.SimpleNamespace(step_id=1), staged)
        assert int(pieces.slabs[3].probe.flag) == 2 * 1 + 1  # layer 3's piece gives up instead of waiting
        assert len(tables[1].cache) == 0
        pieces.finish_lookups()
        assert pieces.last_step_read and len(tables[1].cache) == 0 and len(tables[3].cache) == 0  # held
        pieces.finish_lookups()  # nothing pending: the held rows cached, nothing cached twice
        assert not pieces.last_step_read and len(tables[1].cache) == 2 and len(tables[3].cache) == 0
        assert (tables[1].cache.lookup(torch.tensor([4, 6])) >= 0).all()
    finally:
        for t in tables.values():
            t.close()
