"""Tables read side by side sharing one budget of reads in flight, the first leading (store/read_share.py,
csrc/aio_reader.c): the allowance rule, the announcement's life on every path, the depths and bytes of reads
through PageReader, over real O_DIRECT files."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engram.store import read_share
from engram.store import reader as rd
from engram.store.read_share import FOLLOW_FLOOR, ReadSide, SharedReads
from engram.store.reader import PAGE, DiskReadError, Fault, PageReader, aligned_pages

pytestmark = pytest.mark.skipif(not rd.c_available(), reason="the C reader is not built")
N_PAGES = 600


def idle() -> tuple:
    return rd._pread_pool.lead_state()


@pytest.fixture
def direct(tmp_path):
    """(reader over a real file of N_PAGES random pages with O_DIRECT and the C backend, the file's bytes)."""
    old = rd.set_backend("c")
    data = np.random.default_rng(0).integers(0, 256, size=N_PAGES * PAGE, dtype=np.uint8)
    data.tofile(tmp_path / "v.bin")
    r = PageReader(tmp_path / "v.bin", io="direct", queue_depth=64)
    try:
        if r.io != "direct" or not rd.queue_per_thread("direct"):
            pytest.skip("this file system refuses O_DIRECT, or the kernel Linux AIO")
        assert idle() == (0, 0, 0)
        yield r, data
        assert idle() == (0, 0, 0)  # nothing announced or counted is left behind
    finally:
        r.close()
        rd.set_backend(old)


def pages(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.concatenate([data[o:o + PAGE] for o in offsets])


def test_shared_reads_only_where_tables_read_on_queues_of_their_own():
    s = SharedReads.of(64, 2, per_thread=True)
    assert (s.budget, s.lead, s.follower) == (128, ReadSide(128 - FOLLOW_FLOOR, True), ReadSide(128, False, 128))
    assert SharedReads.of(64, 3, True).lead.depth == 192 - 2 * FOLLOW_FLOOR  # the lead leaves a floor per follower
    assert SharedReads.of(64, 1, True) is None  # one table: nothing to share
    assert SharedReads.of(64, 2, per_thread=False) is None  # one pool for every thread: already shared
    assert SharedReads.of(None, 2, True) is None  # no disk
    assert SharedReads.of(FOLLOW_FLOOR - 1, 2, True) is None  # too shallow to leave a follower its floor
    assert SharedReads.of(1024, 2, True) is None  # past an AIO context's slots
    assert SharedReads.of(512, 2, True).budget == 1024


def test_a_follower_keeps_the_floor_while_a_lead_is_announced_then_fills_the_budget():
    p = rd._pread_pool
    assert p.follow_allowance(128, 128) == 128 and p.follow_allowance(64, 128) == 64  # no lead: its whole depth
    p.lead_expect(1)
    try:
        assert p.follow_allowance(128, 128) == FOLLOW_FLOOR
    finally:
        p.lead_expect(-1)
    assert idle() == (0, 0, 0)
    with pytest.raises(ValueError, match="must be 1"):
        p.lead_expect(2)


def test_reads_lead_and_follow_at_their_depths_with_the_plain_bytes(direct):
    r, data = direct
    offs = np.random.default_rng(1).integers(0, N_PAGES, 400) * PAGE  # repeats too
    s = SharedReads.of(64, 2, per_thread=True)
    plain, led, followed = aligned_pages(400), aligned_pages(400), aligned_pages(400)
    r.read(offs, plain)
    assert rd._aio(64).peak == 64
    with s.announced():
        with s.following():  # a follower starting before the lead's read holds back to the floor
            r.read(offs, followed)
        assert rd._aio(s.budget).peak == FOLLOW_FLOOR
        assert idle()[0] == 1
        with s.leading():
            r.read(offs, led)  # ends the announcement once all its blocks are submitted
        assert idle()[0] == 0
        assert rd._aio(s.lead.depth).peak == s.lead.depth
        with s.following():  # no lead to come: the whole budget
            r.read(offs, followed)
        assert rd._aio(s.budget).peak == s.budget
    want = pages(data, offs)
    for out in (plain, led, followed):
        assert np.array_equal(out.numpy().reshape(-1), want)
    assert read_share.current() is None


@pytest.mark.parametrize("how", ["no read", "failed read", "bad call", "unshared io"])
def test_an_announcement_ends_on_every_path(direct, how, tmp_path):
    r, data = direct
    s = SharedReads.of(64, 2, per_thread=True)
    offs = np.arange(100, dtype=np.int64) * PAGE
    with s.announced():
        assert idle()[0] == 1
        with s.leading():
            if how == "failed read":  # the lead's read fails midway: its reads in flight are uncounted too
                r.fault_hook = lambda o: Fault(index=50, err=5)
                with pytest.raises(DiskReadError):
                    r.read(offs, aligned_pages(100))
                r.fault_hook = None
            elif how == "bad call":  # refused before any read
                with pytest.raises(ValueError):
                    rd._aio(s.lead.depth).read(r._fd, offs, PAGE, np.zeros(10, np.uint8), **s.lead.keywords())
            elif how == "unshared io":  # a buffered reader never passes the lead on: leaving withdraws it
                b = PageReader(tmp_path / "v.bin", io="buffered", queue_depth=4)
                b.read(offs[:3], aligned_pages(3))
                b.close()
    assert idle() == (0, 0, 0)


def test_a_lead_beside_followers_ends_first_and_every_byte_is_right(direct):
    """Two followers and a lead on three threads at once: each gets its bytes, the counts return to zero,
    and the lead (announced before the followers started) is not the last to finish."""
    r, data = direct
    s = SharedReads.of(64, 3, per_thread=True)
    rng = np.random.default_rng(2)
    offs = [rng.integers(0, N_PAGES, 500) * PAGE for _ in range(3)]
    outs = [aligned_pages(500) for _ in range(3)]
    order, errors = [], []

    def follow(k):
        try:
            with read_share.reading_as(s.follower):
                r.read(offs[k], outs[k])
            order.append(k)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with s.announced():
        threads = [threading.Thread(target=follow, args=(k,)) for k in (1, 2)]
        for t in threads:
            t.start()
        with s.leading():
            r.read(offs[0], outs[0])
        order.append(0)
    for t in threads:
        t.join()
    assert errors == []
    assert order[-1] != 0
    for k in range(3):
        assert np.array_equal(outs[k].numpy().reshape(-1), pages(data, offs[k]))
