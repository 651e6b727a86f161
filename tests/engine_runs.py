"""Running an engine's requests to completion in tests: ``drain(engine)`` steps until nothing is unfinished
and returns each request's (token ids, [(logprob, top-k)] per token)."""
from __future__ import annotations


def drain(engine) -> dict[str, tuple[list[int], list[tuple]]]:
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            out[o.request_id] = (c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs])
    return out
