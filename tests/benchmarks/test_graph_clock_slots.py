"""GraphClock (benchmarks/graph_clock.py) on the CPU, where a stamp takes the host clock: names keep their
slots, a name past the clock's slots is refused without being registered, so reading still works, and
``install`` stamps around LookupStream's methods in order."""
from __future__ import annotations

import pytest

from benchmarks.graph_clock import GraphClock


def test_names_keep_their_slots_and_one_too_many_is_refused_unregistered():
    clock = GraphClock("cpu", slots=2)
    clock.stamp("a")
    clock.stamp("b")
    clock.stamp("a")  # an existing name reuses its slot
    assert clock.names == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match=r"GraphClock: 3 names exceed its 2 slots \('c'\)"):
        clock.stamp("c")
    assert clock.names == {"a": 0, "b": 1}
    read = clock.read()
    assert set(read) == {"a", "b"} and read["a"] >= read["b"] > 0  # "a" was stamped again after "b"


def test_install_stamps_around_the_lookup_streams_methods_and_replaces_an_earlier_install(monkeypatch):
    import contextlib

    from benchmarks.graph_clock import install
    from engram.engine.lookup_stream import LookupStream

    calls = []

    @contextlib.contextmanager
    def issue(self, *inputs):
        calls.append("issue")
        yield self

    monkeypatch.setattr(LookupStream, "issue", issue)
    for name in ("done", "wait", "join"):
        monkeypatch.setattr(LookupStream, name, lambda self, *a, name=name, **kw: calls.append(name))
    stale = GraphClock("cpu", slots=16)
    install(stale, monkeypatch.setattr)
    clock = GraphClock("cpu", slots=16)
    install(clock, monkeypatch.setattr)
    stream = object.__new__(LookupStream)
    with stream.issue() as s:
        s.done(3)
    stream.wait(3)
    stream.join()
    assert calls == ["issue", "done", "wait", "join"]
    assert stale.names == {}  # the second install wrapped the originals, not the first install's wrappers
    got = clock.read()
    order = ["fork", "lookup_start", "lookup_done_3", "main_start", "wait_begin_3", "wait_end_3", "joined"]
    assert list(got) == order and all(got[a] <= got[b] for a, b in zip(order, order[1:]))
