"""AsyncEngine: the engine's step loop on one background thread of the API process (engine loop "thread"; the
contract is bridge.py's). Every engine call happens on that thread: requests, aborts and resets arrive through a queue
and are handed to the engine between steps; the engine detokenizes and matches stop strings itself.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Any

from engram.server.bridge import EngineBridge, ModelInfo, RequestFailed
from engram.server.engine_loop import LoopClock

log = logging.getLogger("engram.server")


class AsyncEngine(EngineBridge):
    mode = "thread"

    def __init__(self, *args: Any, **kwargs: Any):  # EngineBridge's
        super().__init__(*args, **kwargs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engram-engine", daemon=True)
        self.llm: Any = None  # the engram.LLM built on the engine thread
        self.engine: Any = None  # its LLMEngine (add_request / abort_request / step / has_unfinished)
        self._clock: LoopClock | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def step_trace(self, since: int = -1) -> list:
        return self.engine.step_trace(since)

    def _submit(self, kind: str, body: Any) -> None:
        self._inbox.put((kind, body))
        self._wake.set()

    # ----------------------------------------------------------------- engine thread
    def _drain_inbox(self) -> bool:
        """Hand queued adds, aborts and prefix-cache resets to the engine; True if there were any."""
        seen = False
        while True:
            try:
                kind, body = self._inbox.get_nowait()
            except queue.Empty:
                return seen
            seen = True
            if kind == "add":
                for rid, prompt, params in body:
                    self._add(rid, prompt, params)
            elif kind == "reset_prefix_cache":
                self._reset_done(self.engine.reset_prefix_cache())
                self._report_stats()  # the gauges show the empty cache at once
            else:
                for rid in body:
                    self.engine.abort_request(rid)

    def _add(self, rid: str, prompt: list[int], params: Any) -> None:
        if not self._is_open(rid):  # the client left before the engine saw the request
            return
        try:
            self.engine.add_request(rid, prompt, params)
        except ValueError as e:  # a bad request: 400
            self._accepted(rid, e)
            return
        except Exception as e:  # anything else fails this request only, never the engine thread
            log.exception("add_request failed for %s", rid)
            self.engine.abort_request(rid)
            self._accepted(rid, RequestFailed(f"request failed in the engine: {e}"))
            return
        self._accepted(rid)

    def _run(self) -> None:
        try:
            self.llm = self._build()
            self.engine = self.llm.engine
            self.model_info = ModelInfo.of(self.llm)
        except Exception as e:  # /health says "error" with the reason until the owner stops the server
            log.error("%s", traceback.format_exc())
            self._load_failed(str(e))
            return
        self._clock = LoopClock(self.mode)
        self._report_stats()  # the snapshot (and this loop's thread id) before any step
        self.ready.set()
        while not self._stop.is_set():
            if self._drain_inbox() and not self.engine.has_unfinished():
                self._report_stats()  # an abort may have emptied the engine: the gauges must say so
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            outcome = self._clock.step(self.engine)
            if outcome.fatal:
                self._stop.set()
                self._stop_engine(outcome.error)
                return
            since = time.perf_counter()
            if outcome.failed is None:  # the error named no request: every one in flight fails
                for rid in self._fail(None, outcome.error):
                    self.engine.abort_request(rid)
            elif outcome.failed:
                self._fail(outcome.failed, outcome.error)
            self._deliver_step(outcome.outputs)
            self._report_stats()
            self._clock.delivered(since)

    def _report_stats(self) -> None:
        try:
            snapshot = self.engine.stats()
        except Exception:  # metrics must never stop the engine
            log.exception("engine.stats() failed")
            return
        snapshot["engine_loop"] = self._clock.snapshot()
        self._report(snapshot)
