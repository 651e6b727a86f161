"""Work in progress (issue 46 item 1, not yet wired into ``engram bench``): the workload of ``engram bench paper``.
Requests as ``serve_workload.make_requests`` draws them (input and output lengths each Uniform(lo, hi), seeded), each
with its forced natural continuation: the ``output_len`` stream tokens that follow its prompt, so every arm does the
same work and emits the same ids (checked with ``forced_windows.check_forced``-style comparison)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engram.bench.corpus import LengthRange
from engram.bench.serve_workload import TokenStream, make_requests


@dataclass(frozen=True)
class ForcedRequest:
    """One sequence: its prompt ids and the ids it must emit (len == its drawn output length)."""

    prompt_ids: list[int]
    forced_ids: list[int]


def forced_requests(stream: TokenStream, num: int, input_len: LengthRange, output_len: LengthRange,
                    seed: int = 0) -> list[ForcedRequest]:
    """``make_requests``'s prompts, each followed in the stream (wrapping) by its forced continuation."""
    reqs = make_requests(stream, num, input_len, output_len, seed)
    ids, n = stream.ids, stream.ids.size
    out, cursor = [], 0
    for r in reqs:  # make_requests lays prompts one after another from offset 0: the continuation follows each
        p = len(r.prompt_ids)
        idx = (cursor + p + np.arange(r.output_len)) % n
        out.append(ForcedRequest(prompt_ids=r.prompt_ids, forced_ids=ids[idx].tolist()))
        cursor = (cursor + p) % n
    return out
