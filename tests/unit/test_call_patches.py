"""engram.bench.call_patches: wrappers set for a while, then the real functions back, whatever they hang on."""
from __future__ import annotations

import types

import pytest

from engram.bench.call_patches import CallPatches


class Thing:
    def f(self, x):
        return x + 1


def test_every_kind_of_attribute_is_wrapped_then_put_back():
    thing, mod, table = Thing(), types.ModuleType("m"), {"k": lambda x: x * 3}
    mod.g = lambda x: x * 2
    calls = []

    def make(real):
        def wrapper(*a):
            calls.append(a[-1])
            return real(*a)
        return wrapper

    with CallPatches() as p:
        p.wrap(Thing, "f", make)  # the class's method
        p.wrap(thing, "f", make)  # an instance: its own attribute over it (wrapping the class's wrapper)
        p.wrap(mod, "g", make)
        p.wrap(table, "k", make)
        assert (thing.f(1), mod.g(1), table["k"](1)) == (2, 2, 3)
        assert calls == [1, 1, 1, 1]  # the instance's wrapper, then the class's
    assert "f" not in vars(thing) and thing.f(1) == 2 and mod.g(1) == 2 and table["k"](1) == 3
    assert len(calls) == 4


def test_restored_after_an_error_too():
    thing = Thing()
    with pytest.raises(RuntimeError):
        with CallPatches() as p:
            p.wrap(thing, "f", lambda real: lambda x: 0)
            assert thing.f(5) == 0
            raise RuntimeError("boom")
    assert thing.f(5) == 6
