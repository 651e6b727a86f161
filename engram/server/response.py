"""One OpenAI response while it runs: its prompts, its choices, and their rendering as a JSON body or SSE
chunks. serving.py drives it; nothing here talks to the engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engram.server.logprobs import (LegacyLogprobs, Scored, TokenStrings, chat_logprobs, generated_scored,
                                    prompt_scored)
from engram.server.protocol import now


@dataclass
class PromptSpec:
    ids: list[int]
    text: str | None  # the prompt as sent, None for token ids (decoded for echo once the engine accepts them)
    echo: str = ""  # what the choice's text starts with: the prompt under ``echo``, else ""


@dataclass(frozen=True)
class Shape:
    """What the request asks of every choice."""

    kind: str  # "text_completion" or "chat.completion"
    logprobs: int | None  # alternatives per token when logprobs are returned, else None
    echo: bool = False  # completions: the prompt (with its logprobs) before the completion
    generate: bool = True  # False for max_tokens=0: the engine's one token is dropped


@dataclass
class Choice:
    """One engine request of a response; it accumulates the request's deltas (``output_kind="delta"``)."""

    index: int  # OpenAI's choice index (prompt-major)
    request_id: str  # its engine request
    prompt: PromptSpec
    params: Any  # its SamplingParams
    legacy: LegacyLogprobs | None  # completions with logprobs: the choice's logprobs builder
    last: Any = None  # its latest RequestOutput (finish reason, prompt logprobs)
    first_time: float | None = None  # time.monotonic() of its first output
    sent: int = 0  # generated tokens already reported in a stream chunk
    token_ids: list[int] = field(default_factory=list)  # generated so far
    logprobs: list = field(default_factory=list)  # TokenLogprobs of those tokens (when asked)
    pieces: list[str] = field(default_factory=list)  # the text, as the deltas came

    def add(self, out) -> None:
        """Take the choice's next (delta) output."""
        o = out.outputs[0]
        self.token_ids.extend(o.delta_token_ids)
        self.logprobs.extend(o.logprobs or ())
        if o.delta_text:
            self.pieces.append(o.delta_text)
        self.last = out

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


@dataclass
class ResponseState:
    """One response being built from its choices' outputs (the same pieces for a body and a stream)."""

    id: str
    shape: Shape
    model: str
    prompts: list[PromptSpec]
    choices: list[Choice]
    strings: TokenStrings | None  # token strings, when logprobs are returned
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=now)

    def __post_init__(self) -> None:
        self._by_id = {c.request_id: c for c in self.choices}

    def record(self, out) -> tuple[Choice, bool]:
        """Take one engine output: (its choice, whether it is the choice's first)."""
        c = self._by_id[out.request_id]
        first = c.last is None
        if first:
            c.first_time = time.monotonic()
        c.add(out)
        return c, first

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    # ------------------------------------------------------------- pieces
    def _finish(self, c: Choice) -> tuple[str | None, int | str | None]:
        o = c.last.outputs[0]
        if not c.last.finished:
            return None, None
        return (o.finish_reason, o.stop_reason) if self.shape.generate else ("length", None)

    def _prompt_scored(self, c: Choice) -> list[Scored]:
        return prompt_scored(c.last.prompt_token_ids, c.last.prompt_logprobs)

    def _generated(self, c: Choice, start: int | None = None) -> tuple[str, list[Scored]]:
        """The choice's whole text and scored tokens (``start`` None), or a stream's: this output's new text and
        the tokens from number ``start`` on (those not reported yet). Nothing for max_tokens=0."""
        if not self.shape.generate:
            return "", []
        text = c.text if start is None else c.last.outputs[0].delta_text
        scored = generated_scored(self.strings, c.logprobs[start or 0:]) if self.shape.logprobs is not None else []
        return text, scored

    def _chat_logprobs(self, scored: list[Scored]) -> dict | None:
        if self.shape.logprobs is None:
            return None
        return {"content": chat_logprobs(self.strings, scored, self.shape.logprobs), "refusal": None}

    def body(self) -> dict:
        """The non-streaming response, every choice finished."""
        choices = []
        for c in self.choices:
            text, scored = self._generated(c)
            finish, stop = self._finish(c)
            if self.shape.kind == "chat.completion":
                choice = {"index": c.index, "message": {"role": "assistant", "content": text},
                          "logprobs": self._chat_logprobs(scored)}
            else:
                lp = None
                if c.legacy is not None:
                    lp = c.legacy.add((self._prompt_scored(c) if self.shape.echo else []) + scored)
                choice = {"index": c.index, "text": c.prompt.echo + text, "logprobs": lp}
            choices.append({**choice, "finish_reason": finish, "stop_reason": stop})
        return {"id": self.id, "object": self.shape.kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def chunks(self, c: Choice, first: bool) -> list[dict]:
        """Stream chunks for choice ``c``'s latest output: on its first, the opening (chat's role; the echoed
        prompt and its logprobs); then its new text with the logprobs of every token not reported yet, or
        nothing while the text is held back (a possible stop string) and the choice runs on."""
        chat = self.shape.kind == "chat.completion"
        pieces = []
        if first and chat:
            pieces.append({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None})
        elif first and self.shape.echo:
            pieces.append({"index": c.index, "text": c.prompt.echo,
                           "logprobs": c.legacy.add(self._prompt_scored(c)) if c.legacy is not None else None,
                           "finish_reason": None})
        text, scored = self._generated(c, c.sent)
        finish, stop = self._finish(c)
        if text or finish:
            c.sent = len(c.token_ids)
            if chat:
                piece = {"index": c.index, "delta": {"content": text} if text else {},
                         "logprobs": self._chat_logprobs(scored)}
            else:
                piece = {"index": c.index, "text": text,
                         "logprobs": c.legacy.add(scored) if c.legacy is not None else None}
            piece["finish_reason"] = finish
            if finish is not None:
                piece["stop_reason"] = stop
            pieces.append(piece)
        return [self.chunk(p) for p in pieces]

    def chunk(self, choice: dict | None, usage: bool = False) -> dict:
        body = {"id": self.id, "object": chunk_object(self.shape.kind), "created": self.created,
                "model": self.model, "choices": [] if choice is None else [choice]}
        if usage:
            body["usage"] = self.usage()
        return body

    def usage(self) -> dict[str, int]:
        """Prompt tokens once per prompt (not per choice); completion tokens of every choice."""
        p = sum(len(x.ids) for x in self.prompts)
        g = sum(len(c.token_ids) for c in self.choices) if self.shape.generate else 0
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def chunk_object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
