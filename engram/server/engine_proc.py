"""The engine process of ``engram serve`` (vLLM V1's EngineCore shape): a process the API process (engine_client.py)
spawns; it builds the engine (``build()``: an ``engram.LLM``, with its TP ranks, PP stages or DP replicas as its own
children) and runs its step loop on the requests the API process sends. It never detokenizes: requests arrive with
``detokenize=False`` and outputs leave as token ids, logprobs and finish reasons, one message a step for all of them.

Messages, over two one-way pipes. In: ("add", [(request_id, prompt ids, SamplingParams)]), ("abort", [request_id]),
("reset_prefix_cache", None), ("stop", None). Out: ("ready", ModelInfo) once built, or ("load_error", reason) and
exit code 1; ("added", [(request_id, None | (kind, message))]) for each "add" before any step that ran its requests
(kind "invalid": a 400, "failed": a 500); ("step", [TokenDelta], stats, StepRecords) after a step that gave outputs
(stats None when ``engine.stats()`` failed: logged, never fatal); ("failed", request_ids | None, message,
[TokenDelta], stats, StepRecords) after a step that failed some (None: the error named none, the API side fails all of
its own); ("reset", dropped blocks); ("fatal", message) and exit code 4 once the executor failed for good (a TP rank,
PP stage or DP replica died), wherever that surfaced. The loop ends at "stop" or when the inbox closes (the API
process is gone).
"""
from __future__ import annotations

import gc
import logging
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple

from engram.engine.executor import executor_failed
from engram.server.engine_loop import LoopClock

EXIT_LOAD_FAILED, EXIT_ENGINE_FAILED = 1, 4


@dataclass(frozen=True)
class ModelInfo:
    """What the API side needs of the loaded model (picklable: the engine process sends it once it is ready)."""

    tokenizer: Any  # tokenizers.Tokenizer: prompts, echo, logprobs' token strings, and the text of every output
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    max_model_len: int  # prompt + output tokens per sequence

    @classmethod
    def of(cls, llm: Any) -> "ModelInfo":
        loaded = llm.loaded
        return cls(loaded.tokenizer, loaded.chat_template, loaded.model_config.bos_token_id, loaded.eos_token_id,
                   llm.engine.max_model_len)


class TokenDelta(NamedTuple):
    """One request's part of a step's outputs (a tuple on the wire: a named class per field would pickle far slower)."""

    request_id: str
    token_ids: list[int]  # the tokens the step added
    logprobs: list | None  # their TokenLogprobs, when the request asked for logprobs
    finish_reason: str | None  # the engine's: "stop" (EOS or a stop token), "length"; None while it runs
    stop_reason: int | str | None  # the stop token id that ended it
    prompt_logprobs: list | None  # with the request's first output only, when it asked for prompt logprobs


def deltas(outputs: list, first: set[str]) -> list[TokenDelta]:
    """``outputs`` (RequestOutputs of ``output_kind`` "delta") as TokenDeltas; ``first``: ids whose first output this
    is not yet (their prompt logprobs go with it; they leave the set)."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        prompt_logprobs = None
        if o.request_id in first:
            first.discard(o.request_id)
            prompt_logprobs = o.prompt_logprobs
        out.append(TokenDelta(o.request_id, list(c.delta_token_ids), c.logprobs, c.finish_reason, c.stop_reason,
                              prompt_logprobs))
        if o.finished:
            first.discard(o.request_id)
    return out


def engine_main(build: Callable[[], Any], inbox: Connection, outbox: Connection, log_level: int) -> None:
    """The engine process: build, report, serve until "stop" or the inbox closes."""
    # Ctrl-C in a terminal reaches every process of the group: the API process drains and then stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    try:
        llm = build()
        outbox.send(("ready", ModelInfo.of(llm)))
    except BaseException as e:
        logging.getLogger("engram.server").error("%s", traceback.format_exc())
        _send(outbox, ("load_error", f"{e}" or type(e).__name__))
        sys.exit(EXIT_LOAD_FAILED)
    engine = llm.engine
    code = EngineCoreLoop(engine, inbox, outbox).run()
    for owner in (engine, getattr(engine, "executor", None)):  # DP replicas; TP ranks
        close = getattr(owner, "close", None)
        if close is not None:
            close()
    outbox.close()
    del llm, engine
    gc.collect()
    sys.exit(code)


def _send(conn: Connection, msg: tuple) -> bool:
    try:
        conn.send(msg)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):  # the API process is gone
        return False


class EngineCoreLoop:
    """Messages between steps, a step whenever the engine has work, one message out per step."""

    def __init__(self, engine: Any, inbox: Connection, outbox: Connection):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.clock = LoopClock()
        self.last_step = -1  # the last step id whose record was sent
        self._first: set[str] = set()  # requests whose first output has not gone out (prompt logprobs)

    def run(self) -> int:
        """-> the process's exit code: 0 after "stop" or a closed inbox, EXIT_ENGINE_FAILED once the executor failed
        for good, wherever that shows (a step, a stats read, an add or an abort that reached a dead rank or replica):
        the API side then gets "fatal" with the executor's reason, never a bare exit."""
        try:
            return self._serve()
        except Exception as e:
            if not executor_failed(e):
                raise
            _send(self.outbox, ("fatal", f"{type(e).__name__}: {e}"))
            return EXIT_ENGINE_FAILED

    def _serve(self) -> int:
        _send(self.outbox, ("step", [], self._stats(), []))  # the snapshot (and this loop's pid) before any step
        while True:
            try:
                ready = self.inbox.poll(0 if self.engine.has_unfinished() else None)
                while ready:
                    if not self._handle(*self.inbox.recv()):
                        return 0
                    ready = self.inbox.poll(0)
            except (EOFError, OSError):  # the API process is gone
                return 0
            if self.engine.has_unfinished() and not self._step():
                return EXIT_ENGINE_FAILED

    def _handle(self, kind: str, body: Any) -> bool:
        if kind == "add":
            replies = []
            for rid, prompt, params in body:
                try:
                    self.engine.add_request(rid, prompt, params)
                    self._first.add(rid)
                    replies.append((rid, None))
                except ValueError as e:
                    replies.append((rid, ("invalid", str(e))))
                except Exception as e:  # fails this request only, never the loop (a dead executor: run's)
                    if executor_failed(e):
                        raise
                    logging.getLogger("engram.server").exception("add_request failed for %s", rid)
                    self.engine.abort_request(rid)
                    replies.append((rid, ("failed", f"request failed in the engine: {e}")))
            _send(self.outbox, ("added", replies))
        elif kind == "abort":
            for rid in body:
                self.engine.abort_request(rid)
                self._first.discard(rid)
            if not self.engine.has_unfinished():
                _send(self.outbox, ("step", [], self._stats(), []))  # the gauges must show the emptied engine
        elif kind == "reset_prefix_cache":
            _send(self.outbox, ("reset", self.engine.reset_prefix_cache()))
            _send(self.outbox, ("step", [], self._stats(), []))
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"engine message {kind!r} is not one of add, abort, reset_prefix_cache, stop")
        return True

    def _step(self) -> bool:
        """One step and its message -> False when the executor failed for good."""
        outcome = self.clock.step(self.engine)
        if outcome.fatal:
            _send(self.outbox, ("fatal", outcome.error))
            return False
        since = time.perf_counter()
        for rid in outcome.failed or []:
            self._first.discard(rid)
        out = deltas(outcome.outputs, self._first)
        records = self.engine.step_trace(self.last_step)
        if records:
            self.last_step = records[-1].step_id
        stats = self._stats()
        if outcome.failed is None or outcome.failed:
            sent = _send(self.outbox, ("failed", outcome.failed, outcome.error, out, stats, records))
        else:
            sent = _send(self.outbox, ("step", out, stats, records))
        self.clock.delivered(since)
        return sent or True

    def _stats(self) -> dict | None:
        """``engine.stats()`` with the loop's host times; None (logged) when it fails other than by a dead executor:
        metrics never stop the engine."""
        try:
            stats = self.engine.stats()
        except Exception as e:
            if executor_failed(e):
                raise
            logging.getLogger("engram.server").exception("engine.stats() failed")
            return None
        stats["engine_loop"] = self.clock.snapshot()
        return stats
