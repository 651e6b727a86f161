"""engine/step_lookups.py: a decode step's lookups on a thread beside the engine's host work."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from engram.engine import step_lookups
from engram.engine.step_lookups import BackgroundLookups


@pytest.fixture(autouse=True)
def _default_switch_interval():
    sys.setswitchinterval(0.005)  # the interpreter's default (tests/conftest.py restores the session's after)


def test_the_lookups_run_on_their_thread_and_settle_runs_on_the_caller_after_them():
    lookups = BackgroundLookups()
    release, order = threading.Event(), []

    def read():
        release.wait(5)
        order.append(("read", threading.current_thread().name.split("_")[0]))

    lookups.start(7, read)
    assert lookups.pending_step == 7
    release.set()
    lookups.finish(lambda: order.append(("settle", threading.current_thread().name)))
    assert order == [("read", "engram-step-lookups"), ("settle", threading.current_thread().name)]
    assert lookups.pending_step is None and lookups.error(7) is None
    lookups.finish(lambda: order.append("again"))  # nothing pending: no settle
    assert order[-1] != "again"
    assert sys.getswitchinterval() == pytest.approx(step_lookups.SWITCH_INTERVAL_S)


def test_a_second_step_before_the_first_is_finished_is_refused():
    lookups = BackgroundLookups()
    lookups.start(1, lambda: None)
    with pytest.raises(RuntimeError, match="step 2: the lookups of step 1 were never finished"):
        lookups.start(2, lambda: None)
    lookups.finish(lambda: None)
    lookups.start(2, lambda: None)
    lookups.finish(lambda: None)


def test_a_failed_lookup_is_kept_for_its_step_once_and_settle_still_runs():
    lookups = BackgroundLookups()
    settled = []

    def read():
        raise OSError(5, "Input/output error")

    lookups.start(3, read)
    lookups.finish(lambda: settled.append(True))
    assert settled == [True]
    assert lookups.error(4) is None
    err = lookups.error(3)
    assert isinstance(err, OSError) and err.errno == 5
    assert lookups.error(3) is None  # given once


def test_the_switch_interval_is_only_ever_lowered():
    sys.setswitchinterval(1e-4)
    step_lookups.shorten_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(1e-4)
    sys.setswitchinterval(0.005)
    step_lookups.shorten_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(step_lookups.SWITCH_INTERVAL_S)


def test_start_returns_once_the_first_read_is_issued(tmp_path, monkeypatch):
    """``start`` hands the GIL to the lookups until their first read is on its way (reader.on_read_start):
    what the lookup thread does before its read comes before what the caller does after ``start``."""
    import time

    from engram.store.reader import PAGE, PageReader, aligned_pages

    monkeypatch.setattr(step_lookups, "HANDOFF_TIMEOUT_S", 30.0)  # the wait ends on the read, not the timeout
    path = tmp_path / "pages.bin"
    path.write_bytes(bytes(range(256)) * (4 * PAGE // 256))
    reader, buf = PageReader(path, io="buffered", queue_depth=4), aligned_pages(2)
    lookups, order = BackgroundLookups(), []

    def read():
        time.sleep(0.05)  # host work before the read (the plan): the caller waits for it
        order.append("planned")
        reader.read(np.array([0, PAGE], dtype=np.int64), buf)
        order.append("read")

    lookups.start(1, read)
    order.append("caller goes on")
    lookups.finish(lambda: None)
    assert order.index("planned") < order.index("caller goes on")
    assert bytes(buf.reshape(-1)[:4].numpy()) == bytes(range(4))


def test_start_does_not_wait_for_lookups_that_read_nothing(monkeypatch):
    """Lookups whose rows were all cached issue no read: ``start`` returns when they end, not at the timeout."""
    import time

    monkeypatch.setattr(step_lookups, "HANDOFF_TIMEOUT_S", 30.0)
    lookups = BackgroundLookups()
    t0 = time.perf_counter()
    lookups.start(1, lambda: None)
    assert time.perf_counter() - t0 < 10.0  # far under the 30 s timeout: the end of the lookups woke it
    lookups.finish(lambda: None)


def test_start_returns_when_the_lookups_hand_off_without_a_read(monkeypatch):
    """A first layer whose rows were all cached issues no read on this thread (the next layer's reads run on
    its table's thread): the lookups call ``handed_off`` and ``start`` returns then, not when they end."""
    monkeypatch.setattr(step_lookups, "HANDOFF_TIMEOUT_S", 30.0)
    lookups, order, release = BackgroundLookups(), [], threading.Event()

    def read():
        order.append("first layer")
        lookups.handed_off()
        release.wait(30)  # the later layer's reads, on another thread
        order.append("later layer")

    lookups.start(1, read)
    order.append("caller goes on")
    release.set()
    lookups.finish(lambda: None)
    assert order == ["first layer", "caller goes on", "later layer"]

