"""SamplingParams: how one request picks its tokens and when it stops, with vLLM's field names. Validated in
``__post_init__``. ``temperature == 0`` is greedy; ``seed`` gives the request its own random stream. ``n > 1`` is fanned
out by ``LLM.generate`` and the server into n requests (``for_choice``). ``logprobs``/``prompt_logprobs=k``: each
token's logprob and the step's top-k. ``forced_token_ids``: decode samples as usual, then emits that continuation's next
token (free past its end). ``stop`` strings are cut from the text. ``detokenize=False`` (vLLM's field): the engine
leaves the text to its caller (outputs carry token ids, text ""), which then matches stop strings itself (the
server's API process does: server/output_processor.py), so ``stop`` must be empty."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-k logprobs per token, at most (OpenAI's limit)
# "cumulative": every step's output holds the text, token ids and logprobs so far (a copy per step: O(n) a
# step for an n-token output); "delta": only what the step added (concatenate them for the whole);
# "final_only": no output until the request finishes, then the cumulative one (what LLM.generate uses).
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt (LLM.generate and the server fan n > 1 out; the engine takes 1)
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    seed: int | None = None  # per-request random stream (reproducible in any batch)
    max_tokens: int | None = 16  # generated tokens at most; None = up to max_model_len
    stop: str | list[str] | None = None  # strings that end the completion (excluded from the text)
    stop_token_ids: list[int] | None = None  # token ids that end the completion (besides EOS)
    ignore_eos: bool = False  # keep generating past the EOS token
    min_tokens: int = 0  # EOS / stop_token_ids are ignored before this many tokens
    skip_special_tokens: bool = True  # drop special tokens from the text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    logprobs: int | None = None  # per generated token: its logprob and the top-k (k = this, >= 0)
    prompt_logprobs: int | None = None  # per prompt token (from the second): its logprob and the top-k
    forced_token_ids: list[int] | None = None  # emitted instead of the sampled tokens, one per step
    output_kind: str = "cumulative"  # what each step's RequestOutput holds: OUTPUT_KINDS (vLLM's RequestOutputKind)
    detokenize: bool = True  # False: no text in the outputs (the caller detokenizes); needs no stop strings
    stop_list: list[str] = field(init=False, repr=False)  # ``stop`` normalised to a list

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise bad("top_k", "must be >= 1, or 0 / -1 for all tokens")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1 (or None for up to max_model_len)")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            raise bad("seed", "must be a signed 64-bit int or None")
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        else:
            stops = list(self.stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "stop strings must be non-empty str")
        self.stop_list = stops
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "must be true or false")
        if stops and not self.detokenize:
            raise bad("stop", "stop strings are matched on the text: they need detokenize=True (a caller that "
                              "detokenizes itself matches them itself)")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an int in [0, {MAX_LOGPROBS}] (or None)")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an int in [0, {MAX_LOGPROBS}] (or None)")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"must be one of {OUTPUT_KINDS}")
        if self.forced_token_ids is not None:
            self.forced_token_ids = [int(t) for t in self.forced_token_ids]
            if any(t < 0 for t in self.forced_token_ids):
                raise bad("forced_token_ids", "token ids must be >= 0")

    def for_choice(self, j: int) -> "SamplingParams":
        """Choice j's engine request: n = 1 and, when seeded, seed + j."""
        if self.n == 1 and (self.seed is None or j == 0):
            return self
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
