"""OpenAI completions and chat completions on top of AsyncEngine: request -> checks -> token ids ->
SamplingParams -> engine -> JSON body or an SSE stream that ends with ``data: [DONE]``.

Everything a request can get wrong is refused here, before the engine sees it: an unimplemented OpenAI
field (``protocol.unsupported_field``), a prompt that cannot fit ``max_model_len`` (by its length in
characters, before tokenizing, where the tokenizer allows a bound; then by its token count),
``stop_token_ids`` outside the vocabulary. Chat templates render and prompts tokenize in a worker thread
(tokenization releases the GIL), so the engine thread only ever receives token ids and a long prompt
never stalls the requests already running. Errors are raised as ApiError (status, OpenAI error body and
the ``engram_requests_rejected_total`` reason); app.py turns them into responses. A client that
disconnects, streaming or not, cancels its request (the engine frees the sequence).
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from engram.server.async_engine import AsyncEngine, EngineNotReady, EngineOverloaded, RequestFailed
from engram.server.chat import render_chat
from engram.server.metrics import ServerMetrics
from engram.server.prompt import chars_per_token_bound, encode, too_long
from engram.server.protocol import (ChatCompletionRequest, CompletionRequest, error_body, new_id, now,
                                    unsupported_field)

# The ``engram_requests_rejected_total`` reason of each refused status (ApiError's default).
REJECT_REASONS = {400: "invalid", 404: "not_found", 405: "invalid", 413: "too_large", 422: "invalid",
                  503: "not_ready"}
TOKENIZE_THREADS = 2  # worker threads rendering chat templates and tokenizing prompts


class ApiError(Exception):
    """An HTTP error with OpenAI's body. ``reason`` labels ``engram_requests_rejected_total`` (default from
    the status, see REJECT_REASONS; None: not a rejection, e.g. a 500 the engine raised)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = "default"):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, status, param), headers or {}
        self.reason = REJECT_REASONS.get(status) if reason == "default" else reason


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="engram-tokenize")
        self._bound: int | None = None  # chars_per_token_bound of the loaded tokenizer
        self._bound_known = False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- endpoints
    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self._check_request(req)
        loaded = self._loaded()
        prompt = req.prompt
        if isinstance(prompt, str):
            ids = await self._tokenize(loaded, prompt, "prompt")
        else:
            ids = prompt
            self._check_length(len(ids), "prompt")
        echo = prompt if req.echo and isinstance(prompt, str) else ""
        return await self._run(req, ids, raw, "text_completion", new_id("cmpl"), echo)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self._check_request(req)
        loaded = self._loaded()
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        render = lambda: render_chat(messages, loaded.chat_template, req.add_generation_prompt,  # noqa: E731
                                     _token_text(loaded.tokenizer, loaded.model_config.bos_token_id),
                                     _token_text(loaded.tokenizer, loaded.eos_token_id))
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(self._pool, render)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages")
        ids = await self._tokenize(loaded, prompt, "messages")
        return await self._run(req, ids, raw, "chat.completion", new_id("chatcmpl"), "")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict[str, Any]:
        """GET /v1/models/{model_id}: the served model's card; 404 for any other id."""
        self._check_model(model_id)
        return self.model_card()

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "engram",
                "root": self.model_name}

    # ----------------------------------------------------------------- checks
    def _check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(req.model)
        found = unsupported_field(req)
        if found is not None:
            raise ApiError(400, found[1], param=found[0], reason="unsupported")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           "NotFoundError", "model")

    def _loaded(self):
        """The LoadedModel, or a 503 while it loads."""
        if not self.engine.ready.is_set():
            raise ApiError(503, self.engine.load_error or "the model is still loading", "ServiceUnavailableError",
                           headers={"Retry-After": "5"})
        loaded = self.engine.llm.loaded
        if not self._bound_known:
            self._bound, self._bound_known = chars_per_token_bound(loaded.tokenizer), True
        return loaded

    def _check_chars(self, num_chars: int, param: str) -> None:
        why = too_long(num_chars, self._bound, self.engine.max_model_len)
        if why is not None:
            raise ApiError(400, why, param=param)

    def _check_length(self, num_tokens: int, param: str) -> None:
        limit = self.engine.max_model_len
        if num_tokens >= limit:
            raise ApiError(400, f"the prompt has {num_tokens} tokens, which leaves no room to generate under "
                                f"max_model_len={limit}", param=param)

    async def _tokenize(self, loaded, text: str, param: str) -> list[int]:
        """Token ids of ``text`` from a worker thread, after the length bound and before the token count check."""
        self._check_chars(len(text), param)
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, encode, loaded.tokenizer, text)
        self._check_length(len(ids), param)
        return ids

    def _params(self, req: CompletionRequest | ChatCompletionRequest):
        from engram.engine.sampling_params import SamplingParams

        vocab = self.engine.llm.loaded.tokenizer.get_vocab_size()
        for i, t in enumerate(req.stop_token_ids or []):
            if t >= vocab:
                raise ApiError(400, f"stop_token_ids[{i}]={t} is outside the vocabulary [0, {vocab})",
                               param="stop_token_ids")
        try:
            return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                  seed=req.seed, max_tokens=req.max_tokens, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise ApiError(400, str(e))

    # ----------------------------------------------------------------- shared path
    async def _run(self, req, prompt: list[int], raw: Request, kind: str, rid: str, echo: str) -> Any:
        params = self._params(req)
        arrival = time.monotonic()
        gen = self.engine.generate(rid, prompt, params)
        try:
            first = await gen.__anext__()  # the engine accepted the request and produced a first token
        except StopAsyncIteration:
            raise ApiError(500, "the engine finished the request without output", "InternalServerError",
                           reason=None)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt")
        except EngineOverloaded as e:
            raise ApiError(503, str(e), "ServiceUnavailableError", headers={"Retry-After": str(e.retry_after)},
                           reason="overloaded")
        except EngineNotReady as e:
            raise ApiError(503, str(e), "ServiceUnavailableError", headers={"Retry-After": "5"})
        except RequestFailed as e:
            self.metrics.requests.labels("error").inc()
            raise ApiError(500, str(e), "InternalServerError", reason=None)
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
