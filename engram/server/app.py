"""FastAPI routes of `engram serve` (routes only; the logic is in serving.py).

/health answers 200 only once the model is loaded (503 while loading or after a failed load);
/v1/models, /v1/completions, /v1/chat/completions follow the OpenAI API; /metrics is Prometheus text.
Bad requests get OpenAI-style error bodies with 400/404/422, never a 500.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engram.server.async_engine import AsyncEngine
from engram.server.metrics import ServerMetrics
from engram.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from engram.server.serving import ApiError, OpenAIServing


def build_app(build_llm: Callable[[], Any], model_name: str, tier: str, max_num_seqs: int,
              max_waiting: int = 256) -> FastAPI:
    """``build_llm`` runs on the engine thread and returns an ``engram.LLM`` (the model loads there, so
    /health can answer 503 meanwhile)."""
    metrics = ServerMetrics(model_name, tier)
    engine = AsyncEngine(build_llm, max_num_seqs, max_waiting, on_step=metrics.update_from_engine)
    serving = OpenAIServing(engine, model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="engram", lifespan=lifespan)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body')}: {err.get('msg')}"
                        for err in errors)
        return JSONResponse(error_body(msg, param=loc or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "NotFoundError" if e.status_code == 404 else
                                       "invalid_request_error", e.status_code), status_code=e.status_code)

    @app.get("/health")
    async def health():
        if engine.ready.is_set():
            return Response(status_code=200)
        return JSONResponse({"status": "error" if engine.load_error else "loading", "detail": engine.load_error},
                            status_code=503)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
