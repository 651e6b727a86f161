"""OpenAI-compatible request bodies (pydantic, the HTTP boundary only) and the error body.

Fields, defaults and bounds follow the OpenAI API as vLLM serves it, typed strictly (no coercion). Nothing a
client sends is silently ignored: an unknown field is a 400, and an unimplemented OpenAI field is refused
unless it holds its no-op value (``unsupported_field``).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from engram.engine.sampling_params import MAX_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string (each is searched in every step's new text)
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_N = 128  # choices per prompt (OpenAI's limit)


def _valid_unicode(s: str) -> str:
    """A str that can be encoded as UTF-8 (JSON allows lone surrogates such as "\\ud800"; text does not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate (U+{ord(s[e.start]):04X}) at character {e.start}: "
                         "not valid Unicode text") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every str field of a request


class _Strict(BaseModel):
    # an unknown field is a 400 naming it, never ignored; a value of the wrong JSON type is a 400, never coerced
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # send a last chunk with token counts


class _SamplingFields(_Strict):
    model: Text | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=MAX_N)  # independent choices per prompt
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's field: logprobs name each token "token_id:N" instead of its text (tokens whose text is ambiguous or
    # not UTF-8 stay distinguishable; `engram check --served` reads token ids back this way)
    return_tokens_as_token_ids: bool | None = None
    # OpenAI fields that do not change the output: accepted and not used.
    user: Text | None = None
    # OpenAI fields this server does not implement: any value but the no-op one is refused (unsupported_field).
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, v: Any, info: ValidationInfo) -> Any:
        if v and not info.data.get("stream"):  # vLLM's rule and words: a non-empty object needs stream: true
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOP} are allowed")
        for i, s in enumerate(stops):
            if not s:
                raise ValueError(f"stop string {i} is empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop string {i} has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        for i, t in enumerate(v or []):
            if not 0 <= t <= INT64_MAX:
                raise ValueError(f"stop_token_ids[{i}]={t} is not a token id (must be >= 0)")
        return v


class CompletionRequest(_SamplingFields):
    """``prompt``: one text or token-id list, or a list of them (one choice per prompt and ``n``).
    ``max_tokens=0`` is accepted here and served only with ``echo`` (serving.py); ``null`` is the default 16,
    as if it were left out (OpenAI's documented default)."""
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    max_tokens: int = Field(default=16, ge=0, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    best_of: Any = None  # unsupported unless equal to n
    suffix: Any = None  # unsupported unless empty

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        return 16 if v is None else v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        items = v if _is_batch(v) else [v]
        for i, p in enumerate(items):
            if len(p) == 0:
                raise ValueError("prompt must not be empty" if len(items) == 1 else f"prompt[{i}] is empty")
        return v

    def is_batch(self) -> bool:
        """The prompt was sent as a list of prompts (errors then name ``prompt[i]``)."""
        return _is_batch(self.prompt)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or many, as a list."""
        return list(self.prompt) if self.is_batch() else [self.prompt]


def _is_batch(prompt: Any) -> bool:
    """A non-empty list of prompts (texts or token-id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """One message; ``name`` (a participant's name) and ``tool_call_id`` (the call a ``tool`` message answers)
    are accepted as vLLM accepts them and handed to the chat template with the role and content."""
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Text | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    add_generation_prompt: bool = True
    # OpenAI fields that do not change the output: accepted and not used.
    metadata: dict[Text, Text] | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools, which are refused
    logprobs: bool | None = None  # return each generated token's logprob
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    # OpenAI fields this server does not implement (unsupported_field).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None

    @model_validator(mode="after")
    def _limit(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# Each unimplemented OpenAI field -> (its no-op values, what it would ask for). A field absent from the body,
# null, or equal to a no-op value is fine; anything else is a 400 naming the field.
_NOOP: dict[str, tuple[tuple[Any, ...], str]] = {
    "logit_bias": ((None, {}), "logit bias is not implemented"),
    "presence_penalty": ((None, 0), "penalties are not implemented (only 0 is accepted)"),
    "frequency_penalty": ((None, 0), "penalties are not implemented (only 0 is accepted)"),
    "suffix": ((None, ""), "suffixes (insertion) are not implemented"),
    "tools": ((None, []), "tool calling is not implemented"),
    "tool_choice": ((None, "none"), "tool calling is not implemented"),
    "functions": ((None, []), "function calling is not implemented"),
    "function_call": ((None, "none"), "function calling is not implemented"),
    "response_format": ((None, {"type": "text"}), "structured output is not implemented (only type 'text')"),
    "audio": ((None,), "audio output is not implemented"),
    "modalities": ((None, ["text"]), "only the text modality is served"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "reasoning_effort": ((None,), "reasoning effort is not implemented"),
    "verbosity": ((None,), "verbosity is not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "service_tier": ((None, "auto", "default"), "service tiers are not implemented"),
    "store": ((None, False), "stored completions are not implemented"),
}


def _same(value: Any, ok: Any) -> bool:
    """``value`` is the no-op value ``ok``: None and bools by identity (bool is an int in Python, so
    ``logprobs=0`` is not ``false``), numbers by value (0 == 0.0), anything else by type and value."""
    if ok is None or isinstance(ok, bool) or isinstance(value, bool):
        return value is ok
    if isinstance(ok, (int, float)):
        return isinstance(value, (int, float)) and value == ok
    return type(value) is type(ok) and value == ok


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unsupported_field(req: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first unimplemented OpenAI field that ``req`` asks for, else None.
    ``best_of`` is accepted only when equal to ``n``."""
    for name, (noops, why) in _NOOP.items():
        if name in type(req).model_fields:
            value = getattr(req, name)
            if not any(_same(value, ok) for ok in noops):
                return name, f"{name}={_short(value)} is not supported: {why}"
    best_of = getattr(req, "best_of", None)
    if best_of is not None and not (isinstance(best_of, int) and not isinstance(best_of, bool) and best_of == req.n):
        return "best_of", f"best_of={_short(best_of)} is not supported: only best_of == n ({req.n}) is served"
    return None


def error_body(message: str, type_: str = "invalid_request_error", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
