"""Kernel choices an engine fixes when it is built, by name: what a benchmark arm may flip for its engine.

Some fast paths are chosen by module flags that a process reads from the environment (``ENGRAM_*``); a
decode graph captures whichever was set while the Worker was built. ``applied({"fused_combine": True})``
sets the named flags for the duration of a ``with`` block and restores them after, so one process can
build engines that differ only in them (engram bench placement's ``switches`` arm key) and compare their
graph replays, interleaved, with confidence intervals. Unknown names are refused with the known ones.

* ``fused_combine``: decode attention combines its splits inside the split kernel
  (``paged_attention_triton.FUSED_COMBINE``, ``ENGRAM_FUSED_COMBINE``; CUDA with triton only);
* ``l2_prefetch``: each layer prefetches its o weight into L2 during attention at batch <= 8
  (``l2_prefetch.ENABLED``, ``ENGRAM_L2_PREFETCH``).
"""
from __future__ import annotations

import contextlib
import importlib

SWITCHES = {  # name -> (module, attribute)
    "fused_combine": ("engram.model.layers.paged_attention_triton", "FUSED_COMBINE"),
    "l2_prefetch": ("engram.model.layers.l2_prefetch", "ENABLED"),
}


def check(switches: dict) -> None:
    """ValueError for a name not in SWITCHES or a value that is not a bool."""
    for name, value in switches.items():
        if name not in SWITCHES:
            raise ValueError(f"unknown kernel switch {name!r}; known: {list(SWITCHES)}")
        if not isinstance(value, bool):
            raise ValueError(f"kernel switch {name!r}={value!r} must be true or false")


@contextlib.contextmanager
def applied(switches: dict):
    """Set the named flags inside the block, restore them after. RuntimeError when a switch's module cannot
    be imported here (e.g. fused_combine without triton)."""
    check(switches)
    old = []
    try:
        for name, value in switches.items():
            module_name, attr = SWITCHES[name]
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                raise RuntimeError(f"kernel switch {name!r} needs {module_name}, which cannot be imported "
                                   f"here: {e}") from None
            old.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(old):
            setattr(module, attr, value)
