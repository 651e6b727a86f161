"""Forced natural decoding for ``engram bench placement``: windows cut from a request corpus, and the check that every
arm emitted them. The corpus becomes one token stream; at batch B sequence i takes the window at offset i * len // B
(wrapping): ``context_len`` prompt ids, then the ids it must emit (``forced_token_ids``). ``check_forced`` raises
``OutputMismatch`` naming arm, sequence and position otherwise."""
from __future__ import annotations

from dataclasses import dataclass


class OutputMismatch(AssertionError):
    """A sequence's generated ids differ from its forced ids: the arms did not emit the same tokens."""


def corpus_stream(encoded, vocab_size: int):
    """Every request's prompt and continuation ids as one int64 stream; ValueError for an id outside the vocabulary."""
    import numpy as np

    stream = np.concatenate([x for pair in encoded for x in pair]).astype(np.int64)  # [tokens]
    if stream.size == 0:
        raise ValueError("the corpus encodes to no tokens")
    bad = stream[(stream < 0) | (stream >= vocab_size)]
    if bad.size:
        raise ValueError(f"the corpus encodes to token id {int(bad[0])} (and {bad.size - 1} more) outside the "
                         f"model's vocabulary [0, {vocab_size}): its tokenizer is not the model's")
    return stream


@dataclass
class Windows:
    """The batch's sequences: prompt ids and the ids each must emit, cut from the corpus stream."""

    offsets: list[int]
    prompts: list[list[int]]
    forced: list[list[int]]


def cut_windows(stream, batch: int, context_len: int, max_tokens: int) -> Windows:
    """Sequence i: ``context_len`` prompt ids, then ``max_tokens`` forced ids, from offset i * n // batch (wrapping)."""
    import numpy as np

    n = stream.size
    offsets = [i * n // batch for i in range(batch)]
    prompts, forced = [], []
    for o in offsets:
        w = stream[(o + np.arange(context_len + max_tokens)) % n]  # [context_len + max_tokens]
        prompts.append(w[:context_len].tolist())
        forced.append(w[context_len:].tolist())
    return Windows(offsets, prompts, forced)


def check_forced(times, windows: Windows, min_tokens: int, arm: str) -> int:
    """Every sequence emitted at least ``min_tokens`` ids, all forced (else OutputMismatch) -> the ids checked."""
    if len(times.token_ids) != len(windows.forced):
        raise OutputMismatch(f"arm {arm}: {len(times.token_ids)} sequences reported, {len(windows.forced)} ran")
    checked = 0
    for i, (got, want) in enumerate(zip(times.token_ids, windows.forced)):
        if len(got) < min_tokens:
            raise OutputMismatch(f"arm {arm}: sequence {i} generated {len(got)} ids, fewer than {min_tokens}")
        if got != want[:len(got)]:
            j = next(k for k, (g, w) in enumerate(zip(got, want)) if g != w)
            raise OutputMismatch(f"arm {arm}: sequence {i} emitted id {got[j]} at position {j}, forced was {want[j]}: "
                                 f"the arms did not decode the same tokens")
        checked += len(got)
    return checked
