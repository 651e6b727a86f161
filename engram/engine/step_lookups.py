"""A probed decode step's lookups on a background thread, beside the engine's host work (the piecewise runner's part):
the pieces wait for the lookups' pinned flags on the device, so the disk reads run while the engine's thread samples,
collects, schedules and packs.

Order, kept by the runner: ``start`` after the step's pieces are queued; ``finish`` (wait, then ``settle``) on the
engine's thread before the next step's pieces are queued and before the step's tokens are read. A failed lookup has
already failed its waiting pieces; its error is raised by that step's collect (``error``). The first ``start`` lowers
the GIL switch interval to ``SWITCH_INTERVAL_S``, and ``start`` returns only once the first read is issued
(``reader.on_read_start``), ``handed_off`` was called, the lookups ended, or ``HANDOFF_TIMEOUT_S`` passed."""
from __future__ import annotations

import concurrent.futures as cf
import logging
import sys
import threading
from typing import Callable

import torch

from engram.store import reader

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 2e-4  # the GIL hand-off the lookup thread waits for at most, each time
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
        """Run ``read`` on the thread (the previous step's finished first); return once its first read is issued."""
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
        """Wait for the started lookups, then ``settle()`` here even if they failed (kept for ``error(step_id)``)."""
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
    """Lower the GIL switch interval to ``seconds`` (default ``SWITCH_INTERVAL_S``) if it is longer."""
    seconds = SWITCH_INTERVAL_S if seconds is None else seconds
    before = sys.getswitchinterval()
    if before > seconds:
        sys.setswitchinterval(seconds)
        log.info("GIL switch interval %.2f ms -> %.2f ms: disk lookups read on threads beside the engine's",
                 before * 1e3, seconds * 1e3)
