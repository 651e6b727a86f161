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
    host = torch.tensor([[11, 12, 13, 14], [0, 2, 0, 0], [-1, 1, -1, -1]])  # a later call's plan: 9 read
    flag, plan = torch.tensor([-1]), torch.tensor([4])
    out, status = torch.full((3, 4), -7, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)

    def resolve(ids):
        return cache_probe.resolve_slots(torch.tensor(ids, dtype=torch.int64), tags, host, flag, plan, out, status)

    resolve([5, -1, 3, 7])  # all found; padding gets slot 0 and does not wait
    assert int(status) == cache_probe.FOUND
    slot = {i: int(cache.lookup(torch.tensor([i]))) for i in (3, 5, 7)}
    assert out.tolist() == [[slot[5], 0, slot[3], slot[7]], [0, 0, 0, 0], [-1, -1, -1, -1]]
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


@pytest.mark.parametrize("cache_rows", [2, 64], ids=["spilling", "holding"])
def test_a_probed_slab_read_signals_its_plan_or_its_failure(tmp_path, cache_rows):
    """A probed slab's lookup (SlabReader._read_probed) writes the step's plan and signals the flag: cached rows
    by slot, the others read into the slab's pages, taken out by ``admit_probed`` and held for late caching
    (store/late_caching.py: cached during the next probed lookup, or here at once by ``settle``, the order
    tests/unit/test_late_caching.py covers). The decode gives the table's rows bitwise (MXFP8 rows: their
    scales too): it follows the plan (cached rows from the storage, the rest from the pages) until a cache that
    holds the rows finds them all on the second step. A read that fails (a corrupt page) signals the failure,
    so a waiting piece gives up instead of hanging."""
    from engram.store.disk import open_disk_table
    from engram.store.writer import write_table
    from tests.unit.test_disk import make_rows

    d = tmp_path / "mx"
    vals, scales, ref = make_rows(3001, 256, "mxfp8")
    write_table(d, vals, scales)
    with open_disk_table(d, io="buffered", cache=RowCache(cache_rows, 256, 8, ways=2)) as t:
        slab = t.new_slab(32)
        ids = torch.tensor([5, 9, 5, 2000, 7, 9, 100], dtype=torch.int64)
        want = ref(ids, torch.float32)
        for step in (3, 4):
            found = cache_rows > 2 and step == 4
            t.read_slab(ids, slab, plan=step)
            assert int(slab.probe.flag) == 2 * step
            out = torch.empty(len(ids), want.shape[1])
            status = torch.zeros(1, dtype=torch.int32)
            t.decode_slab(slab, len(ids), out, ids=ids, plan=torch.tensor([step]), status=status)
            assert int(status) == (cache_probe.FOUND if found else cache_probe.WAITED)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
            read = t.admit_probed(slab)  # the rows read are taken out to be cached; how many were read
            assert (read == 0) == found
            t.slab_reader.late.settle()  # the rows held cached now, before the next lookup's split
        t.pages.crcs = t.pages.crcs.copy()
        t.pages.crcs[1] ^= 1  # page 1 (rows 16..31) no longer matches its checksum
        t.cache.clear()
        with pytest.raises(Exception, match="page 1 "):
            t.read_slab(torch.tensor([20, 5]), slab, plan=5)
        assert int(slab.probe.flag) == 2 * 5 + 1


def test_clear_empties_the_mirror():
    cache = RowCache(32, VB, ways=4)
    cache.reserve_overflow(8)
    cache.slots_np(np.arange(5, dtype=np.int64), _fetch)
    mirror = cache.mirror_tags()
    assert int((mirror >= 0).sum()) == 5
    cache.clear()
    assert bool((mirror == -1).all()) and torch.equal(mirror, cache.tags)
    assert (cache_probe.probe(torch.arange(5), mirror) == -1).all()


def test_a_probed_lookup_never_admitted_is_counted_and_its_rows_dropped(tmp_path):
    """A step that failed after its lookup never admits its rows: the table's next probed lookup counts it
    (hits and misses) and goes on; the rows it read are not cached. The admitted lookup's rows are cached
    late (store/late_caching.py), and it is counted when they are: after the settle here."""
    from engram.store.disk import open_disk_table
    from engram.store.writer import write_table
    from tests.unit.test_disk import make_rows

    d = tmp_path / "mx"
    vals, scales, ref = make_rows(300, 256, "mxfp8")
    write_table(d, vals, scales)
    with open_disk_table(d, io="buffered", cache=RowCache(64, 256, 8, ways=4)) as t:
        slab = t.new_slab(8)
        t.read_slab(torch.tensor([1, 2, 3]), slab, plan=1)  # never admitted
        t.read_slab(torch.tensor([1, 4]), slab, plan=2)
        t.admit_probed(slab)
        assert len(t.cache) == 0  # held for the next probed lookup
        t.slab_reader.late.settle()
        assert (t.stats()["hits"], t.stats()["misses"]) == (0, 5)
        assert len(t.cache) == 2 and (t.cache.lookup(torch.tensor([1, 4])) >= 0).all()


def test_decode_pieces_count_the_statuses_and_fail_a_step_on_a_failed_wait():
    """DecodePieces.check_flags (what the piecewise runner calls with a step's statuses, read back with its
    tokens) counts found and waited layers and raises on a failed wait, naming the layers."""
    from engram.engine.runners.pieces import DecodePieces

    pieces = object.__new__(DecodePieces)  # its CUDA state is not needed to read back statuses
    pieces.probed, pieces.probe_counts = [1, 15], {"found": 0, "waited": 0}
    pieces.check_flags(7, torch.tensor([cache_probe.FOUND, cache_probe.WAITED], dtype=torch.int32))
    pieces.check_flags(8, torch.tensor([cache_probe.FOUND, cache_probe.FOUND], dtype=torch.int32))
    assert pieces.probe_counts == {"found": 3, "waited": 1}
    pieces.check_flags(9, None)  # a step without probed layers: nothing to count
    assert pieces.probe_counts == {"found": 3, "waited": 1}
    with pytest.raises(RuntimeError, match=r"step 9: Engram layer\(s\) \[15\] waited for rows"):
        pieces.check_flags(9, torch.tensor([cache_probe.WAITED, cache_probe.FAILED], dtype=torch.int32))
