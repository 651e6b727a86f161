"""GraphClock (engram/engine/graph_clock.py) on the CPU, where a stamp takes the host clock: names keep their
slots, and a name past the clock's slots is refused without being registered, so reading still works."""
from __future__ import annotations

import pytest

from engram.engine.graph_clock import GraphClock


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
