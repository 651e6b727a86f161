"""EngineBridge: the asyncio side of the server's engine, whichever loop drives it (``ENGINE_LOOPS``): "thread", the
step loop on a thread of this process (async_engine.py), or "process", an engine process of its own reached over pipes
(engine_client.py). Both keep the same contract, written here once.

A group of requests (one HTTP request's choices) is admitted whole or not at all, within ``max_num_seqs +
max_waiting``, and leaving its iterator early aborts its unfinished requests. Each request's stream gets an accept (or
its refusal) before any output, then its outputs in step order. A step that raises fails only the requests it held;
an engine whose executor failed for good (a tensor-parallel rank or replica died, or the engine process) fails every
request, turns not-ready and calls ``on_fatal(reason)`` (the server then exits non-zero). Subclasses run the loop and
call ``_accepted`` / ``_deliver`` / ``_deliver_step`` / ``_stop_engine`` from their own thread.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

log = logging.getLogger("engram.server")

ENGINE_LOOPS = ("thread", "process")  # the server's typed setting (`engram serve --engine-loop`)
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


@dataclass(frozen=True)
class ModelInfo:
    """What the API side needs of the loaded model (picklable: an engine process sends it once it is ready)."""

    tokenizer: Any  # tokenizers.Tokenizer: prompts, echo, logprobs' token strings, and (loop "process") the text
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    max_model_len: int  # prompt + output tokens per sequence

    @classmethod
    def of(cls, llm: Any) -> "ModelInfo":
        loaded = llm.loaded
        return cls(loaded.tokenizer, loaded.chat_template, loaded.model_config.bos_token_id, loaded.eos_token_id,
                   llm.engine.max_model_len)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)


class EngineBridge:
    """The asyncio side (module docstring). ``on_stats(snapshot)`` gets the engine's ``stats()`` after each step (and
    after an abort or reset that changed the gauges), with the loop's host times under ``engine_loop``."""

    mode = ""  # one of ENGINE_LOOPS

    def __init__(self, build: Callable[[], Any], max_num_seqs: int, max_waiting: int = 256,
                 on_stats: Callable[[dict], None] | None = None,
                 on_load_error: Callable[[str], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        """``build()`` returns the ``engram.LLM``, called where the loop runs (picklable for "process")."""
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

    # ----------------------------------------------------------------- what a loop provides
    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def step_trace(self, since: int = -1) -> list:
        """The engine's StepRecords after step id ``since`` (engine/step_trace.py)."""
        raise NotImplementedError

    def _submit(self, kind: str, body: Any) -> None:
        """Hand ("add", [(id, prompt ids, params)]), ("abort", [ids]) or ("reset_prefix_cache", None) to the loop."""
        raise NotImplementedError

    def _check(self, requests: list[tuple[str, list[int], Any]]) -> None:
        """ValueError for a request the engine would refuse, before anything is submitted (default: the engine's own
        add_request refuses it, and the refusal arrives as the stream's first item)."""

    # ----------------------------------------------------------------- asyncio side
    @property
    def max_model_len(self) -> int | None:
        return self.model_info.max_model_len if self.model_info is not None else None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def not_ready_reason(self) -> str:
        return self.fatal_error or self.load_error or "the model is still loading"

    async def generate(self, requests: list[tuple[str, list[int], Any]]) -> AsyncIterator[Any]:
        """Run ``requests`` ([(request_id, prompt ids, params)]) as one group; yield their RequestOutputs in step
        order until all have finished. Before the first yield: ValueError for a request the engine refuses,
        EngineOverloaded when the group does not fit, EngineNotReady; RequestFailed when the engine fails any
        of them. Requests still running when the iterator is left are aborted."""
        if not self.ready.is_set():
            raise EngineNotReady(self.not_ready_reason())
        self._check(requests)
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()  # one queue: outputs in step order
        ids = [rid for rid, _, _ in requests]
        with self._lock:
            if len(self._streams) + len(ids) > self.capacity:
                raise EngineOverloaded()
            for rid in ids:
                self._streams[rid] = _Stream(loop, outputs)
        self._submit("add", list(requests))  # one message: all are added before the next step
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
            self._forget(ids)
            if running:
                self._submit("abort", sorted(running))

    def abort(self, request_id: str) -> None:
        self._submit("abort", [request_id])

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefix blocks, between steps -> how many it dropped."""
        if not self.ready.is_set():
            raise EngineNotReady(self.not_ready_reason())
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._resets.append((loop, done))
        self._submit("reset_prefix_cache", None)
        return await done

    def _forget(self, request_ids: list[str]) -> None:
        """The group's iterator is gone (hook for per-request state of the API side)."""

    # ----------------------------------------------------------------- the loop's thread
    def _is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    def _accepted(self, request_id: str, refusal: BaseException | None = None) -> None:
        self._deliver(request_id, _ACCEPTED if refusal is None else refusal)

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

    def _reset_done(self, dropped: int) -> None:
        loop, future = self._resets.popleft()
        loop.call_soon_threadsafe(future.set_result, dropped)

    def _report(self, snapshot: dict) -> None:
        if self._on_stats is not None:
            try:
                self._on_stats(snapshot)
            except Exception:  # metrics must never stop the engine
                log.exception("on_stats hook failed")

    def _load_failed(self, reason: str) -> None:
        self.load_error = f"model failed to load: {reason}"
        log.error("%s", self.load_error)
        if self._on_load_error is not None:
            self._on_load_error(self.load_error)

    def _stop_engine(self, error: str) -> None:
        """The engine is gone: not ready any more, every request in flight failed, ``on_fatal``."""
        self.fatal_error = f"the engine stopped: {error}"
        self.ready.clear()
        log.error("%s; failing %d request(s) in flight", self.fatal_error, len(self._streams))
        self._fail(None, error)
        while self._resets:
            loop, future = self._resets.popleft()
            loop.call_soon_threadsafe(future.set_exception, EngineNotReady(self.fatal_error))
        if self._on_fatal is not None:
            self._on_fatal(self.fatal_error)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
