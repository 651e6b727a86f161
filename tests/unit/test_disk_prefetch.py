"""DiskTable.submit: bounded depth, cancel before and during the read, buffers freed, results identical."""
from __future__ import annotations

import concurrent.futures as cf
import gc
import threading
import weakref

import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store.disk import InflightLimitError, open_disk_table
from engram.store.writer import write_table


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch") / "t"
    vals, scales = quantize_mxfp8(torch.randn(2048, 64, generator=torch.Generator().manual_seed(0)))
    write_table(d, vals, scales)
    return d


class Gate:
    """A reader fault hook that holds every read until opened (and counts the reads that started)."""

    def __init__(self):
        self.open = threading.Event()
        self.started = threading.Semaphore(0)

    def __call__(self, offsets):
        self.started.release()
        assert self.open.wait(10), "test gate never opened"
        return None


def test_submit_matches_gather_and_releases_slots(table_dir):
    with open_disk_table(table_dir, max_inflight=3) as t:
        g = torch.Generator().manual_seed(2)
        batches = [torch.randint(0, t.rows, (n,), generator=g) for n in (0, 1, 77, 500)]
        for ids in batches:
            want = t.gather(ids, dtype=torch.float32)
            h = t.submit(ids, dtype=torch.float32)
            got = h.wait()
            assert h.done() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert h.cancel() is False  # consumed: nothing left to drop
        assert t.stats()["inflight"] == 0 and t.stats()["inflight_bytes"] == 0


def test_depth_limit_raises_with_a_clear_message(table_dir):
    with open_disk_table(table_dir, max_inflight=2) as t:
        gate = Gate()
        t.reader.fault_hook = gate
        h1, h2 = t.submit(torch.tensor([1])), t.submit(torch.tensor([2, 3]))
        with pytest.raises(InflightLimitError, match=r"2 lookups are already in flight \(max_inflight=2\)"):
            t.submit(torch.tensor([4]))
        assert t.stats()["inflight"] == 2 and t.stats()["inflight_bytes"] == 3 * 64 * 2
        gate.open.set()
        h1.wait()
        h3 = t.submit(torch.tensor([4]))  # a slot was freed by consuming h1
        assert h2.wait().shape == (2, 64) and h3.wait().shape == (1, 64)
        assert t.stats()["inflight"] == 0


def test_cancel_queued_and_running_lookups(table_dir):
    with open_disk_table(table_dir, max_inflight=3) as t:
        gate = Gate()
        t.reader.fault_hook = gate
        results = []
        real_gather = t._gather_checked  # what a submitted lookup runs on the table's thread

        def spy(*a, **k):  # keeps only a weak reference to each result, to see it freed
            out = real_gather(*a, **k)
            results.append(weakref.ref(out))
            return out

        t._gather_checked = spy
        running = t.submit(torch.arange(0, 1000, 3))
        assert gate.started.acquire(timeout=10)  # its read has started and is held at the gate
        queued = t.submit(torch.tensor([5]))
        assert queued.cancel() is True  # never started: dropped, slot freed at once
        assert t.stats()["inflight"] == 1
        with pytest.raises(cf.CancelledError):
            queued.wait()
        assert running.cancel() is False  # already reading: it finishes in the background
        assert running.done()
        with pytest.raises(cf.CancelledError):
            running.wait()
        gate.open.set()
        for _ in range(200):
            if t.stats()["inflight"] == 0:
                break
            threading.Event().wait(0.01)
        assert t.stats()["inflight"] == 0 and t.stats()["inflight_bytes"] == 0
        gc.collect()
        assert len(results) == 1 and results[0]() is None  # the cancelled lookup's rows are gone
        t._gather_checked = real_gather
        assert t.submit(torch.tensor([5])).wait().shape == (1, 64)  # the table is fine afterwards


def test_close_cancels_queued_work(table_dir):
    t = open_disk_table(table_dir, max_inflight=4)
    gate = Gate()
    t.reader.fault_hook = gate
    running = t.submit(torch.tensor([1]))
    assert gate.started.acquire(timeout=10)
    queued = t.submit(torch.tensor([2]))
    threading.Timer(0.05, gate.open.set).start()
    t.close()
    assert running.wait().shape == (1, 64)
    with pytest.raises(cf.CancelledError):
        queued.wait()
    with pytest.raises(RuntimeError, match="closed"):
        t.submit(torch.tensor([3]))
