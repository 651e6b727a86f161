"""AsyncEngine: the engine's step loop on one background thread, bridged to asyncio.

Every engine call happens on that thread (requests and aborts arrive through a queue). A group of requests
(one HTTP request's choices) is admitted whole or not at all, within ``max_num_seqs + max_waiting``, and
leaving its iterator early aborts its unfinished requests. A step that raises fails only the requests it held; one
whose executor failed for good (``ExecutorFailed``: a tensor-parallel rank died) fails every request, stops the loop
and calls ``on_fatal(reason)`` (the server then exits non-zero).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engram.engine.executor import executor_failed

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


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, build: Callable[[], Any], max_num_seqs: int, max_waiting: int = 256,
                 on_step: Callable[[Any, list], None] | None = None,
                 on_load_error: Callable[[str], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        self._build = build
        self._on_load_error, self._on_fatal = on_load_error, on_fatal
        self.capacity = max_num_seqs + max_waiting
        self._on_step = on_step  # called on the engine thread after each step (metrics)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engram-engine", daemon=True)
        self.llm: Any = None  # the engram.LLM built on the engine thread
        self.engine: Any = None  # its LLMEngine (add_request / abort_request / step / has_unfinished)
        self.max_model_len: int | None = None  # prompt + output tokens per sequence, once loaded
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.fatal_error: str | None = None  # why the engine stopped for good after it was ready (ExecutorFailed)

    # ----------------------------------------------------------------- asyncio side
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    async def generate(self, requests: list[tuple[str, str | list[int], Any]]) -> AsyncIterator[Any]:
        """Run ``requests`` ([(request_id, prompt, params)]) as one group; yield their RequestOutputs in step
        order until all have finished. Before the first yield: ValueError for a request the engine refuses,
        EngineOverloaded when the group does not fit, EngineNotReady; RequestFailed when the engine fails any
        of them. Requests still running when the iterator is left are aborted."""
        if not self.ready.is_set():
            raise EngineNotReady(self.fatal_error or self.load_error or "the model is still loading")
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()  # one queue: outputs in step order
        ids = [rid for rid, _, _ in requests]
        with self._lock:
            if len(self._streams) + len(ids) > self.capacity:
                raise EngineOverloaded()
            for rid in ids:
                self._streams[rid] = _Stream(loop, outputs)
        self._inbox.put(("add", list(requests)))  # one message: all are added before the next step
        self._wake.set()
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
            for rid in running:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefix blocks, on the engine thread between steps -> how many it dropped."""
        if not self.ready.is_set():
            raise EngineNotReady(self.fatal_error or self.load_error or "the model is still loading")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(("reset_prefix_cache", lambda n: loop.call_soon_threadsafe(done.set_result, n)))
        self._wake.set()
        return await done

    # ----------------------------------------------------------------- engine thread
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

    def _drain_inbox(self) -> bool:
        """Hand queued adds, aborts and prefix-cache resets to the engine; True if there were any."""
        seen = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return seen
            seen = True
            if msg[0] == "add":
                for rid, prompt, params in msg[1]:
                    self._add(rid, prompt, params)
            elif msg[0] == "reset_prefix_cache":
                msg[1](self.engine.reset_prefix_cache())
                self._report([])  # the gauges show the empty cache at once
            else:
                self.engine.abort_request(msg[1])

    def _add(self, rid: str, prompt: str | list[int], params: Any) -> None:
        if rid not in self._streams:  # the client left before the engine saw the request
            return
        try:
            self.engine.add_request(rid, prompt, params)
        except ValueError as e:  # a bad request: 400
            self._deliver(rid, e)
            return
        except Exception as e:  # anything else fails this request only, never the engine thread
            log.exception("add_request failed for %s", rid)
            self.engine.abort_request(rid)
            self._deliver(rid, RequestFailed(f"request failed in the engine: {e}"))
            return
        self._deliver(rid, _ACCEPTED)

    def _run(self) -> None:
        try:
            self.llm = self._build()
            self.engine = self.llm.engine
            self.max_model_len = self.engine.max_model_len
        except Exception as e:  # /health says "error" with the reason until the owner stops the server
            self.load_error = f"model failed to load: {e}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            if self._on_load_error is not None:
                self._on_load_error(self.load_error)
            return
        self.ready.set()
        while not self._stop.is_set():
            if self._drain_inbox() and not self.engine.has_unfinished():
                self._report([])  # an abort may have emptied the engine: the gauges must say so
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._fail_step(e)
                continue
            self._deliver_step(outputs)
            self._report(outputs)

    def _report(self, outputs: list) -> None:
        if self._on_step is not None:
            try:
                self._on_step(self.engine, outputs)
            except Exception:  # metrics must never stop the engine
                log.exception("on_step hook failed")

    def _fail_step(self, error: Exception) -> None:
        """Fail ``error.request_ids`` (every request when it does not say) and deliver ``error.outputs``, the
        requests that advanced anyway; the engine goes on, unless its executor failed (``_stop_engine``)."""
        if executor_failed(error):
            self._stop_engine(error)
            return
        ids = list(getattr(error, "request_ids", None) or list(self._streams))
        log.error("engine step failed for %d request(s): %s", len(ids), error)
        for rid in ids:
            self.engine.abort_request(rid)
            self._deliver(rid, RequestFailed(f"request failed in the engine: {error}"))
        outputs = list(getattr(error, "outputs", None) or [])
        self._deliver_step(outputs)
        self._report(outputs)


    def _stop_engine(self, error: Exception) -> None:
        """The executor is gone: not ready any more, every request in flight failed, the loop stops, ``on_fatal``."""
        self.fatal_error = f"the engine stopped: {error}"
        self.ready.clear()
        log.error("%s; failing %d request(s) in flight", self.fatal_error, len(self._streams))
        self._stop.set()
        for rid in list(self._streams):
            self._deliver(rid, RequestFailed(f"request failed in the engine: {error}"))
        if self._on_fatal is not None:
            self._on_fatal(self.fatal_error)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
