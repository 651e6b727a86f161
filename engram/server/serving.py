"""OpenAI completions and chat completions on the engine client (engine_client.py): request -> checks -> token ids ->
SamplingParams -> engine -> JSON body or an SSE stream ending ``data: [DONE]``.

Each choice (prompt ``p``, sequence ``j``) is engine request ``{id}-{p * n + j}``, seeded ``seed + j``; a
response's choices run as one group. Every refusal happens here, before the engine sees the request, as an
ApiError that app.py renders; the engine process only receives token ids (templates and tokenization run in
worker threads). A client that disconnects cancels its requests; their tokens so far still count.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from engram.server.engine_client import EngineClient, EngineNotReady, EngineOverloaded, RequestFailed
from engram.server.chat import render_chat
from engram.server.logprobs import LegacyLogprobs, TokenIdStrings, TokenStrings
from engram.server.metrics import ServerMetrics
from engram.server.prompt import chars_per_token_bound, encode, too_long
from engram.server.protocol import (ChatCompletionRequest, CompletionRequest, error_body, new_id, now,
                                    unsupported_field)
from engram.server.response import Choice, PromptSpec, ResponseState, Shape
from engram.engine.sampling_params import SamplingParams

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
    def __init__(self, engine: EngineClient, model_name: str, metrics: ServerMetrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="engram-tokenize")
        self._bound: int | None = None  # chars_per_token_bound of the loaded tokenizer
        self._bound_known = False
        self._strings: TokenStrings | None = None  # token strings of the loaded tokenizer (logprobs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- endpoints
    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self._check_request(req)
        loaded = self._loaded()
        items = req.prompts()
        self._check_choices(len(items), req.n)
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens=0 is only served with echo=true (the prompt and its logprobs, nothing "
                                "generated)", param="max_tokens")
        prompts = []
        for i, p in enumerate(items):
            label = f"prompt[{i}]" if req.is_batch() else "prompt"
            ids = await self._tokenize(loaded, p, label) if isinstance(p, str) else p
            self._check_context(len(ids), req.max_tokens, label)
            prompts.append(PromptSpec(ids, p if isinstance(p, str) else None))
        shape = Shape("text_completion", req.logprobs, req.echo, req.max_tokens != 0)
        return await self._run(req, prompts, shape, raw, new_id("cmpl"))

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self._check_request(req)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, f"top_logprobs={req.top_logprobs} needs logprobs=true", param="top_logprobs")
        loaded = self._loaded()
        self._check_choices(1, req.n)
        messages = [{"role": m.role, "content": m.text(),
                     **{k: getattr(m, k) for k in ("name", "tool_call_id") if getattr(m, k) is not None}}
                    for m in req.messages]
        render = lambda: render_chat(messages, loaded.chat_template, req.add_generation_prompt,  # noqa: E731
                                     _token_text(loaded.tokenizer, loaded.bos_token_id),
                                     _token_text(loaded.tokenizer, loaded.eos_token_id))
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(self._pool, render)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages")
        ids = await self._tokenize(loaded, prompt, "messages")
        self._check_context(len(ids), req.max_tokens, "messages")
        shape = Shape("chat.completion", (req.top_logprobs or 0) if req.logprobs else None)
        return await self._run(req, [PromptSpec(ids, prompt)], shape, raw, new_id("chatcmpl"))

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

    def _check_choices(self, num_prompts: int, n: int) -> None:
        """A response's choices run at once: more than the engine admits could never be served."""
        limit = self.engine.capacity
        if num_prompts * n > limit:
            raise ApiError(400, f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} choices; this server runs at "
                                f"most {limit} sequences at once (max_num_seqs + max_waiting)",
                           param="n" if n > 1 else "prompt")

    def _loaded(self):
        """The loaded model's ModelInfo, or a 503 while it loads."""
        if not self.engine.ready.is_set():
            raise ApiError(503, self.engine.load_error or "the model is still loading", "ServiceUnavailableError",
                           headers={"Retry-After": "5"})
        loaded = self.engine.model_info
        if not self._bound_known:
            self._bound, self._bound_known = chars_per_token_bound(loaded.tokenizer), True
        return loaded

    def _token_strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.engine.model_info.tokenizer)
        return self._strings

    def _check_chars(self, num_chars: int, label: str) -> None:
        why = too_long(num_chars, self._bound, self.engine.max_model_len)
        if why is not None:
            raise _too_long(why, label)

    def _check_context(self, num_tokens: int, max_tokens: int | None, label: str) -> None:
        why = context_error(num_tokens, max_tokens, self.engine.max_model_len)
        if why is not None:
            raise _too_long(why, label)

    async def _tokenize(self, loaded, text: str, label: str) -> list[int]:
        """Token ids of ``text`` from a worker thread, after the length bound; ``label`` names the field in
        errors ("prompt", "prompt[2]", "messages")."""
        self._check_chars(len(text), label)
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode, loaded.tokenizer, text)

    def _params(self, req: CompletionRequest | ChatCompletionRequest, shape: Shape):
        """The SamplingParams every choice starts from (``SamplingParams.for_choice`` gives choice j its seed)."""
        vocab = self.engine.model_info.tokenizer.get_vocab_size()
        for i, t in enumerate(req.stop_token_ids or []):
            if t >= vocab:
                raise ApiError(400, f"stop_token_ids[{i}]={t} is outside the vocabulary [0, {vocab})",
                               param="stop_token_ids")
        k = shape.logprobs
        try:
            return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                  seed=req.seed, max_tokens=req.max_tokens if shape.generate else 1,
                                  stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                                  logprobs=k if k is not None and shape.generate else None,
                                  prompt_logprobs=k if shape.echo else None,
                                  output_kind="delta")  # each Choice accumulates (response.py)
        except ValueError as e:
            raise ApiError(400, str(e))

    # ----------------------------------------------------------------- shared path
    async def _run(self, req, prompts: list[PromptSpec], shape: Shape, raw: Request, rid: str) -> Any:
        base = self._params(req, shape)
        strings = self._token_strings() if shape.logprobs is not None else None
        if strings is not None and req.return_tokens_as_token_ids:
            strings = TokenIdStrings(strings)
        legacy = shape.kind == "text_completion" and shape.logprobs is not None
        choices = [Choice(p * req.n + j, f"{rid}-{p * req.n + j}", prompt, base.for_choice(j),
                           LegacyLogprobs(strings, shape.logprobs) if legacy else None)
                   for p, prompt in enumerate(prompts) for j in range(req.n)]
        resp = ResponseState(rid, shape, self.model_name, prompts, choices, strings)
        gen = self.engine.generate([(c.request_id, c.prompt.ids, c.params) for c in choices])
        try:
            first = await gen.__anext__()  # the engine accepted every choice and produced a first token
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
        if shape.echo:
            try:
                await self._echo_texts(prompts)  # token ids are valid once the engine took them
            except BaseException:
                await gen.aclose()
                raise
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(resp, gen, first, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            done = await _until_done(gen, first, raw, lambda out: self._record(resp, out))
        except RequestFailed as e:
            self._count_unfinished(resp, failed=True)
            raise ApiError(500, str(e), "InternalServerError", reason=None)
        if not done:  # client went away; nobody reads this
            self._count_unfinished(resp)
            return None
        return resp.body()

    async def _echo_texts(self, prompts: list[PromptSpec]) -> None:
        """Set each prompt's echo: its text, or its token ids decoded (special tokens kept) in a worker thread."""
        tokenizer = self.engine.model_info.tokenizer
        for p in prompts:
            p.echo = p.text if p.text is not None else await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda ids=p.ids: tokenizer.decode(ids, skip_special_tokens=False))

    async def _stream(self, resp: ResponseState, gen: AsyncIterator, first, include_usage: bool) -> AsyncIterator[str]:
        failed = False
        try:
            out = first
            while True:
                for chunk in resp.chunks(*self._record(resp, out)):
                    yield _sse(chunk)
                if resp.finished:
                    break
                out = await gen.__anext__()
            if include_usage:
                yield _sse(resp.chunk(None, usage=True))
            yield "data: [DONE]\n\n"
        except RequestFailed as e:
            failed = True
            yield _sse(error_body(str(e), "InternalServerError", 500))
            yield "data: [DONE]\n\n"
        finally:
            self._count_unfinished(resp, failed)  # a disconnect lands here: the requests are aborted
            await gen.aclose()

    # ----------------------------------------------------------------- metrics
    def _record(self, resp: ResponseState, out) -> tuple[Choice, bool]:
        """``resp.record(out)``, observing the choice's request when it finishes."""
        c, first = resp.record(out)
        if out.finished:
            self._observe(resp, c)
        return c, first

    def _count_unfinished(self, resp: ResponseState, failed: bool = False) -> None:
        """Requests of a response left unfinished: aborted ones, and one error when the engine failed one. Their
        tokens count too: the generated ones delivered, and the prompt of each that produced a token (its
        prompt was processed)."""
        left = [c for c in resp.choices if not c.finished]
        self.metrics.prompt_tokens.inc(sum(len(c.prompt.ids) for c in left if c.last is not None))
        self.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in left))
        unfinished = len(left)
        if failed:
            self.metrics.requests.labels("error").inc()
            unfinished -= 1
        if unfinished > 0:
            self.metrics.requests.labels("abort").inc(unfinished)

    def _observe(self, resp: ResponseState, c: Choice) -> None:
        out = c.last
        n = len(c.token_ids)
        elapsed = time.monotonic() - resp.arrival
        ttft = c.first_time - resp.arrival
        self.metrics.requests.labels(out.outputs[0].finish_reason or "unknown").inc()
        self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        self.metrics.generation_tokens.inc(n)
        self.metrics.ttft.observe(ttft)
        self.metrics.e2e.observe(elapsed)
        if n > 1:
            self.metrics.tpot.observe((elapsed - ttft) / (n - 1))


def context_error(num_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
    """vLLM's refusal (its rule and its words, "messages" for completions too) of a prompt of ``num_tokens``
    with ``max_tokens`` to generate (None: up to the context) under ``max_model_len``, or None when it fits.
    ``max_tokens=0`` (echo) still needs the one position the engine generates into."""
    if max_tokens is None or max_tokens == 0:
        if num_tokens >= max_model_len:
            return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                    f"{num_tokens} tokens in the messages, Please reduce the length of the messages.")
        return None
    if num_tokens + max_tokens > max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_tokens + max_tokens} tokens ({num_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.")
    return None


def _too_long(why: str, label: str) -> ApiError:
    """The 400 for a prompt that cannot fit: ``label`` is the field ("prompt", "messages"), or "prompt[i]" for
    one prompt of a list (named in the message; the param is still "prompt")."""
    param = label.split("[")[0]
    return ApiError(400, why if label == param else f"{label}: {why}", param=param)


async def _until_done(gen: AsyncIterator, first, raw: Request, record: Callable[[Any], Any]) -> bool:
    """Give ``first`` and every later output of ``gen`` to ``record`` until the group finishes (True), or
    cancel it when the client disconnects (False). Raises what ``gen`` raises (RequestFailed)."""
    async def drain():
        record(first)
        async for out in gen:
            record(out)

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return False
        task.result()
        return True
    finally:
        await gen.aclose()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _token_text(tokenizer, token_id: int | None) -> str:
    return (tokenizer.id_to_token(token_id) or "") if token_id is not None else ""
