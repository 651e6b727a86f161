"""One turn of the engine process's step loop (engine_proc.py): ``step_once`` runs ``engine.step()`` and sorts what
came out (outputs, requests failed, the executor gone), and ``LoopClock`` counts the host time the loop spends, so a
load can tell the engine's share of a step from the server's (``GET /engram/steps`` reports it as ``engine_loop``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engram.engine.executor import executor_failed

log = logging.getLogger("engram.server")


@dataclass
class StepOutcome:
    """What one ``engine.step()`` gave."""

    outputs: list  # RequestOutputs of the requests that advanced (also when others failed)
    failed: list[str] | None = field(default_factory=list)  # ids the step failed (aborted already); None: every one
    error: str | None = None  # why they failed, or why the engine stopped
    fatal: bool = False  # the executor is gone for good (ExecutorFailed): fail everything, stop the loop


def step_once(engine: Any) -> StepOutcome:
    """``engine.step()``; a failing step aborts the requests it names (StepError), or names none (``failed`` None:
    the caller fails all of its own); an ExecutorFailed is ``fatal``. Never raises for a step's failure."""
    try:
        return StepOutcome(engine.step())
    except Exception as e:
        if executor_failed(e):
            return StepOutcome([], None, f"{type(e).__name__}: {e}", fatal=True)
        ids = getattr(e, "request_ids", None)
        log.error("engine step failed for %s request(s): %s", len(ids) if ids else "every", e)
        for rid in ids or []:
            engine.abort_request(rid)
        return StepOutcome(list(getattr(e, "outputs", None) or []), list(ids) if ids else None, str(e))


@dataclass
class LoopStats:
    """Host time of the loop's thread since it started (seconds; CPU time is this thread's own, so on one torch
    thread ``step_s - step_cpu_s`` is the time a step waited for the GIL or the device)."""

    pid: int  # the engine process
    tid: int  # its native thread id (/proc/PID/task/TID)
    steps: int = 0  # engine.step() calls
    step_s: float = 0.0  # wall time inside engine.step()
    step_cpu_s: float = 0.0  # this thread's CPU time inside engine.step()
    deliver_s: float = 0.0  # wall time handing a step's outputs to the pipe
    loop_cpu_s: float = 0.0  # this thread's CPU time since the loop started (steps, messages, delivery)


class LoopClock:
    """``LoopStats`` of the thread that created it: ``step()`` and ``deliver()`` bracket the two timed parts."""

    def __init__(self) -> None:
        self.stats = LoopStats(os.getpid(), threading.get_native_id())
        self._cpu0 = time.thread_time()

    def step(self, engine: Any) -> StepOutcome:
        wall, cpu = time.perf_counter(), time.thread_time()
        outcome = step_once(engine)
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - wall
        self.stats.step_cpu_s += time.thread_time() - cpu
        return outcome

    def delivered(self, since: float) -> None:
        """Count the delivery that started at ``time.perf_counter()`` == ``since``."""
        self.stats.deliver_s += time.perf_counter() - since

    def snapshot(self) -> dict:
        self.stats.loop_cpu_s = time.thread_time() - self._cpu0
        return asdict(self.stats)
