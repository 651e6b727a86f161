"""The device-side probe of a hot-row cache (store/kernels/cache_probe.py), through its torch reference on the
CPU: the set hash is the host's, the mirror follows every insert, and a probe made at any point of a lookup's
writes (before them, part-way, after) only finds rows whose bytes are in place: the invariant that lets a
decode-graph piece gather without waiting for the host. The Triton kernel against this reference, and its
wait: tests/gpu/test_cache_probe_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.store.cache import RowCache
from engram.store.kernels import cache_probe

VB = 16  # value bytes per row


def _row_bytes(ids: np.ndarray) -> torch.Tensor:
    """The bytes of rows ``ids`` (a function of the id, so any slot's content can be checked)."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return ((ids[:, None] * 31 + torch.arange(VB)) % 251).to(torch.uint8)  # [N, VB]


def _fetch(ids: torch.Tensor):
    return _row_bytes(ids.numpy()), None


def test_the_set_hash_is_the_hosts():
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 2**40, 5000), [0, 1, 2**62, 2**63 - 1]]).astype(np.int64)
    for ways, rows in ((8, 4096), (4, 1000), (1, 7)):
        cache = RowCache(rows, VB, ways=ways)
        assert torch.equal(cache_probe.set_of(torch.from_numpy(ids), cache.n_sets), cache.set_of(torch.from_numpy(ids)))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_probe_at_any_point_of_a_lookups_writes_finds_only_rows_in_place(policy):
    """Each call: the mirror before it (M0) and after it (M1, equal to the host's tags), and mirrors part-way
    (a random subset of the call's tag writes applied to M0; the bytes are written before any tag). A probe of
    the call's ids against M0 finds only slots the call does not write, with the right bytes, and the same
    slots the call returns; against any part-way mirror it finds the right bytes after the call."""
    rng = np.random.default_rng(1)
    cache = RowCache(96, VB, policy=policy, ways=4)
    cache.reserve_overflow(64)
    mirror = cache.mirror_tags()
    found_before = 0
    for call in range(150):
        ids = np.unique(rng.integers(0, 400 if call % 3 else 60, rng.integers(1, 40)))
        m0, bytes0 = mirror.clone(), cache.storage()[0].clone()
        slots = cache.slots_np(ids, _fetch)  # the host's call
        assert torch.equal(mirror, cache.tags)  # the mirror follows the host's tags
        values = cache.storage()[0]
        assert torch.equal(values[torch.from_numpy(slots)], _row_bytes(ids))
        t_ids = torch.from_numpy(ids)
        early = cache_probe.probe(t_ids, m0)  # [U], -1 where not found
        hit = early >= 0
        found_before += int(hit.all())
        assert torch.equal(early[hit], torch.from_numpy(slots)[hit])  # what the host hands out for them
        assert torch.equal(bytes0[early[hit]], values[early[hit]])  # slots the call did not write
        assert torch.equal(values[early[hit]], _row_bytes(ids[hit.numpy()]))
        changed = torch.nonzero((m0 != mirror).reshape(-1)).reshape(-1)
        for _ in range(3):  # part-way: some of the call's tag writes landed
            part = m0.clone().reshape(-1)
            pick = changed[torch.from_numpy(rng.random(len(changed)) < 0.5)]
            part[pick] = mirror.reshape(-1)[pick]
            mid = cache_probe.probe(t_ids, part.view_as(m0))
            ok = mid >= 0
            assert torch.equal(values[mid[ok]], _row_bytes(ids[ok.numpy()]))
            assert bool((ok | ~hit).all())  # found before the writes: still found
    assert found_before > 0  # some calls were all hits, which a piece serves without the host


def test_resolve_slots_reference_statuses():
    cache = RowCache(64, VB, ways=4)
    cache.reserve_overflow(8)
    tags = cache.mirror_tags()
    cache.slots_np(np.array([3, 5, 7], dtype=np.int64), _fetch)
    host = torch.tensor([11, 12, 13, 14], dtype=torch.int64)  # stands for the host's slots of a later call
    flag, plan = torch.tensor([-1]), torch.tensor([4])
    out, status = torch.full((4,), -7, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)

    def resolve(ids):
        return cache_probe.resolve_slots(torch.tensor(ids, dtype=torch.int64), tags, host, flag, plan, out, status)

    resolve([5, -1, 3, 7])  # all found; padding gets slot 0 and does not wait
    assert int(status) == cache_probe.FOUND
    assert out.tolist() == [int(cache.lookup(torch.tensor([5]))), 0, int(cache.lookup(torch.tensor([3]))),
                            int(cache.lookup(torch.tensor([7])))]
    resolve([5, 9, 3, 7])  # 9 missing, the flag not yet set: the reference cannot wait
    assert int(status) == cache_probe.FAILED
    cache_probe.signal(flag, 3)  # an older step's flag does not count
    resolve([5, 9, 3, 7])
    assert int(status) == cache_probe.FAILED
    cache_probe.signal(flag, 4)
    resolve([5, 9, 3, 7])
    assert int(status) == cache_probe.WAITED and out.tolist() == host.tolist()
    cache_probe.signal(flag, 4, ok=False)
    resolve([5, 9, 3, 7])
    assert int(status) == cache_probe.FAILED


def test_clear_empties_the_mirror():
    cache = RowCache(32, VB, ways=4)
    cache.reserve_overflow(8)
    cache.slots_np(np.arange(5, dtype=np.int64), _fetch)
    mirror = cache.mirror_tags()
    assert int((mirror >= 0).sum()) == 5
    cache.clear()
    assert bool((mirror == -1).all()) and torch.equal(mirror, cache.tags)
    assert (cache_probe.probe(torch.arange(5), mirror) == -1).all()
