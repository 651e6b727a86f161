"""One data-parallel replica: a spawned process that builds a whole ``engram.LLM`` (``ReplicaSpec.build``: its own
Workers, TP ranks included, KV cache and scheduler; its tables mapped from the node's shared copy) and runs its step
loop on the requests the router (engine/data_parallel.py) sends, free-running: it never waits for another replica.

Messages over the replica's pipe. In: ("add", [(request_id, prompt, SamplingParams)]), ("abort", [request_id]),
("reset_prefix_cache", None), ("stop", None). Out: ("ready", ReplicaInfo) once built, or ("error", traceback) and
exit code 1; after every step ("step", outputs, engine.stats(), the step's StepRecords); ("failed", request_ids,
message, outputs) when a step failed some requests (aborted here; None: the error named none, the router fails all
of this replica's; the rest ran); ("reset", dropped blocks);
("fatal", message) and exit code 4 when its executor failed for good (a TP rank of it died)."""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from engram.engine.executor import executor_failed
from engram.store.shared_host import shared_stats

EXIT_BUILD_FAILED, EXIT_EXECUTOR_FAILED = 1, 4


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica builds (picklable: it crosses the spawn)."""

    index: int  # replica number, 0 .. data_parallel_size - 1
    model: str  # preset name or checkpoint directory
    tier: str
    dtype: Any  # as LLM(dtype=...)
    engram_config: dict  # --engram-config keys; the router sets shared_memory unless the caller chose
    device: str | None  # as LLM(device=...)
    cache_dir: str | None
    engine_options: dict  # EngineConfig fields of this replica (data_parallel_size 1; its share of the GPU)
    # spec -> an object with .engine (engram.LLM of the spec's fields; a module-level function: it is pickled by name)
    build: Callable[["ReplicaSpec"], Any] | None = None
    threads: int | None = None  # torch CPU threads (None: torch's default)
    log_level: int = logging.WARNING  # the router's effective level: the replica's records go to its stderr
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the replica (None: inherited)


@dataclass(frozen=True)
class ReplicaInfo:
    """What a built replica reports to the router."""

    index: int
    pid: int
    max_model_len: int
    num_kv_blocks: int
    shared: dict = field(default_factory=dict)  # store.shared_host.shared_stats(): segments created / mapped


def replica_main(spec: ReplicaSpec, conn: Connection) -> None:
    """The replica process: build, report, serve until ("stop", None) or the pipe closes."""
    try:
        # The router stops replicas ("stop", then a kill); Ctrl-C in a terminal reaches every process of the group,
        # and SIGTERM may come before the router's "stop" at its exit: both end the loop the orderly way, so the
        # shared tables are released (the last process out unlinks them).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        if spec.visible_devices is not None:
            os.environ.update(CUDA_VISIBLE_DEVICES=spec.visible_devices)  # before this process touches CUDA
        logging.basicConfig(level=spec.log_level,
                            format=f"%(asctime)s %(levelname)s replica {spec.index} %(name)s: %(message)s")
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        llm = spec.build(spec)
        engine = llm.engine
        conn.send(("ready", ReplicaInfo(spec.index, os.getpid(), engine.max_model_len,
                                        engine.executor.num_kv_blocks, shared_stats())))
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        sys.exit(EXIT_BUILD_FAILED)  # (not os._exit: atexit releases the shared tables made so far)
    code = ReplicaLoop(engine, conn).run()
    close = getattr(engine.executor, "close", None)
    if close is not None:
        close()  # its TP ranks, if any
    conn.close()
    del llm, engine
    gc.collect()  # the tables go now: the last replica to release a shared copy unlinks it
    sys.exit(code)


def _exit_on_signal(signum: int, _frame) -> None:
    sys.exit(128 + signum)


def _send(conn: Connection, msg: tuple) -> bool:
    try:
        conn.send(msg)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):  # the router is gone: nothing to report to
        return False


class ReplicaLoop:
    """The replica's step loop: messages between steps, a step whenever the engine has work."""

    def __init__(self, engine: Any, conn: Connection):
        self.engine, self.conn = engine, conn
        self.last_step = -1  # the last step id whose record was sent

    def run(self) -> int:
        """-> the process's exit code: 0 after "stop" or a closed pipe, EXIT_EXECUTOR_FAILED."""
        while True:
            busy = self.engine.has_unfinished()
            try:
                ready = self.conn.poll(0 if busy else None)
                while ready:
                    if not self._handle(self.conn.recv()):
                        return 0
                    ready = self.conn.poll(0)
            except (EOFError, OSError):  # the router's end closed: it is gone
                return 0
            if self.engine.has_unfinished() and not self._step():
                return EXIT_EXECUTOR_FAILED

    def _handle(self, msg: tuple) -> bool:
        kind, body = msg
        if kind == "add":
            for rid, prompt, params in body:
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:  # checked by the router first: a refusal here is a failure of this request
                    _send(self.conn, ("failed", [rid], f"{type(e).__name__}: {e}", []))
        elif kind == "abort":
            for rid in body:
                self.engine.abort_request(rid)
        elif kind == "reset_prefix_cache":
            _send(self.conn, ("reset", self.engine.reset_prefix_cache()))
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"replica message {kind!r} is not one of add, abort, reset_prefix_cache, stop")
        return True

    def _step(self) -> bool:
        """One step and its report -> False when the executor failed for good."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            if executor_failed(e):
                _send(self.conn, ("fatal", f"{type(e).__name__}: {e}"))
                return False
            ids = getattr(e, "request_ids", None)  # None: the error does not say; the router fails all of ours
            for rid in ids or []:
                self.engine.abort_request(rid)
            _send(self.conn, ("failed", list(ids) if ids else None, f"{e}", list(getattr(e, "outputs", None) or [])))
            return True
        records = self.engine.step_trace(self.last_step)
        if records:
            self.last_step = records[-1].step_id
        return _send(self.conn, ("step", outputs, self.engine.stats(), records)) or True
