"""The Python heap of a long-running engine process: start-up objects kept out of the cyclic collector.

After import and model load a process holds ~10^5 container objects (functions, classes, dicts of torch
and the model) that live until exit. Python's full (generation-2) collection walks all of them; with
an engine allocating per-step objects it runs every few hundred steps, and each run stalls the step
loop for far longer than a step (benchmarks/engine_host.py measures it). ``freeze_startup_heap`` collects once and moves what is
alive into the permanent generation (``gc.freeze``, as vLLM's engine core does after start-up); the
collector then walks only what the steps allocate. Objects frozen are never collected as cycles (plain
reference counting still frees them): call it when the process is the engine's (``engram serve``,
``engram generate``; ``engram bench engine`` thaws with ``thaw_heap`` before it drops an arm's model),
not from a library that other code shares a process with.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive; returns how many are frozen (cumulative)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give frozen objects back to the collector (before dropping a model that froze with them)."""
    gc.unfreeze()
