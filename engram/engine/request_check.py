"""``check_request``: what makes a request unservable, found before any engine takes it (ValueError naming the request
and the value): one sequence per request, a non-empty prompt, ids inside the vocabulary, room under max_model_len.
LLMEngine.add_request and the data-parallel router (engine/data_parallel.py) both check with it, so a replica never
receives a request it would refuse."""
from __future__ import annotations

from engram.engine.sampling_params import SamplingParams


def check_request(request_id: str, prompt: str | list[int], params: SamplingParams | None, tokenizer,
                  max_model_len: int) -> tuple[str | None, list[int], SamplingParams]:
    """-> (the prompt's text or None, its token ids, the params or the defaults)."""
    params = params or SamplingParams()
    if params.n != 1:
        raise ValueError(f"request {request_id!r}: SamplingParams.n={params.n}: the engine runs one sequence per "
                         f"request; LLM.generate and the server fan n > 1 out into n requests")
    text, ids = (prompt, tokenizer.encode(prompt).ids) if isinstance(prompt, str) else (None, list(prompt))
    if not ids:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    vocab = tokenizer.get_vocab_size()
    for name, toks in (("token id", ids), ("forced_token_ids", params.forced_token_ids or [])):
        bad = [t for t in toks if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: {name} {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_model_len:
        raise ValueError(f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room to generate "
                         f"under max_model_len={max_model_len}")
    return text, ids, params
