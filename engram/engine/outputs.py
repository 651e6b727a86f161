"""vLLM-style results: RequestOutput holds one CompletionOutput per request. ``text``/``token_ids`` are
cumulative, ``delta_*`` what the step added; text that might become a stop string is held back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # completion index within the request (always 0: n = 1)
    text: str  # detokenized output so far (stop string removed)
    token_ids: list[int]  # generated token ids so far
    cumulative_logprob: float | None = None  # not tracked (None), as vLLM without logprobs
    logprobs: list | None = None  # TokenLogprobs per output token when asked (cumulative; a snapshot per output)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS)
    delta_text: str = ""  # text added by this step
    delta_token_ids: list[int] = field(default_factory=list)  # tokens added by this step

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() at add_request
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None  # first generated token (time to first token = this - arrival)
    finished_time: float | None = None
    num_preemptions: int = 0  # times its KV blocks were taken back (recomputed later)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the prompt text (None when the request came as token ids)
    prompt_token_ids: list[int]  # the request's prompt (one list, shared by all of its outputs)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None  # None for the first prompt token, then TokenLogprobs (if asked)
