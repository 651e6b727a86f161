"""MultiprocExecutor: the Worker processes of one node, a grid of ``pipeline_parallel_size`` stages x
``tensor_parallel_size`` ranks (engine/rank_groups.py; torch.multiprocessing spawn, gloo on 127.0.0.1); each rank builds
its Worker (engine/tp_rank.py). The one launcher of tensor and pipeline parallelism: a step description goes, pickled,
to every stage's leader, with only that stage's Engram row ids (``stage_step``: each stage starts its lookups as soon as
it learns of the step, engine/stage_inbox.py), and the leader broadcasts it to its stage; every rank runs the step on
its layers and shard, the last stage's leader sends the StepResult back. Steps are launched without waiting for the ones
before (up to the engine's microbatches are in flight: stages work on different microbatches at once) and collected in
launch order. The executor waits on the answering pipe and on every rank's process sentinel together, so a rank that
dies makes ``launch``, ``collect`` or ``stats`` raise ``RankFailed`` (an ``ExecutorFailed``) at once (the other ranks
are then stopped), never hang, also when the ranks run on GPUs (NCCL: the sentinels are watched, not collective
timeouts). The Workers take no steps whose tokens are still on a device (``takes_pending_tokens`` is False), except from
pipeline stages, whose last stage relays each step's sampled ids to the stages that read them (``relays_sampled_ids``; a
stage that reads no token ids gets a step without tokens in flight)."""
from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import weakref
from multiprocessing import connection
from typing import Any

import torch.multiprocessing as mp

from engram.engine.executor import Executor, ExecutorFailed
from engram.engine.rank_groups import RankPlace
from engram.engine.step import StepDescription, StepResult
from engram.engine.tp_rank import RankSpec, rank_main

__all__ = ["MultiprocExecutor", "RankFailed", "RankSpec", "free_port", "stage_step"]

_log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a rank that is not ready by then fails the start
STOP_TIMEOUT_S = 10.0  # after a stop message, ranks still alive are killed


class RankFailed(ExecutorFailed):
    """A Worker process died or raised; the executor is stopped and every later call raises this again."""


class MultiprocExecutor(Executor):
    """``stage_layers`` (pipeline stages): the Engram layers of each stage, whose row ids its step carries."""

    def __init__(self, spec: RankSpec, stage_layers: list[tuple[int, ...]] | None = None):
        tp, pp = spec.config.tensor_parallel_size, spec.config.pipeline_parallel_size
        world = tp * pp
        ctx = mp.get_context("spawn")
        self.world, self.tp, self.pp, self._failure = world, tp, pp, None
        self.stage_layers = stage_layers
        self._handles: collections.deque[int] = collections.deque()
        self._early: dict[int, StepResult] = {}  # results that came while another answer was awaited
        pipes = [ctx.Pipe() for _ in range(world)]
        self.procs = [ctx.Process(target=rank_main, args=(r, spec, pipes[r][1]), daemon=True, name=_name(r, tp, pp))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        for _, child in pipes:
            child.close()
        self._conns = [parent for parent, _ in pipes]
        self._leaders = [self._conns[s * tp] for s in range(pp)]  # each stage's first rank takes the messages
        self._conn = self._leaders[-1]  # the last stage's leader answers steps
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._leaders)
        ready = [self._receive(conn, "start", START_TIMEOUT_S) for conn in self._conns]
        for s in range(pp):  # a stage's ranks share every block of the scheduler's pool
            stage_blocks = {msg[1] for msg in ready[s * tp:(s + 1) * tp]}
            if len(stage_blocks) != 1:
                self._fail(f"the ranks of stage {s} sized different KV caches {[m[1] for m in ready]}")
        self.num_kv_blocks = min(msg[1] for msg in ready)  # stages of fewer layers may fit more: the pool is the least
        self.rank_bytes: list[dict[str, int]] = [msg[2] for msg in ready]  # each rank's tp.parameter_bytes
        self.table_bytes: list[dict[int, int]] = [msg[3] for msg in ready]  # each rank's table bytes by layer
        self.rank_env: list[dict[str, str | None]] = [msg[4] for msg in ready]  # each rank's tp_rank.NCCL_ENV keys
        self.holdings: list[dict] = [msg[5] for msg in ready]  # what each rank allocated (tp_rank.holdings)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def relays_sampled_ids(self) -> bool:
        """Whether a step may take tokens of the step in flight before it (pipeline stages: the last stage relays
        each step's sampled ids to the stages that need them, parallel/pp_relay.py)."""
        return self.pp > 1

    def launch(self, step: StepDescription) -> int:
        for s in range(self.pp):
            self._send(s, ("step", step if self.stage_layers is None else
                           stage_step(step, self.stage_layers[s], s in (0, self.pp - 1))))
        self._handles.append(step.step_id)
        return step.step_id

    def collect(self, handle: int) -> StepResult:
        if not self._handles or self._handles[0] != handle:
            raise ValueError(f"collect({handle}): steps are collected in launch order {list(self._handles)}")
        self._handles.popleft()
        if handle in self._early:
            return self._early.pop(handle)
        return self._await(self._conn, "result", f"step {handle}")[1]

    def stats(self) -> dict[str, Any]:
        """The Workers' counters: the first stage's, with every stage's tables and the KV bytes of all stages added."""
        for s in range(self.pp):
            self._send(s, ("stats", None))
        stages = [self._await(conn, "stats", "stats")[1] for conn in self._leaders]
        out = dict(stages[0])
        out["tables"] = {lid: c for st in stages for lid, c in st["tables"].items()}
        out["table_files"] = {lid: f for st in stages for lid, f in st.get("table_files", {}).items()}
        out["kv_bytes"] = sum(st["kv_bytes"] for st in stages)
        if self.pp > 1:
            out["stages"] = stages
        return out

    def sampled(self) -> list[list[list[int]]]:
        """The last stage's ranks' sampled ids of their recent steps (RankZeroSampler.history), rank by rank."""
        for s in range(self.pp):
            self._send(s, ("sampled", None))
        return [self._await(conn, "sampled", "sampled")[1] for conn in self._leaders][-1]

    def close(self) -> None:
        """Stop every rank (a stop message, then a kill after STOP_TIMEOUT_S)."""
        self._finalizer()

    # ----------------------------------------------------------------- watching the ranks
    def _send(self, stage: int, msg: tuple) -> None:
        if self._failure is not None:
            raise RankFailed(self._failure)
        try:
            self._leaders[stage].send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._fail(f"{msg[0]}: stage {stage}'s pipe closed; " + self._exits())

    def _await(self, conn, kind: str, what: str) -> tuple:
        """The next answer of ``kind`` on ``conn``; step results that arrive first are kept for ``collect``."""
        while True:
            msg = self._receive(conn, what)
            if msg[0] == kind:
                return msg
            if msg[0] != "result":
                self._fail(f"{what}: expected a {kind!r} answer, got {msg[0]!r}")
            self._early[msg[1].step_id] = msg[1]

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
        self._failure = f"multi-process executor stopped: {why}"
        _log.error(self._failure)
        self._finalizer()
        raise RankFailed(self._failure)


def _last_line(tb: str) -> str:
    return tb.strip().splitlines()[-1] if tb.strip() else "(no traceback)"


def _stop(procs: list, leaders: list) -> None:
    """Ask every stage to stop; kill the ranks still alive after STOP_TIMEOUT_S."""
    for conn in leaders:
        try:
            if all(p.is_alive() for p in procs):
                conn.send(("stop", None))
        except (BrokenPipeError, ConnectionResetError, OSError):  # a leader is gone already: the kills below remain
            pass
    for p in procs:
        p.join(STOP_TIMEOUT_S if all(q.is_alive() for q in procs) else 0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(STOP_TIMEOUT_S)
    for conn in leaders:
        conn.close()


def _name(rank: int, tp: int, pp: int) -> str:
    place = RankPlace.of(rank, tp, pp)
    return f"engram-tp{rank}" if pp == 1 else f"engram-pp{place.stage}-tp{place.tp_rank}"


def stage_step(step: StepDescription, layers: tuple[int, ...], end: bool = False) -> StepDescription:
    """``step`` as a pipeline stage gets it: the row ids of its own Engram ``layers`` only; a stage neither at an
    ``end`` (first, last) nor with Engram layers reads no token ids, so it gets no tokens in flight to patch in."""
    own = {l: ids for l, ids in step.engram_row_ids.items() if l in layers}
    if end or layers or not step.pending_rows:
        return dataclasses.replace(step, engram_row_ids=own)
    return dataclasses.replace(step, engram_row_ids=own, pending_rows=[], pending_sources=[], pending_step_id=-1,
                               pending_partials=None)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
