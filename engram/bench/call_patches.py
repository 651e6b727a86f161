"""Functions and methods replaced for a while by wrappers of them, then put back (diagnosis tools: timers and
timestamps around engine calls, scripts/profile_decode_host.py and bench/read_cycle.py)."""
from __future__ import annotations

import types
from typing import Callable


class CallPatches:
    """``wrap(obj, name, make)`` sets ``obj.name`` (or ``obj[name]`` for a dict) to ``make(real)``; leaving the
    ``with`` block (or ``restore()``) puts every real one back, the last wrapped first: a module's or a class's
    attribute is set again, an instance's own attribute is removed, so its class's method shows through."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[object, str, object]] = []  # (object, attribute or key, the real one)

    def wrap(self, obj, name: str, make: Callable[[Callable], Callable]) -> None:
        real = obj[name] if isinstance(obj, dict) else getattr(obj, name)
        if isinstance(obj, dict):
            obj[name] = make(real)
        else:
            setattr(obj, name, make(real))
        self._wrapped.append((obj, name, real))

    def restore(self) -> None:
        while self._wrapped:
            obj, name, real = self._wrapped.pop()
            if isinstance(obj, dict):
                obj[name] = real
            elif isinstance(obj, (types.ModuleType, type)):
                setattr(obj, name, real)
            else:
                obj.__dict__.pop(name, None)

    def __enter__(self) -> "CallPatches":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
