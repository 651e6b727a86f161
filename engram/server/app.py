"""FastAPI routes of `engram serve` and the mapping of refusals to OpenAI error bodies (logic: serving.py).

A bad request gets 400/404/408/413, never a 500; every refusal (4xx, and 503 when loading, full or stopping)
is counted once in ``engram_requests_rejected_total{reason}``.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engram.server import DEFAULT_MAX_REQUEST_BYTES
from engram.engine.step_trace import StepTrace
from engram.server.engine_client import EngineClient
from engram.server.metrics import ServerMetrics
from engram.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from engram.server.serving import REJECT_REASONS, ApiError, OpenAIServing


def error_response(body: dict, status: int, headers: dict[str, str] | None = None) -> Response:
    """A JSON error response. ASCII-escaped, so that anything a client sent and the message repeats (a lone
    surrogate in a field name, say) can never make the error itself fail to encode."""
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, headers=headers,
                    media_type="application/json")


class BodyLimit:
    """ASGI middleware: the whole body is read before the app runs. Over ``limit`` bytes: 413 before anything
    parses it; not arrived ``timeout`` seconds after the head: 408; still arriving once ``stopping`` is set:
    503. Each refusal calls ``on_reject(reason)`` ("too_large", "timeout", "shutting_down") and closes the
    connection; a body within the limits reaches the app as one message."""

    def __init__(self, app: Callable, limit: int, on_reject: Callable[[str], None], timeout: float | None = None,
                 stopping: asyncio.Event | None = None):
        self.app, self.limit, self.on_reject, self.timeout, self.stopping = app, limit, on_reject, timeout, stopping

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send, "too_large")
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        chunks, size = [], 0
        while True:
            message = await self._next(receive, deadline, loop)
            if isinstance(message, str):  # "timeout" or "shutting_down"
                return await self._refuse(scope, receive, send, message)
            if message["type"] != "http.request":  # the client left: let the app see it
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send, "too_large")
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending = [first]

        async def replay() -> dict:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _next(self, receive: Callable[[], Awaitable[dict]], deadline: float | None,
                    loop: asyncio.AbstractEventLoop) -> dict | str:
        """The next message of the body, or "timeout" once ``deadline`` passes, or "shutting_down" once
        ``stopping`` is set, whichever comes first (a message that is already there wins)."""
        if deadline is None and self.stopping is None:
            return await receive()
        got = asyncio.ensure_future(receive())
        waits = {got}
        stop = asyncio.ensure_future(self.stopping.wait()) if self.stopping is not None else None
        if stop is not None:
            waits.add(stop)
        try:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                if not task.done():
                    task.cancel()
        if got.done() and not got.cancelled():
            return got.result()
        return "shutting_down" if stop is not None and stop.done() else "timeout"

    async def _refuse(self, scope: dict, receive: Callable, send: Callable, reason: str) -> None:
        self.on_reject(reason)
        if reason == "too_large":
            status, message = 413, (f"the request body is larger than this server's limit of {self.limit} bytes "
                                    "(--max-request-bytes)")
        elif reason == "timeout":
            status, message = 408, (f"the request body did not arrive within {self.timeout:g} seconds "
                                    "(--timeout-request-body)")
        else:
            status, message = 503, "the server is shutting down; the request was not started"
        await error_response(error_body(message, code=status, param=None), status,
                             {"Connection": "close"})(scope, receive, send)


def build_app(build_llm: Callable[[], Any], model_name: str, tier: str, max_num_seqs: int,
              max_waiting: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              on_load_error: Callable[[str], None] | None = None, body_timeout: float | None = None,
              on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """``build_llm`` (picklable) returns an ``engram.LLM``, built in the engine process that the app's startup spawns
    (/health is 503 meanwhile); if it raises, ``on_load_error(reason)`` is called, and ``on_fatal(reason)`` once the
    engine failed for good. ``body_timeout``: seconds a body may take (None: no limit). Setting
    ``app.state.stopping`` refuses bodies still arriving."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes={max_request_bytes} must be >= 1")
    metrics = ServerMetrics(model_name, tier)
    engine = EngineClient(build_llm, max_num_seqs, max_waiting, on_stats=metrics.update, on_load_error=on_load_error,
                          on_fatal=on_fatal)
    serving = OpenAIServing(engine, model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()
        serving.close()

    app = FastAPI(title="engram", lifespan=lifespan)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics
    app.state.stopping = asyncio.Event()
    app.add_middleware(BodyLimit, limit=max_request_bytes, timeout=body_timeout, stopping=app.state.stopping,
                       on_reject=lambda reason: metrics.rejected.labels(reason=reason).inc())

    def refuse(status: int, body: dict, reason: str | None, headers: dict[str, str] | None = None) -> Response:
        if reason is not None:
            metrics.rejected.labels(reason=reason).inc()
        return error_response(body, status, headers)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return refuse(e.status, e.body, e.reason, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return refuse(400, error_body("the request body is not valid JSON"), "invalid")
        unknown = [err for err in errors if err.get("type") == "extra_forbidden"]
        if unknown:
            where = [_where(err) for err in unknown]
            msg = "; ".join(f"{w}: unknown field, not supported by this server" for w in where)
            return refuse(400, error_body(msg, param=where[0]), "unsupported")
        msg, param = _summary(errors)
        return refuse(400, error_body(msg, param=param), "invalid")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return refuse(e.status_code, error_body(str(e.detail), "NotFoundError" if e.status_code == 404 else
                                                "invalid_request_error", e.status_code),
                      REJECT_REASONS.get(e.status_code, "invalid") if 400 <= e.status_code < 500 else None)

    @app.get("/health")
    async def health():
        if engine.ready.is_set():
            return Response(status_code=200)
        failed = engine.fatal_error or engine.load_error
        return error_response({"status": "error" if failed else "loading", "detail": failed}, 503)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return serving.model(model_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached prefix block (vLLM's route; benchmarks start cold with it)."""
        if not engine.ready.is_set():
            return error_response({"status": "loading", "detail": engine.load_error}, 503)
        return {"reset": True, "dropped_blocks": await engine.reset_prefix_cache()}

    @app.get("/engram/steps")
    async def steps(since: int = -1):
        """The engine's step records after step id ``since`` (engine/step_trace.py) and its counters: what
        ``engram bench serve`` reads for the serving roofline."""
        if not engine.ready.is_set():
            return error_response({"status": "loading", "detail": engine.load_error}, 503)
        body = StepTrace.to_json(engine.step_trace(since))
        body["stats"] = metrics.snapshot()
        return body

    return app


_UNION_TAGS = ("str", "int", "float", "bool", "none")  # pydantic's names of union members in error paths


def _where(err: dict) -> str:
    """The dotted field path of a pydantic error, without FastAPI's leading "body" and without the union
    member names pydantic puts in it ("prompt.list[int]" -> "prompt"); "request body" for the body itself."""
    parts = [str(x) for x in err.get("loc", ())
             if x != "body" and not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS))]
    return ".".join(parts) or "request body"


def _summary(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors and the first field it names; a field whose value error comes from
    our check reports that alone, not the other union members' type mismatches."""
    items = [(_where(err), str(err.get("msg", "")).removeprefix("Value error, "), err.get("type")) for err in errors]
    checked = {w for w, _, kind in items if kind == "value_error"}
    kept = list(dict.fromkeys(f"{w}: {m}" for w, m, kind in items if kind == "value_error" or w not in checked))
    first = next((w for w, _, kind in items if kind == "value_error" or w not in checked), None)
    return "; ".join(kept), None if first == "request body" else first
