"""EngineProcess: the API process's side of engine loop "process" (the contract is bridge.py's). It spawns the engine
process (engine_proc.py), writes requests and aborts to it from a writer thread (a full pipe never blocks the event
loop), and reads its one message a step on a reader thread, which detokenizes the step's outputs and matches stop
strings (output_processor.py) before handing them to the event loop, one wake-up a step. Requests are checked here
(engine/request_check.py) so that the engine process only refuses what it alone can tell.

The reader waits on the pipe and the process's sentinel together: an engine process that dies (killed, crashed)
fails every request in flight and calls ``on_fatal`` (the server exits non-zero) at once; one that dies while loading
is a load error. ``shutdown`` sends "stop" and kills the process if it has not ended within the timeout.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from multiprocessing import connection
from typing import Any

import torch.multiprocessing as mp

from engram.engine.request_check import check_request
from engram.engine.step_trace import StepTrace
from engram.server.bridge import EngineBridge, RequestFailed
from engram.server.engine_proc import engine_main
from engram.server.output_processor import OutputProcessor

log = logging.getLogger("engram.server")


class EngineProcess(EngineBridge):
    mode = "process"

    def __init__(self, *args: Any, **kwargs: Any):  # EngineBridge's; ``build`` crosses the spawn (picklable)
        super().__init__(*args, **kwargs)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer thread (None: stop)
        self._processor: OutputProcessor | None = None
        self.trace = StepTrace()
        self.proc: Any = None
        self._stopping = False

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        inbox_r, inbox_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        # not a daemon: the engine process starts its own TP ranks or DP replicas (daemons may have no children)
        self.proc = ctx.Process(target=engine_main, name="engram-engine", daemon=False,
                                args=(self._build, inbox_r, out_w, logging.getLogger().getEffectiveLevel()))
        self.proc.start()
        inbox_r.close()
        out_w.close()
        self._to_engine, self._from_engine = inbox_w, out_r
        threading.Thread(target=self._write, name="engram-engine-writer", daemon=True).start()
        threading.Thread(target=self._read, name="engram-engine-reader", daemon=True).start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._outbox.put(("stop", None))
        self._outbox.put(None)
        if self.proc is None:
            return
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine process (pid %d) did not stop within %g s: killed", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.join(timeout)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def step_trace(self, since: int = -1) -> list:
        return self.trace.since(since)

    # ----------------------------------------------------------------- asyncio side
    def _check(self, requests: list[tuple[str, list[int], Any]]) -> None:
        info = self.model_info
        for rid, prompt, params in requests:
            check_request(rid, prompt, params, info.tokenizer, info.max_model_len)

    def _submit(self, kind: str, body: Any) -> None:
        if kind == "add":  # the text is this process's: the engine sends token ids
            for rid, prompt, params in body:
                self._processor.add(rid, list(prompt), params)
            body = [(rid, prompt, dataclasses.replace(params, stop=None, detokenize=False))
                    for rid, prompt, params in body]
        self._outbox.put((kind, body))

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._processor.drop(rid)

    # ----------------------------------------------------------------- writer and reader threads
    def _write(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._to_engine.send(msg)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):  # the reader reports the death
                return

    def _read(self) -> None:
        try:
            while True:
                ready = connection.wait([self._from_engine, self.proc.sentinel])
                if self._from_engine in ready:
                    try:
                        msg = self._from_engine.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and self._take(msg):
                        continue
                self._ended()
                return
        except Exception as e:  # a bug here must still fail the requests and stop the server
            log.exception("the engine process reader failed")
            self._gone(f"the engine process reader failed: {type(e).__name__}: {e}")

    def _take(self, msg: tuple) -> bool:
        """Handle one message -> False once the engine process said it ends (load error, fatal)."""
        kind = msg[0]
        if kind == "step":
            self._step(msg[1], msg[2], msg[3])
        elif kind == "added":
            for rid, refusal in msg[1]:
                if refusal is None:
                    self._accepted(rid)
                else:
                    self._processor.drop(rid)
                    error = ValueError if refusal[0] == "invalid" else RequestFailed
                    self._accepted(rid, error(refusal[1]))
        elif kind == "failed":
            ids, error = msg[1], msg[2]
            failed = self._fail(ids, error)
            if ids is None:
                self._outbox.put(("abort", failed))
            self._step(msg[3], msg[4], msg[5])
        elif kind == "reset":
            self._reset_done(msg[1])
        elif kind == "ready":
            self.model_info = msg[1]
            self._processor = OutputProcessor(self.model_info.tokenizer)
            self.ready.set()
        elif kind == "load_error":
            self._load_failed(msg[1])
            return False
        elif kind == "fatal":
            self._gone(msg[1])
            return False
        else:
            raise ValueError(f"engine process message {kind!r} is not one of ready, load_error, added, step, failed, "
                             "reset, fatal")
        return True

    def _step(self, deltas: list, stats: dict, records: list) -> None:
        outputs, stopped = self._processor.process(deltas)
        if stopped:
            self._outbox.put(("abort", stopped))
        self._deliver_step(outputs)
        for rec in records:
            self.trace.append(rec)
        self._report(stats)

    def _ended(self) -> None:
        """The pipe closed or the process ended without saying why."""
        if self._stopping or self.load_error is not None or self.fatal_error is not None:
            return
        self.proc.join(5.0)
        code = "still running" if self.proc.is_alive() else f"exit code {self.proc.exitcode}"
        why = f"the engine process (pid {self.proc.pid}, {code}) ended"
        if not self.ready.is_set():
            self._load_failed(why + " while loading")
        else:
            self._gone(why)

    def _gone(self, why: str) -> None:
        if not self._stopping:
            self._stop_engine(why)
