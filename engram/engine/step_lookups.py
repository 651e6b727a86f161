"""A decode step's lookups on a thread of their own, beside the engine's host work (the Worker's part).

When every Engram layer of a decode graph finds its rows on the device (disk tables behind a hot-row cache,
probed: store/kernels/cache_probe.py), ``DecodeGraphs.begin(whole=True)`` queues the whole step before its
lookups run, and nothing the host does for the step waits for them: the pieces wait for the lookups' pinned
flags on the device. The lookups (the disk reads of the rows the caches miss) then run here, on one
background thread, while the engine's thread launches the sampler, collects the step before,
post-processes it, schedules, packs and hashes the next step. Run inline, that host work came after the
step's reads and before the next step's, with the disk idle (a profiled 4b-like batch-64 step on the H200,
826e0c8: 46.9 ms, of which 42.4 ms in the lookups' ``DecodeGraphs.run``); here the next step's reads start
as soon as its row ids reach the host.

Order, which the Worker keeps: ``start`` after the step's pieces are queued; ``finish`` before the next
step's pieces are queued (the next ``launch``, once it has sent that step's row ids to the host) and before
the step's tokens are read (``collect``), on the engine's thread. ``finish`` waits for the lookups and then
calls ``settle`` (DecodeGraphs.finish_lookups: the rows read go into the caches, device work queued only
once no piece waits for a flag, and each slab's next lookup waits for this step's decode of it). A lookup
that failed has already failed the pieces waiting for it (cache_probe.signal(..., ok=False)); its error is
kept for that step's ``collect`` (``error``), which raises it, so the step fails loudly with the read's own
message and the engine re-runs it.

The GIL: the lookup thread holds it only between its C reads (numpy bookkeeping, the plan, the flag), but
each time it wants it back it waits until the engine's thread lets go, and a thread running Python lets go
only every ``sys.getswitchinterval()`` (5 ms by default). A read of 24 pages plus a numpy call took 0.42 ms
beside an idle thread and 26.4 ms beside one running Python on the H200 machine (5.85 ms on the CPU
machine), 0.86 ms with a 0.2 ms interval (scripts/gil_handoff.py, docs/disk.md). So the first ``start``
lowers the interpreter's switch interval to ``SWITCH_INTERVAL_S`` (never raises it; logged once), and so does
a Worker with disk tables, whose later layers read on their tables' threads beside the engine's (and a
server's) Python. It costs a thread running alone nothing: the interval only matters when another thread
waits for the GIL. And ``start`` hands the GIL over outright for the lookups' first stretch of Python: it
returns once their first read is on its way (``reader.on_read_start``), or their first layer's lookup
returned without one (``handed_off``, which the lookups call), or they are done, or after
``HANDOFF_TIMEOUT_S``; a 1,536-id lookup's host work with its reads stubbed out took 0.42 ms beside an idle
thread, and beside one running Python 0.58 ms (p90 4.9 ms) at a 0.2 ms interval and 11 ms (p90 86 ms) at
5 ms (the CPU machine).

A step whose rows were all cached has lookups of a fraction of a millisecond (no reads), less than the hand-off
to the thread and back costs: the Worker runs a step's lookups here only when the step before read from disk
(``DecodeGraphs.last_step_read``), else inline.

On unless ENGRAM_BACKGROUND_LOOKUPS=0 (the lookups run inline in ``DecodeGraphs.run``); kernel switch
``background_lookups``, read at every launch. ENGRAM_GIL_SWITCH_MS sets the shortened switch interval
(``switch_interval_s``; 5 or more keeps the interpreter's default), for measuring what it costs.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import sys
import threading
from typing import Callable

import torch

from engram.fast_path import env_flag
from engram.store import reader

log = logging.getLogger(__name__)

BACKGROUND = env_flag("ENGRAM_BACKGROUND_LOOKUPS", default=True)
# The next step's row ids go to the host before the background lookups of the step before are finished (the
# Worker's launch): their copy follows that step's sampler alone, not the cache copies that finishing
# queues. ENGRAM_EARLY_HOST_IDS=0 (kernel switch ``early_host_ids`` false) finishes first, as before 1609d27.
EARLY_HOST_IDS = env_flag("ENGRAM_EARLY_HOST_IDS", default=True)


def switch_interval_s(env: dict | None = None) -> float:
    """The switch interval the lookups' threads get (seconds): ENGRAM_GIL_SWITCH_MS (milliseconds above 0; 5 or
    more leaves the interpreter's default alone), else 0.2 ms. A malformed value raises ValueError naming it."""
    value = (os.environ if env is None else env).get("ENGRAM_GIL_SWITCH_MS")
    if value is None:
        return 2e-4
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not ms > 0:
        raise ValueError(f"ENGRAM_GIL_SWITCH_MS={value!r}: must be a number of milliseconds above 0")
    return ms / 1e3


SWITCH_INTERVAL_S = switch_interval_s()  # the GIL hand-off the lookup thread waits for at most, each time
HANDOFF_TIMEOUT_S = 5e-3  # ``start`` waits at most this long for the lookups' first read to be issued


class BackgroundLookups:
    """At most one step's lookups in flight on one thread (made on first use); their errors by step id."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device  # made the thread's current CUDA device (a Worker's may not be the first)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pending: tuple[int, cf.Future] | None = None
        self._errors: dict[int, BaseException] = {}
        self._issued = threading.Event()  # set when the started lookups' first read is issued, or they end

    @property
    def pending_step(self) -> int | None:
        """The step whose lookups were started and not yet finished, if any."""
        return self._pending[0] if self._pending is not None else None

    def start(self, step_id: int, read: Callable[[], None]) -> None:
        """Run ``read`` (the step's lookups) on the thread; return once its first disk read is issued (or it
        ended, or ``HANDOFF_TIMEOUT_S`` passed). The previous step's must be finished first."""
        if self._pending is not None:
            raise RuntimeError(f"step {step_id}: the lookups of step {self._pending[0]} were never finished")
        if self._pool is None:
            cuda = self.device is not None and self.device.type == "cuda"
            index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if cuda else 0
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="engram-step-lookups",
                                               initializer=self._init_thread, initargs=(index if cuda else None,))
            shorten_switch_interval()
        self._issued.clear()
        future = self._pool.submit(read)
        future.add_done_callback(lambda _: self._issued.set())
        self._pending = (step_id, future)
        self._issued.wait(HANDOFF_TIMEOUT_S)  # the GIL is the lookups' until their reads are on their way

    def handed_off(self) -> None:
        """Called by the running lookups once the caller of ``start`` may go on (a layer's lookup returned)."""
        self._issued.set()

    def _init_thread(self, cuda_index: int | None) -> None:
        if cuda_index is not None:
            torch.cuda.set_device(cuda_index)
        reader.on_read_start(self._issued.set)

    def finish(self, settle: Callable[[], None]) -> None:
        """Wait for the started lookups, if any, then ``settle()`` on this thread, whether they failed or
        not (the pieces they fed have run, or given up); a failure is kept for ``error(step_id)``."""
        if self._pending is None:
            return
        (step_id, future), self._pending = self._pending, None
        err = future.exception()
        try:
            settle()
        finally:
            if err is not None:
                self._errors[step_id] = err

    def error(self, step_id: int) -> BaseException | None:
        """The failure of step ``step_id``'s lookups (once: it is forgotten here), else None."""
        return self._errors.pop(step_id, None)


def shorten_switch_interval(seconds: float | None = None) -> None:
    """Lower the interpreter's GIL switch interval to ``seconds`` (default ``SWITCH_INTERVAL_S``) if it is
    longer (see the module docstring)."""
    seconds = SWITCH_INTERVAL_S if seconds is None else seconds
    before = sys.getswitchinterval()
    if before > seconds:
        sys.setswitchinterval(seconds)
        log.info("GIL switch interval %.2f ms -> %.2f ms: disk lookups read on threads beside the engine's",
                 before * 1e3, seconds * 1e3)
