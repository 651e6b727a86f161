"""MultiprocExecutor: N Worker processes on one node, one tensor-parallel rank each (torch.multiprocessing spawn, a
gloo process group on 127.0.0.1); each rank builds its sharded Worker (engine/tp_rank.py). The engine's step
description goes once, pickled, to rank 0, which broadcasts it on the gloo group (``broadcast_object_list``); every rank
runs the step, only rank 0 sends its StepResult back. The executor waits on rank 0's pipe and on every rank's process
sentinel together, so a rank that dies makes ``launch``, ``collect`` or ``stats`` raise ``RankFailed`` (an
``ExecutorFailed``) at once (the other ranks are then stopped), never hang, also when the ranks run on GPUs (NCCL:
the sentinels are watched, not collective timeouts). Steps run synchronously on the ranks (``takes_pending_tokens``
is False: no async-scheduling patches)."""
from __future__ import annotations

import collections
import logging
import socket
import weakref
from multiprocessing import connection
from typing import Any

import torch.multiprocessing as mp

from engram.engine.executor import Executor, ExecutorFailed
from engram.engine.step import StepDescription, StepResult
from engram.engine.tp_rank import RankSpec, rank_main

__all__ = ["MultiprocExecutor", "RankFailed", "RankSpec", "free_port"]

_log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a rank that is not ready by then fails the start
STOP_TIMEOUT_S = 10.0  # after a stop message, ranks still alive are killed


class RankFailed(ExecutorFailed):
    """A Worker process died or raised; the executor is stopped and every later call raises this again."""


class MultiprocExecutor(Executor):
    def __init__(self, spec: RankSpec):
        world = spec.config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.world, self._failure = world, None
        self._handles: collections.deque[int] = collections.deque()
        pipes = [ctx.Pipe() for _ in range(world)]
        self.procs = [ctx.Process(target=rank_main, args=(r, spec, pipes[r][1]), daemon=True, name=f"engram-tp{r}")
                      for r in range(world)]
        for p in self.procs:
            p.start()
        for _, child in pipes:
            child.close()
        self._conns = [parent for parent, _ in pipes]
        self._conn = self._conns[0]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._conn)
        ready = [self._receive(conn, "start", START_TIMEOUT_S) for conn in self._conns]
        blocks = {msg[1] for msg in ready}
        if len(blocks) != 1:
            self._fail(f"ranks sized different KV caches {[m[1] for m in ready]}")
        self.num_kv_blocks = blocks.pop()
        self.rank_bytes: list[dict[str, int]] = [msg[2] for msg in ready]  # each rank's tp.parameter_bytes
        self.table_bytes: list[dict[int, int]] = [msg[3] for msg in ready]  # each rank's table bytes by layer
        self.rank_env: list[dict[str, str | None]] = [msg[4] for msg in ready]  # each rank's tp_rank.NCCL_ENV keys

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def launch(self, step: StepDescription) -> int:
        self._send(("step", step))
        self._handles.append(step.step_id)
        return step.step_id

    def collect(self, handle: int) -> StepResult:
        if not self._handles or self._handles[0] != handle:
            raise ValueError(f"collect({handle}): steps are collected in launch order {list(self._handles)}")
        self._handles.popleft()
        return self._receive(self._conn, f"step {handle}")[1]

    def stats(self) -> dict[str, Any]:
        self._send(("stats", None))
        return self._receive(self._conn, "stats")[1]

    def sampled(self) -> list[list[list[int]]]:
        """Every rank's sampled ids of its recent steps (RankZeroSampler.history), rank by rank."""
        self._send(("sampled", None))
        return self._receive(self._conn, "sampled")[1]

    def close(self) -> None:
        """Stop every rank (a stop message, then a kill after STOP_TIMEOUT_S)."""
        self._finalizer()

    # ----------------------------------------------------------------- watching the ranks
    def _send(self, msg: tuple) -> None:
        if self._failure is not None:
            raise RankFailed(self._failure)
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._fail(f"{msg[0]}: rank 0's pipe closed; " + self._exits())

    def _receive(self, conn, what: str, timeout: float | None = None) -> tuple:
        """The next message on ``conn``, or RankFailed as soon as any rank's process has exited."""
        if self._failure is not None:
            raise RankFailed(self._failure)
        ready = connection.wait([conn, *(p.sentinel for p in self.procs)], timeout)
        if conn in ready:
            try:
                msg = conn.recv()
            except EOFError:
                msg = None
            if msg is not None and msg[0] != "error":
                return msg
            if msg is not None:
                _log.error("rank %d raised:\n%s", msg[1], msg[2])
                self._fail(f"{what}: {self._exits()}; rank {msg[1]} raised {_last_line(msg[2])}")
        self._fail(f"{what}: " + self._exits())

    def _exits(self) -> str:
        """What the ranks left: each one's exit code, and the traceback a rank sent before it went."""
        for p in self.procs:
            p.join(0.2)  # a rank that is going: its exit code
        notes = []
        for r, (p, conn) in enumerate(zip(self.procs, self._conns)):
            if not p.is_alive():
                notes.append(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}")
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        _log.error("rank %d raised:\n%s", r, msg[2])
                        notes.append(f"rank {r} raised {_last_line(msg[2])}")
            except (EOFError, OSError):  # the rank's end of the pipe went with it: its exit code says enough
                pass
        return "; ".join(notes) or "no rank answered in time"

    def _fail(self, why: str) -> None:
        self._failure = f"tensor-parallel executor stopped: {why}"
        _log.error(self._failure)
        self._finalizer()
        raise RankFailed(self._failure)


def _last_line(tb: str) -> str:
    return tb.strip().splitlines()[-1] if tb.strip() else "(no traceback)"


def _stop(procs: list, conn) -> None:
    """Ask the ranks to stop; kill those still alive after STOP_TIMEOUT_S."""
    try:
        if all(p.is_alive() for p in procs):
            conn.send(("stop", None))
    except (BrokenPipeError, ConnectionResetError, OSError):  # rank 0 is gone already: the kills below remain
        pass
    for p in procs:
        p.join(STOP_TIMEOUT_S if all(q.is_alive() for q in procs) else 0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(STOP_TIMEOUT_S)
    conn.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
