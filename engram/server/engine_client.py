"""EngineClient: the API process's side of the engine, which runs in an engine process of its own (engine_proc.py,
vLLM V1's EngineCore split). It spawns that process, writes requests and aborts to it from a writer thread (a full
pipe never blocks the event loop), and reads its one message a step on a reader thread, which detokenizes the step's
outputs and matches stop strings (output_processor.py) before handing them to the event loop, one wake-up a step.
Requests are checked here (engine/request_check.py) so that the engine process only refuses what it alone can tell.

A group of requests (one HTTP request's choices) is admitted whole or not at all, within ``max_num_seqs +
max_waiting``, and leaving its iterator early aborts its unfinished requests. Each request's stream gets an accept (or
its refusal) before any output, then its outputs in step order. A step that raises fails only the requests it held.
The reader waits on the pipe and the process's sentinel together: an executor that failed for good (a tensor-parallel
rank, a pipeline stage or a data-parallel replica died) or an engine process that dies (killed, crashed) fails every
request in flight, turns not-ready and calls ``on_fatal(reason)`` (the server then exits non-zero) at once; one that
dies while loading is a load error. ``shutdown`` sends "stop" and kills the process if it has not ended in time.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
from multiprocessing import connection
from typing import Any, AsyncIterator, Callable

import torch.multiprocessing as mp

from engram.engine.request_check import check_request
from engram.engine.step_trace import StepTrace
from engram.server.engine_proc import ModelInfo, engine_main
from engram.server.output_processor import OutputProcessor

log = logging.getLogger("engram.server")

_ACCEPTED = object()  # first item of every stream once the engine has taken the request


class EngineOverloaded(Exception):
    """The waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int = 1):
        super().__init__("the server is at capacity; retry later")
        self.retry_after = retry_after


class EngineNotReady(Exception):
    """The engine is still loading (or failed to): requests get 503 until it is up."""


class RequestFailed(Exception):
    """The engine failed this request (e.g. a table read error); the server keeps serving."""


@dataclasses.dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop  # the event loop of the response that owns the request
    queue: asyncio.Queue  # that response's one queue: accepts, outputs and failures of all its choices in order


class EngineClient:
    """The API side (module docstring). ``on_stats(snapshot)`` gets the engine's ``stats()`` after each step (and
    after an abort or reset that changed the gauges), with the engine loop's host times under ``engine_loop``."""

    def __init__(self, build: Callable[[], Any], max_num_seqs: int, max_waiting: int = 256,
                 on_stats: Callable[[dict], None] | None = None,
                 on_load_error: Callable[[str], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        """``build()`` returns the ``engram.LLM``, called in the engine process (so it must be picklable)."""
        self._build = build
        self.capacity = max_num_seqs + max_waiting
        self._on_stats, self._on_load_error, self._on_fatal = on_stats, on_load_error, on_fatal
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._resets: collections.deque = collections.deque()  # (loop, future) of prefix-cache resets in flight
        self.model_info: ModelInfo | None = None  # once loaded
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.fatal_error: str | None = None  # why the engine stopped for good after it was ready
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer thread (None: stop)
        self._processor: OutputProcessor | None = None  # once loaded: detokenizes, matches stop strings
        self.trace = StepTrace()  # the engine's step records, as each step's message brings them
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

    def step_trace(self, since: int = -1) -> list:
        """The engine's StepRecords after step id ``since`` (engine/step_trace.py)."""
        return self.trace.since(since)

    # ----------------------------------------------------------------- asyncio side
    @property
    def max_model_len(self) -> int | None:
        return self.model_info.max_model_len if self.model_info is not None else None

    def _not_ready(self) -> EngineNotReady:
        return EngineNotReady(self.fatal_error or self.load_error or "the model is still loading")

    async def generate(self, requests: list[tuple[str, list[int], Any]]) -> AsyncIterator[Any]:
        """Run ``requests`` ([(request_id, prompt ids, params)]) as one group; yield their RequestOutputs in step
        order until all have finished. Before the first yield: ValueError for a request the engine refuses,
        EngineOverloaded when the group does not fit, EngineNotReady; RequestFailed when the engine fails any
        of them. Requests still running when the iterator is left are aborted."""
        if not self.ready.is_set():
            raise self._not_ready()
        info = self.model_info
        for rid, prompt, params in requests:
            check_request(rid, prompt, params, info.tokenizer, info.max_model_len)
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()  # one queue: outputs in step order
        ids = [rid for rid, _, _ in requests]
        with self._lock:
            if len(self._streams) + len(ids) > self.capacity:
                raise EngineOverloaded()
            for rid in ids:
                self._streams[rid] = _Stream(loop, outputs)
        for rid, prompt, params in requests:  # the text is this process's: the engine sends token ids
            self._processor.add(rid, list(prompt), params)
        self._outbox.put(("add", [(rid, prompt, dataclasses.replace(params, stop=None, detokenize=False))
                                  for rid, prompt, params in requests]))  # one message: all added before a step
        running = set(ids)
        try:
            accepted = 0
            while accepted < len(ids):  # accepts (or refusals) come before any step's outputs
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                assert item is _ACCEPTED
                accepted += 1
            while running:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    running.discard(item.request_id)
                yield item
        finally:
            with self._lock:
                for rid in ids:
                    self._streams.pop(rid, None)
            for rid in ids:
                self._processor.drop(rid)
            if running:
                self._outbox.put(("abort", sorted(running)))

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefix blocks, between steps -> how many it dropped."""
        if not self.ready.is_set():
            raise self._not_ready()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._resets.append((loop, done))
        self._outbox.put(("reset_prefix_cache", None))
        return await done

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
        """Handle one message (engine_proc.py lists them) -> False once the engine process said it ends."""
        kind = msg[0]
        if kind == "step":
            self._step(msg[1], msg[2], msg[3])
        elif kind == "added":
            for rid, refusal in msg[1]:
                if refusal is None:
                    self._deliver(rid, _ACCEPTED)
                else:
                    self._processor.drop(rid)
                    error = ValueError if refusal[0] == "invalid" else RequestFailed
                    self._deliver(rid, error(refusal[1]))
        elif kind == "failed":
            ids, error = msg[1], msg[2]
            failed = self._fail(ids, error)
            if ids is None:
                self._outbox.put(("abort", failed))
            self._step(msg[3], msg[4], msg[5])
        elif kind == "reset":
            loop, future = self._resets.popleft()
            loop.call_soon_threadsafe(future.set_result, msg[1])
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

    def _step(self, deltas: list, stats: dict | None, records: list) -> None:
        outputs, stopped = self._processor.process(deltas)
        if stopped:
            self._outbox.put(("abort", stopped))
        # the step's records and counters before its outputs: a client woken by its last token finds its steps in
        # the trace and the counters that include them
        for rec in records:
            self.trace.append(rec)
        if stats is not None and self._on_stats is not None:
            try:
                self._on_stats(stats)
            except Exception:  # metrics must never stop the engine
                log.exception("on_stats hook failed")
        self._deliver_step(outputs)

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _deliver_step(self, outputs: list) -> None:
        """A step's outputs, one wake-up per event loop: each wake-up is a syscall and takes the GIL."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, request_ids: list[str] | None, error: str) -> list[str]:
        """Fail ``request_ids`` (None: every open one) with RequestFailed -> the ids failed."""
        ids = list(self._streams) if request_ids is None else list(request_ids)
        for rid in ids:
            self._deliver(rid, RequestFailed(f"request failed in the engine: {error}"))
        return ids

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

    def _load_failed(self, reason: str) -> None:
        self.load_error = f"model failed to load: {reason}"
        log.error("%s", self.load_error)
        if self._on_load_error is not None:
            self._on_load_error(self.load_error)

    def _gone(self, why: str) -> None:
        """The engine is gone: not ready any more, every request in flight failed, ``on_fatal`` (not while stopping)."""
        if self._stopping:
            return
        self.fatal_error = f"the engine stopped: {why}"
        self.ready.clear()
        log.error("%s; failing %d request(s) in flight", self.fatal_error, len(self._streams))
        self._fail(None, why)
        while self._resets:
            loop, future = self._resets.popleft()
            loop.call_soon_threadsafe(future.set_exception, EngineNotReady(self.fatal_error))
        if self._on_fatal is not None:
            self._on_fatal(self.fatal_error)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
