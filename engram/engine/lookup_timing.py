"""Per-step lookup timing (worker side): how long a step's Engram lookups took per table tier, and how long the step
waited for them. The lookup executor opens one ``LookupTiming`` per submitted step and the Worker takes it when the
step is collected (``StepResult.lookup_exposed_s`` / ``gather_s``; the engine's step trace keeps them per step).

What is measured, on the host's monotonic clock:

* ``gather_s[tier]``: per layer, from the start of its table call (``gather`` or ``submit``) to the moment its rows
  existed (a synchronous call's return; a disk lookup's completion on its table's thread, ``finished_at``), summed
  over the step's layers. Layers read concurrently both count, so it can exceed the step's wall time.
* ``exposed_s``: time the step's compute stood still waiting for rows. Without a lookup stream (the CPU, or
  ``lookup_overlap`` off) that is the synchronous staging before the forward plus every consumer's wait for a layer
  still reading; with a stream on CUDA it is the consumers' waits measured by the stream's event pairs
  (``LookupStream.pop_exposed``), which a CUDA-graph replay cannot time (the step then reports None)."""
from __future__ import annotations

import collections
import threading
import time

from engram.store.base import LookupHandle


class LookupTiming:
    """One step's counters; safe to add to from the disk tier's threads (a lock)."""

    def __init__(self, step_id: int):
        self.step_id = step_id
        self.gather_s: dict[str, float] = {}  # tier -> seconds, summed over the step's layers
        self.exposed_s = 0.0
        self._lock = threading.Lock()

    def add_gather(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.gather_s[tier] = self.gather_s.get(tier, 0.0) + max(0.0, seconds)

    def add_exposed(self, seconds: float) -> None:
        with self._lock:
            self.exposed_s += max(0.0, seconds)

    def track(self, tier: str, handle: LookupHandle, started: float) -> LookupHandle:
        """Count ``handle``'s lookup (started at ``started``) under ``tier`` once its rows exist -> the handle."""
        return TimedHandle(handle, lambda end: self.add_gather(tier, end - started))


class TimingBook:
    """The timings of staged steps by step id until taken; the oldest go past ``keep`` (failed steps: never taken)."""

    def __init__(self, keep: int = 64):
        self._timings: collections.OrderedDict[int, LookupTiming] = collections.OrderedDict()
        self.keep = keep

    def new(self, step_id: int) -> LookupTiming:
        timing = self._timings[step_id] = LookupTiming(step_id)
        while len(self._timings) > self.keep:
            self._timings.popitem(last=False)
        return timing

    def take(self, step_id: int) -> LookupTiming | None:
        return self._timings.pop(step_id, None)


class TimedHandle(LookupHandle):
    """A handle whose first successful ``wait`` reports when the rows existed: the wrapped handle's ``finished_at``
    where it keeps one (a disk lookup done on another thread), else the moment ``wait`` returned."""

    def __init__(self, inner: LookupHandle, report):
        self.inner, self._report = inner, report

    def wait(self):
        rows = self.inner.wait()
        if self._report is not None:
            report, self._report = self._report, None
            report(getattr(self.inner, "finished_at", None) or time.monotonic())
        return rows

    def done(self) -> bool:
        return self.inner.done()

    def cancel(self) -> bool:
        self._report = None
        return self.inner.cancel()


def tier_name(table) -> str:
    """The tier a table reports its time under: "gpu", "host" or "disk"; "+cache" when a hot-row cache fronts it (a
    TP column shard reports its row shard's)."""
    if getattr(table, "tier", None) is None and getattr(table, "table", None) is not None:
        return tier_name(table.table)
    tier = getattr(getattr(table, "tier", None), "value", None) or type(table).__name__
    return tier + ("+cache" if getattr(table, "cache", None) is not None else "")
