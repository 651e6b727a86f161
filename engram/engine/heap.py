"""The heap of a long-running engine process: start-up objects kept out of the cyclic collector. ``freeze_startup_heap``
collects once and freezes what is alive (``gc.freeze``, as vLLM does), so a full collection walks only what the steps
allocate instead of stalling the step loop. Frozen objects are never collected as cycles: call it only where the process
is the engine's (``engram serve``, ``engram generate``); ``thaw_heap`` before dropping a model that froze with them."""
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
