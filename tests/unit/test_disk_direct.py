"""The disk tier's one-read lookups (DiskTable._gather_direct, store/page_slabs.py): a lookup whose pages fit
``chunk_pages`` is one batched read into a reused slab, decoded in one gather over it, bitwise equal to the
in-memory reference; bigger ones take the chunked path; a failed read or a corrupt page gives the slab back."""
from __future__ import annotations

import errno

import pytest
import torch

from engram.store.disk import open_disk_table
from engram.store.page_crc import CorruptPageError
from engram.store.page_slabs import SlabPool
from engram.store.reader import DiskReadError, Fault
from tests.unit.test_disk import make_rows
from engram.store.writer import write_table


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("direct") / "mx"
    vals, scales, ref = make_rows(3001, 256, "mxfp8")  # 16 rows per 4 KiB page
    write_table(d, vals, scales)
    return d, ref


def reads(t) -> list:
    """The offsets of every batched read ``t`` makes from now on."""
    calls: list = []
    t.reader.fault_hook = lambda offs: calls.append(offs.tolist())
    return calls


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_small_lookup_is_one_read_into_a_reused_slab(table):
    d, ref = table
    with open_disk_table(d, io="buffered") as t:
        calls = reads(t)
        ids = torch.tensor([40, 17, 17, 3000, 16, 41, 2999, 17])  # pages 2, 1, 187 (twice), repeats
        for dt in (torch.bfloat16, torch.float32):
            assert same_bits(t.gather(ids, dtype=dt), ref(ids, dt))
        assert calls == [[4096, 2 * 4096, 187 * 4096]] * 2  # each lookup: its distinct pages, ascending, once
        slab = t._slabs._idle[0]
        assert t.gather(torch.tensor([5]), dtype=torch.float32) is not None and t._slabs._idle == [slab]
        s = t.stats()
        assert (s["lookups"], s["rows"], s["unique_rows"], s["read_ops"], s["disk_rows"]) == (3, 17, 13, 7, 13)


def test_lookups_over_chunk_pages_take_the_chunked_path(table):
    d, ref = table
    with open_disk_table(d, io="buffered", chunk_pages=3) as t:
        calls = reads(t)
        small, big = torch.tensor([0, 16, 32]), torch.arange(0, 8 * 16, 16)  # 3 pages, 8 pages
        assert same_bits(t.gather(small), ref(small, torch.bfloat16)) and len(calls) == 1
        assert same_bits(t.gather(big), ref(big, torch.bfloat16))
        assert len(calls) == 1 + 3  # 3 + 3 + 2 pages, read in three calls
        assert len(t._slabs._idle) == 1  # only the small lookup used a slab


@pytest.mark.parametrize("fault", ["read", "crc"])
def test_a_failed_lookup_gives_its_slab_back(table, tmp_path, fault):
    d, ref = table
    ids = torch.tensor([5, 100, 2000])  # pages 0, 6, 125
    with open_disk_table(d, io="buffered") as t:
        if fault == "read":
            armed = [Fault(index=1, err=errno.EIO)]
            t.reader.fault_hook = lambda offs: armed.pop() if armed else None
            with pytest.raises(DiskReadError):
                t.gather(ids)
        else:
            t.pages.crcs = t.pages.crcs.copy()
            t.pages.crcs[6] ^= 1  # page 6's stored checksum no longer matches its bytes
            with pytest.raises(CorruptPageError, match="page 6 "):
                t.gather(ids)
            t.pages.crcs[6] ^= 1
        assert len(t._slabs._idle) == 1
        assert same_bits(t.gather(ids), ref(ids, torch.bfloat16))
        assert len(t._slabs._idle) == 1  # the same slab again


def test_slab_pool_grows_and_keeps_at_most_keep_idle():
    pool = SlabPool(4096, 256, 8, pinned=False, keep=2)
    a = pool.acquire(3, 10)
    assert (a.pages, a.rows) == (16, 64) and a.data.data_ptr() % 4096 == 0 and a.scales.shape == (16 * 16, 8)
    b = pool.acquire(100, 2000)
    assert (b.pages, b.rows) == (128, 2048)
    pool.release(a)
    pool.release(b)
    assert pool.acquire(20, 10) is b  # the first idle slab big enough
    pool.release(b)
    c = pool.acquire(1, 1)
    assert c is a
    pool.release(c)
    pool.release(pool.new(30, 100))  # 32 pages
    assert len(pool._idle) == 2 and a not in pool._idle  # the smallest idle slab went (nothing read it)
    with pytest.raises(ValueError, match="page_size=1000"):
        SlabPool(1000, 256, 8, pinned=False)


def test_a_callers_slab_is_read_then_decoded_like_a_gather(table):
    """read_slab + decode_slab (what a decode graph does with its own slab) give the gather's rows; submit
    with ``into`` reads on the table's thread and returns None; slots past the last read stay valid rows."""
    d, ref = table
    with open_disk_table(d, io="buffered") as t:
        slab = t.new_slab(64)
        assert slab.slots.numpy().tolist() == [0] * slab.rows and not slab.data.any()
        ids = torch.tensor([40, 17, 17, 3000, 16, 41, 2999, 17, 5, 6])
        t.read_slab(ids, slab)
        out = torch.empty(10, 256, dtype=torch.float32)
        assert t.decode_slab(slab, 10, out) is out and same_bits(out, ref(ids, torch.float32))
        assert (slab.slots.numpy()[10:] == 0).all()
        wide = torch.empty(slab.rows, 256, dtype=torch.float32)
        t.decode_slab(slab, slab.rows, wide)  # the whole capacity decodes (what a bigger bucket reads)
        assert same_bits(wide[:10], out)
        later = torch.tensor([2000, 7, 2001])
        assert t.submit(later, into=slab).wait() is None
        t.decode_slab(slab, 3, out[:3])
        assert same_bits(out[:3], ref(later, torch.float32))
        assert t.stats()["lookups"] == 2 and t.stats()["inflight"] == 0
        with pytest.raises(ValueError, match="65 ids do not fit a slab of 64"):
            t.read_slab(torch.zeros(65, dtype=torch.int64), slab)
        with pytest.raises(ValueError, match="65 ids do not fit a slab of 64"):
            t.submit(torch.zeros(65, dtype=torch.int64), into=slab)


@pytest.mark.parametrize("cache_rows", [8, 4096], ids=["spilling", "holding"])
def test_a_callers_slab_over_a_cached_table_points_into_the_cache(table, cache_rows):
    """With a hot-row cache read_slab goes through it (misses read and cached, the slots index the cache's
    storage) and decode_slab gives the gather's rows; a repeat is all hits and reads nothing; a cache too
    small for one lookup spills the rest into its overflow rows, still the right rows."""
    from engram.store.cache import RowCache

    d, ref = table
    cache = RowCache(cache_rows, 256, 8, ways=8)
    with open_disk_table(d, io="buffered", cache=cache) as t:
        slab = t.new_slab(64)
        assert cache.overflow_rows == 64 and slab.probe is not None  # its pages: a probed lookup's reads
        ids = torch.tensor([40, 17, 17, 3000, 16, 41, 2999, 17, 5, 6, 600, 1200])
        out = torch.empty(12, 256, dtype=torch.float32)
        for expect_hits in (False, cache_rows > 12):
            read_before = t.stats()["read_ops"]
            t.read_slab(ids, slab)
            assert same_bits(t.decode_slab(slab, 12, out), ref(ids, torch.float32))
            assert (t.stats()["read_ops"] == read_before) == expect_hits
        # 10 distinct ids: held, the repeat hits all; spilling, the 8 the set kept hit and 2 are read again
        assert (t.stats()["hits"], t.stats()["misses"]) == ((10, 10) if cache_rows > 12 else (8, 12))
        later = torch.tensor([2000, 7, 2001])
        assert t.submit(later, into=slab).wait() is None
        assert same_bits(t.decode_slab(slab, 3, out[:3]), ref(later, torch.float32))


def test_the_executor_reads_slab_layers_and_hands_out_no_rows(tmp_path):
    """LookupExecutor.submit(slabs=...): those layers' pages go into the slabs (rows(layer) is None) and a
    decode of each slab equals the rows the executor stages without slabs."""
    import engram
    from tests.unit.test_worker import hand_built_step

    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, device="cpu", cache_dir=str(tmp_path))
    lookup = llm.engine.executor.worker.lookup
    step = hand_built_step(llm.loaded, llm.loaded.tokenizer.encode("slabs for the decode graph").ids, 8)
    plain = lookup.submit(step)
    rows = {lid: plain.rows(lid, step.step_id) for lid in step.engram_row_ids}  # [T, n_cols, D]
    slabs = {lid: t.new_slab(256) for lid, t in lookup.tables.items()}
    staged = lookup.submit(step, slabs=slabs)
    for lid, ids in step.engram_row_ids.items():
        assert staged.rows(lid, step.step_id) is None
        n = ids.numel()
        out = torch.empty(n, rows[lid].shape[-1], dtype=torch.float32)
        lookup.tables[lid].decode_slab(slabs[lid], n, out)
        assert same_bits(out, rows[lid].reshape(n, -1))
