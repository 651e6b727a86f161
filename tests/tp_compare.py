"""Comparing a tensor-parallel run with TP1 in tests: ``worst_logprob_gap(want, got)`` asserts greedy tokens and
top-k ids equal, request by request, and returns the largest relative difference of their logprobs."""
from __future__ import annotations


def worst_logprob_gap(want, got) -> float:
    worst = 0.0
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
            worst = max([worst] + [abs(a - b) / abs(a) for (_, a), (_, b) in zip(lw.top, lg.top)])
    return worst
