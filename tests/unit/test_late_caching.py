"""store/late_caching.py on the CPU over real disk tables: a probed slab's rows cached during the table's next
probed lookup (after its cache split) instead of at ``admit_probed``; that lookup's hits survive the
evictions; an id both lookups missed is cached once; rows never handed over are cached before any other use
of the cache; and the decode gives the table's rows bitwise throughout. The GPU side (UVA gathers, streams):
tests/gpu/test_piecewise_graphs.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engram.store.cache import RowCache


@pytest.fixture
def table(tmp_path):
    """(a disk table of 3,001 MXFP8 rows behind a cache of one set of 8 ways, its rows' reference)."""
    from engram.store.disk import open_disk_table
    from engram.store.writer import write_table
    from tests.unit.test_disk import make_rows

    vals, scales, ref = make_rows(3001, 256, "mxfp8")
    write_table(tmp_path / "mx", vals, scales)
    with open_disk_table(tmp_path / "mx", io="buffered", cache=RowCache(8, 256, 8, ways=8)) as t:
        yield t, ref


def step(t, slab, ref, ids: list[int], plan: int) -> int:
    """One probed lookup, its decode checked bitwise against the table, then admit_probed; returns the rows
    it read."""
    ids = torch.tensor(ids, dtype=torch.int64)
    t.read_slab(ids, slab, plan=plan)
    want = ref(ids, torch.float32)
    out = torch.empty(len(ids), want.shape[1])
    t.decode_slab(slab, len(ids), out, ids=ids, plan=torch.tensor([plan]), status=torch.zeros(1, dtype=torch.int32))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    return t.admit_probed(slab)


def cached(t, ids: list[int]) -> list[bool]:
    return (t.cache.lookup(torch.tensor(ids)) >= 0).tolist()


def caching_threads(t) -> list[str]:
    """The threads each caching of held rows runs on, from now on (their names' first part)."""
    threads: list[str] = []
    real = t.slab_reader.late._cache

    def recorded(rows):
        threads.append(threading.current_thread().name.split("_")[0])
        return real(rows)

    t.slab_reader.late._cache = recorded
    return threads


def test_rows_are_cached_during_the_next_lookup_and_its_hits_survive(table):
    t, ref = table
    slab = t.new_slab(16)
    threads = caching_threads(t)
    assert step(t, slab, ref, [1, 2, 3, 4, 5, 6, 7, 8], plan=1) == 8  # held, not cached yet
    assert cached(t, [1, 8]) == [False, False]
    assert step(t, slab, ref, [1], plan=2) == 1  # step 1's rows cached after this split: 1 missed again
    assert all(cached(t, [1, 2, 3, 4, 5, 6, 7, 8]))  # that caching ended before step 2's admit_probed did
    # the set is full: caching step 3's six misses must evict six ways, and step 4's hits (2, 3) are
    # stamped by its split before the caching of step 3's rows runs, so those six are the others
    assert step(t, slab, ref, [100, 101, 102, 103, 104, 105], plan=3) == 6
    assert step(t, slab, ref, [2, 3, 100], plan=4) == 1
    t.slab_reader.late.settle()
    assert cached(t, [2, 3]) == [True, True] and sum(cached(t, [1, 4, 5, 6, 7, 8])) == 0
    assert all(cached(t, [100, 101, 102, 103, 104, 105]))
    assert len(t.cache) == 8 and len(set(t.cache.tags.reshape(-1).tolist())) == 8  # 100 cached once
    assert t.stats()["misses"] == 8 + 1 + 6 + 1
    assert threads == ["engram-late-caching"] * 3 + ["MainThread"]  # handed over by steps 2-4; step 4's here


def test_rows_never_handed_over_are_cached_before_any_other_use_of_the_cache(table):
    t, ref = table
    slab = t.new_slab(16)
    threads = caching_threads(t)
    step(t, slab, ref, [10, 11], plan=1)
    assert cached(t, [10, 11]) == [False, False]
    rows = t.gather(torch.tensor([10, 12]), dtype=torch.float32)  # a chunked gather through the cache
    assert torch.equal(rows.view(torch.uint8), ref(torch.tensor([10, 12]), torch.float32).view(torch.uint8))
    assert cached(t, [10, 11, 12]) == [True, True, True]
    assert t.stats()["hits"] == 1  # 10, cached by the settle before the gather's own lookup
    assert threads == ["MainThread"]


def test_a_next_lookup_that_fails_before_its_split_leaves_the_rows_for_the_next_settle(table):
    t, ref = table
    slab = t.new_slab(16)
    step(t, slab, ref, [20, 21], plan=1)
    with pytest.raises(IndexError, match="row id -1"):
        t.read_slab(torch.tensor([-1]), slab, plan=2)  # refused before any split
    assert cached(t, [20, 21]) == [False, False]
    assert step(t, slab, ref, [20], plan=3) == 1  # handed over after this split
    t.slab_reader.late.settle()
    assert cached(t, [20, 21]) == [True, True]
    assert int(slab.probe.flag) == 2 * 3


def test_admit_rechecking_skips_ids_cached_since_the_calls_split():
    cache = RowCache(16, 4, ways=4)
    ids = np.array([3, 5], dtype=np.int64)
    cache.split(ids)
    cache.admit(ids, torch.full((2, 4), 7, dtype=torch.uint8), None, 2)
    cache.split(np.array([5, 9], dtype=np.int64))
    cache.admit(np.array([5, 9], dtype=np.int64), torch.tensor([[1] * 4, [2] * 4], dtype=torch.uint8), None, 2,
                recheck=True)
    tags = cache.tags.reshape(-1).tolist()
    assert tags.count(5) == 1 and tags.count(9) == 1
    assert cache.values[int(cache.lookup(torch.tensor([5])))].tolist() == [7] * 4  # the first bytes stay
    assert cache.values[int(cache.lookup(torch.tensor([9])))].tolist() == [2] * 4
    assert cache.misses == 4


def test_a_caching_that_fails_on_its_thread_is_raised_where_it_is_settled(table):
    t, ref = table
    slab = t.new_slab(16)
    real = t.slab_reader.late._cache

    def failing(rows):
        raise RuntimeError("planted caching failure")

    t.slab_reader.late._cache = failing
    step(t, slab, ref, [40, 41], plan=1)
    t.read_slab(torch.tensor([42]), slab, plan=2)  # hands step 1's rows over: they fail on the thread
    t.slab_reader.late._cache = real
    with pytest.raises(RuntimeError, match="planted caching failure"):
        t.admit_probed(slab)
    assert cached(t, [40, 41]) == [False, False]  # dropped: read again when asked for
    assert step(t, slab, ref, [40, 42], plan=3) == 2  # the table goes on
    t.slab_reader.late.settle()
    assert cached(t, [40, 42]) == [True, True]


def test_an_id_two_lookups_missed_is_cached_once_with_room_to_spare(table):
    """The set has free ways, so a second copy of id 50 would find one: the late caching rechecks."""
    t, ref = table
    slab = t.new_slab(16)
    step(t, slab, ref, [50, 51], plan=1)
    assert step(t, slab, ref, [50], plan=2) == 1  # missed again: step 1's rows are cached after this split
    step(t, slab, ref, [52], plan=3)  # hands step 2's [50] over: already cached
    t.slab_reader.late.settle()
    assert t.cache.tags.reshape(-1).tolist().count(50) == 1 and len(t.cache) == 3
