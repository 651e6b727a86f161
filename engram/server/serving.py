"""OpenAI completions and chat completions on top of AsyncEngine: request -> SamplingParams -> engine ->
JSON body or an SSE stream that ends with ``data: [DONE]``.

Errors are raised as ApiError (status + OpenAI error body); app.py turns them into responses. A client
that disconnects, streaming or not, cancels its request (the engine frees the sequence).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from engram.server.async_engine import AsyncEngine, EngineNotReady, EngineOverloaded, RequestFailed
from engram.server.chat import render_chat
from engram.server.metrics import ServerMetrics
from engram.server.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, status, param), headers or {}


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics

    # ----------------------------------------------------------------- endpoints
    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self._check_model(req.model)
        prompt = req.prompt
        echo = prompt if req.echo and isinstance(prompt, str) else ""
        return await self._run(req, prompt, raw, "text_completion", new_id("cmpl"), echo)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if not self.engine.ready.is_set():
            raise ApiError(503, "the model is still loading", "ServiceUnavailableError", headers={"Retry-After": "5"})
        loaded = self.engine.llm.loaded
        try:
            prompt = render_chat(messages, loaded.chat_template, req.add_generation_prompt,
                                 _token_text(loaded.tokenizer, loaded.model_config.bos_token_id),
                                 _token_text(loaded.tokenizer, loaded.eos_token_id))
        except ValueError as e:
            raise ApiError(400, str(e), param="messages")
        return await self._run(req, prompt, raw, "chat.completion", new_id("chatcmpl"), "")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": now(),
                                            "owned_by": "engram", "root": self.model_name}]}

    # ----------------------------------------------------------------- shared path
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           "NotFoundError", "model")

    def _params(self, req: CompletionRequest | ChatCompletionRequest):
        from engram.engine.sampling_params import SamplingParams

        try:
            return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                  seed=req.seed, max_tokens=req.max_tokens, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise ApiError(400, str(e))

    async def _run(self, req, prompt, raw: Request, kind: str, rid: str, echo: str) -> Any:
        params = self._params(req)
        arrival = time.monotonic()
        gen = self.engine.generate(rid, prompt, params)
        try:
            first = await gen.__anext__()  # the engine accepted the request and produced a first token
        except StopAsyncIteration:
            raise ApiError(500, "the engine finished the request without output", "InternalServerError")
        except ValueError as e:
            self.metrics.rejected.labels("invalid").inc()
            raise ApiError(400, str(e), param="prompt")
        except EngineOverloaded as e:
            self.metrics.rejected.labels("overloaded").inc()
            raise ApiError(503, str(e), "ServiceUnavailableError", headers={"Retry-After": str(e.retry_after)})
        except EngineNotReady as e:
            raise ApiError(503, str(e), "ServiceUnavailableError", headers={"Retry-After": "5"})
        except RequestFailed as e:
            self.metrics.requests.labels("error").inc()
            raise ApiError(500, str(e), "InternalServerError")
        ttft = time.monotonic() - arrival
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(gen, first, kind, rid, echo, include_usage, arrival, ttft),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        final = await _until_done(gen, first, raw)
        if final is None:  # client went away; nobody reads this
            self.metrics.requests.labels("abort").inc()
            return None
        self._observe(final, arrival, ttft)
        return self._full_body(final, kind, rid, echo)

    async def _stream(self, gen: AsyncIterator, first, kind: str, rid: str, echo: str, include_usage: bool,
                      arrival: float, ttft: float) -> AsyncIterator[str]:
        created = now()
        out, failed = first, False
        try:
            if kind == "chat.completion":
                yield _sse(self._chunk(kind, rid, created, {"role": "assistant", "content": ""}, None))
            elif echo:
                yield _sse(self._chunk(kind, rid, created, echo, None))
            while True:
                c = out.outputs[0]
                delta = {"content": c.delta_text} if kind == "chat.completion" else c.delta_text
                if c.delta_text or c.finish_reason:
                    if c.finish_reason and kind == "chat.completion" and not c.delta_text:
                        delta = {}
                    yield _sse(self._chunk(kind, rid, created, delta, c.finish_reason, c.stop_reason))
                if out.finished:
                    break
                out = await gen.__anext__()
            self._observe(out, arrival, ttft)
            if include_usage:
                yield _sse({"id": rid, "object": _chunk_object(kind), "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage(out)})
            yield "data: [DONE]\n\n"
        except RequestFailed as e:
            failed = True  # counted here as an error, not again as an abort below
            self.metrics.requests.labels("error").inc()
            yield _sse(error_body(str(e), "InternalServerError", 500))
            yield "data: [DONE]\n\n"
        finally:
            if not out.finished and not failed:
                self.metrics.requests.labels("abort").inc()
            await gen.aclose()  # a disconnect lands here: the request is aborted

    # ----------------------------------------------------------------- bodies
    def _chunk(self, kind: str, rid: str, created: int, delta: Any, finish: str | None, stop=None) -> dict:
        if kind == "chat.completion":
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return {"id": rid, "object": _chunk_object(kind), "created": created, "model": self.model_name,
                "choices": [choice]}

    def _full_body(self, out, kind: str, rid: str, echo: str) -> dict:
        c = out.outputs[0]
        if kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        else:
            choice = {"index": 0, "text": echo + c.text, "logprobs": None, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
        return {"id": rid, "object": kind, "created": now(), "model": self.model_name, "choices": [choice],
                "usage": _usage(out)}

    def _observe(self, out, arrival: float, ttft: float) -> None:
        c = out.outputs[0]
        n = len(c.token_ids)
        elapsed = time.monotonic() - arrival
        self.metrics.requests.labels(c.finish_reason or "unknown").inc()
        self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        self.metrics.generation_tokens.inc(n)
        self.metrics.ttft.observe(ttft)
        self.metrics.e2e.observe(elapsed)
        if n > 1:
            self.metrics.tpot.observe((elapsed - ttft) / (n - 1))


async def _until_done(gen: AsyncIterator, first, raw: Request):
    """Drain ``gen`` to its final output, cancelling it when the client disconnects (returns None then)."""
    async def drain():
        out = first
        while not out.finished:
            out = await gen.__anext__()
        return out

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, StopAsyncIteration):
                    pass
                return None
        return task.result()
    finally:
        await gen.aclose()


def _token_text(tokenizer, token_id: int | None) -> str:
    return (tokenizer.id_to_token(token_id) or "") if token_id is not None else ""


def _usage(out) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chunk_object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat.completion" else "text_completion"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
