"""RowCache: returned rows never depend on the cache; LRU/LFU eviction order; counters; invariants."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.store.cache import RowCache

ROWS, VB, SC = 5000, 16, 2
TABLE = torch.randint(0, 256, (ROWS, VB), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
SCALES = torch.randint(0, 256, (ROWS, SC), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


class Backing:
    """The slow tier: counts what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[torch.Tensor] = []

    def __call__(self, ids: torch.Tensor):
        self.asked.append(ids.clone())
        pad = torch.full((ids.numel(), 4), 0xEE, dtype=torch.uint8)  # stride padding the cache must drop
        return torch.cat([TABLE[ids], pad], dim=1), SCALES[ids]


def _check_invariants(c: RowCache) -> None:
    tags = c.tags
    for s in range(c.n_sets):
        live = tags[s][tags[s] >= 0]
        assert live.unique().numel() == live.numel(), f"set {s} holds an id twice"
        assert torch.all(c.set_of(live) == s), f"set {s} holds an id of another set"
    slots = (tags >= 0).nonzero()
    for s, w in slots.tolist():
        r = int(tags[s, w])
        assert torch.equal(c.values[s * c.ways + w], TABLE[r]) and torch.equal(c.scales[s * c.ways + w], SCALES[r])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity,ways", [(1, 8), (7, 8), (64, 8), (256, 4), (100, 1), (6000, 16)])
def test_cache_never_changes_rows(policy, capacity, ways):
    c = RowCache(capacity, VB, SC, policy=policy, ways=ways)
    rng = np.random.default_rng(capacity)
    for step in range(40):
        ids = torch.from_numpy(np.unique(np.minimum(rng.zipf(1.3, 300), ROWS) - 1))  # skewed, distinct
        vals, scales = c.fetch(ids, Backing())
        assert torch.equal(vals, TABLE[ids]) and torch.equal(scales, SCALES[ids]), step
    _check_invariants(c)
    assert len(c) <= c.capacity


def test_counters_and_only_misses_reach_backing():
    c = RowCache(64, VB, SC)
    back = Backing()
    ids = torch.arange(0, 40)
    c.fetch(ids, back)
    assert c.counters() == {"hits": 0, "misses": 40, "evictions": 0}
    c.fetch(torch.arange(20, 50), back)  # 20 hits, 10 new
    assert c.hits == 20 and c.misses == 50
    assert torch.equal(back.asked[-1], torch.arange(40, 50))
    c.reset_counters()
    assert c.counters() == {"hits": 0, "misses": 0, "evictions": 0}
    c.clear()
    assert len(c) == 0


def test_lru_evicts_least_recently_used():
    c = RowCache(4, VB, SC, policy="lru", ways=4)  # one set: full associativity
    back = Backing()
    for r in (10, 11, 12, 13):
        c.fetch(torch.tensor([r]), back)
    c.fetch(torch.tensor([10]), back)  # 10 is now the most recent, 11 the least
    c.fetch(torch.tensor([14]), back)
    cached = set(c.tags[c.tags >= 0].tolist())
    assert cached == {10, 12, 13, 14} and c.evictions == 1
    c.fetch(torch.tensor([15]), back)
    assert set(c.tags[c.tags >= 0].tolist()) == {10, 13, 14, 15}


@pytest.mark.parametrize("policy,survives", [("lfu", True), ("lru", False)])
def test_lfu_keeps_frequent_rows_and_ages(policy, survives):
    c = RowCache(4, VB, SC, policy=policy, ways=4)
    back = Backing()
    c.fetch(torch.tensor([1, 2, 3, 4]), back)
    for _ in range(6):
        c.fetch(torch.tensor([1]), back)  # 1 is hot
    for r in (5, 6, 7, 8):  # a scan of cold rows: LRU loses the hot row, LFU keeps it
        c.fetch(torch.tensor([r]), back)
    assert (1 in c.tags.tolist()[0]) == survives
    if policy == "lru":
        return
    before = int(c.freq.max())
    c.fetch(torch.arange(100, 104), back)  # 4 more rows looked up: a full capacity since the last halving
    assert int(c.freq.max()) < before


def test_rows_touched_in_a_call_are_not_evicted_by_it():
    c = RowCache(2, VB, SC, policy="lru", ways=2)  # one set of two ways
    back = Backing()
    c.fetch(torch.tensor([1, 2]), back)
    vals, _ = c.fetch(torch.tensor([1, 2, 3, 4]), back)  # both ways hit: 3 and 4 are served, not cached
    assert torch.equal(vals, TABLE[[1, 2, 3, 4]])
    assert sorted(c.tags[0].tolist()) == [1, 2] and c.evictions == 0


def test_set_overflow_in_one_call_is_served():
    c = RowCache(8, VB, SC, ways=2)  # 4 sets of 2
    ids = torch.arange(0, 500)
    vals, scales = c.fetch(ids, Backing())
    assert torch.equal(vals, TABLE[ids]) and torch.equal(scales, SCALES[ids])
    assert len(c) == 8  # every set filled, the rest served only
    _check_invariants(c)


def test_empty_lookup_and_sizes():
    c = RowCache(10, VB, SC, ways=4)
    assert c.capacity == 8 and c.n_sets == 2  # rounded down to whole sets
    vals, scales = c.fetch(torch.zeros(0, dtype=torch.int64), Backing())
    assert vals.shape == (0, VB) and scales.shape == (0, SC)
    assert RowCache.rows_for_bytes(RowCache.bytes_for_rows(1000, VB, SC), VB, SC) == 1000
    for bad in (dict(capacity_rows=0), dict(policy="fifo"), dict(ways=0)):
        with pytest.raises(ValueError):
            RowCache(**{"capacity_rows": 4, "value_bytes": VB, **bad})


def test_lookup_is_pure_and_vectorized_over_large_batches():
    c = RowCache(4096, VB, 0)
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(3))[:3000]
    c.fetch(ids, lambda i: (TABLE[i], None))
    slots = c.lookup(ids)
    assert int((slots >= 0).sum()) == len(c) and len(c) > 2500  # most fit on the first pass
    hit = slots >= 0
    assert torch.equal(c.values[slots[hit]], TABLE[ids[hit]])
    stamp = c.stamp.clone()
    c.lookup(ids)
    assert torch.equal(stamp, c.stamp)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 199), max_size=60), min_size=1, max_size=12),
       st.sampled_from(["lru", "lfu"]), st.integers(1, 40), st.integers(1, 8))
def test_property_cache_is_transparent(batches, policy, capacity, ways):
    c = RowCache(capacity, VB, SC, policy=policy, ways=ways)
    hits = misses = 0
    for b in batches:
        ids = torch.tensor(sorted(set(b)), dtype=torch.int64)
        before = c.lookup(ids)
        vals, scales = c.fetch(ids, Backing())
        assert torch.equal(vals, TABLE[ids]) and torch.equal(scales, SCALES[ids])
        hits += int((before >= 0).sum())
        misses += int((before < 0).sum())
    assert (c.hits, c.misses) == (hits, misses)
    _check_invariants(c)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity,ways", [(1, 8), (7, 8), (64, 8), (100, 1), (6000, 16)])
def test_slots_point_at_the_rows_fetch_returns_and_count_the_same(policy, capacity, ways):
    """slots(): every id's row is at its slot of storage() (small caches spill into the overflow rows), and
    the cache decides hits, misses and victims exactly as fetch() would on the same calls."""
    by_slots, by_fetch = (RowCache(capacity, VB, SC, policy=policy, ways=ways) for _ in range(2))
    by_slots.reserve_overflow(300)
    rng = np.random.default_rng(capacity)
    spilled = 0
    for step in range(40):
        ids = torch.from_numpy(np.unique(np.minimum(rng.zipf(1.3, 300), ROWS) - 1))  # skewed, distinct
        where = by_slots.slots(ids, Backing())
        values, scales = by_slots.storage()
        assert torch.equal(values[where], TABLE[ids]) and torch.equal(scales[where], SCALES[ids]), step
        spilled += int((where >= by_slots.capacity).sum())
        by_fetch.fetch(ids, Backing())
        assert by_slots.counters() == by_fetch.counters() and torch.equal(by_slots.tags, by_fetch.tags), step
    _check_invariants(by_slots)
    assert (spilled > 0) == (capacity < 300)  # a call of more distinct ids than the cache holds spills


def test_slots_refuses_more_ids_than_its_overflow_and_storage_does_not_move_once_handed_out():
    c = RowCache(64, VB, SC)
    with pytest.raises(ValueError, match="41 ids in one call, but the cache reserved 0 overflow rows"):
        c.slots(torch.arange(41), Backing())
    c.reserve_overflow(40)
    c.slots(torch.arange(40), Backing())
    c.reserve_overflow(40)  # no growth: fine
    values, _ = c.storage()
    assert values.shape == (64 + 40, VB)
    with pytest.raises(RuntimeError, match="would move it under its readers"):
        c.reserve_overflow(41)


def _reference_call(tags, stamp, freq, clock, ids, n_sets, ways, policy, set_of):
    """One lookup call of the set-associative cache, row by row in plain Python (the policy as cache.py's
    docstring states it): touch the hits; then the misses, in order within their set, take that set's ways in
    eviction order (empty first, then by key), as long as the way was not touched by this call. Returns each
    id's slot (-1: served, not cached) and the evictions; updates the lists in place."""
    slot_of, evicted = {}, 0
    for i in ids:
        s = set_of(i)
        if i in tags[s]:
            w = tags[s].index(i)
            stamp[s][w], freq[s][w] = clock, freq[s][w] + 1
            slot_of[i] = s * ways + w
    by_set: dict[int, list[int]] = {}
    for i in ids:
        if i not in slot_of:
            by_set.setdefault(set_of(i), []).append(i)
    for s, missed in by_set.items():
        key = [-1 if tags[s][w] < 0 else stamp[s][w] if policy == "lru" else (freq[s][w] << 40) | stamp[s][w]
               for w in range(ways)]
        order = sorted(range(ways), key=lambda w: key[w])  # stable: ties by way
        snapshot = [stamp[s][w] for w in range(ways)]
        for rank, i in enumerate(missed):
            w = order[min(rank, ways - 1)]
            if rank >= ways or snapshot[w] == clock:
                slot_of[i] = -1
                continue
            evicted += tags[s][w] >= 0
            tags[s][w], stamp[s][w], freq[s][w] = i, clock, 1
            slot_of[i] = s * ways + w
    return [slot_of[i] for i in ids], evicted


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity,ways", [(8, 8), (64, 4), (96, 8), (50, 1)])
def test_vectorized_policy_equals_the_row_by_row_reference(policy, capacity, ways):
    """slots() (numpy, vectorized) against the plain-Python policy: the same slot for every id, the same tags,
    stamps and counts after every call, the same evictions; small caches so sets overflow within a call."""
    c = RowCache(capacity, VB, SC, policy=policy, ways=ways)
    c.reserve_overflow(200)
    tags = [[-1] * c.ways for _ in range(c.n_sets)]
    stamp = [[0] * c.ways for _ in range(c.n_sets)]
    freq = [[0] * c.ways for _ in range(c.n_sets)]
    rng = np.random.default_rng(capacity * ways)
    total_evicted = 0
    for call in range(1, 60):
        ids = np.unique(np.minimum(rng.zipf(1.4, int(rng.integers(1, 200))), ROWS) - 1)
        where = c.slots(torch.from_numpy(ids), Backing())
        expect, evicted = _reference_call(tags, stamp, freq, call, ids.tolist(), c.n_sets, c.ways, policy,
                                          lambda i: int(c.set_of(torch.tensor([i]))[0]))
        got = where.tolist()
        assert [g if g < c.capacity else -1 for g in got] == expect, call
        assert c.tags.tolist() == tags and c.stamp.tolist() == stamp, call
        if policy == "lfu" and c._since_aging == 0:  # aging halves the counts after this call
            freq = [[f >> 1 for f in row] for row in freq]
        assert c.freq.tolist() == freq, call
        total_evicted += evicted
        assert c.evictions == total_evicted, call
    assert total_evicted > 0
