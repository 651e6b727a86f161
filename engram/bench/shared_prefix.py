"""The shared-prefix workload of ``engram bench serve`` and the prefix cache's counters over its window. With
``--shared-prefix-len N`` every request's prompt is one system prompt of N tokens (cut from the same natural-prose stream
as the user turns, from its end, so it never repeats a user turn) followed by its own drawn ``--input-len`` user turn:
chat traffic whose prefix a prefix cache (vLLM's automatic prefix caching, ours: docs/engine.md) reuses.
``prefix_cache_window`` turns the engine's ``prefix_cache`` stats before and after the window into the window's hits."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from engram.bench.serve_workload import ServeRequest, TokenStream

WINDOW_COUNTERS = ("queries", "queried_blocks", "hit_blocks", "queried_tokens", "hit_tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="a system prompt of N tokens every request's prompt starts with, before its --input-len "
                        "user turn (0: none); compare runs with --serve-args=--no-enable-prefix-caching")


def system_prompt(stream: TokenStream, length: int) -> list[int]:
    """The last ``length`` tokens of the stream (wrapping round when it is shorter)."""
    if length < 0:
        raise ValueError(f"--shared-prefix-len={length}: must be >= 0")
    n = stream.ids.size
    return stream.ids[(n - length + np.arange(length)) % n].tolist()


def with_shared_prefix(stream: TokenStream, requests: list[ServeRequest], length: int) -> list[ServeRequest]:
    """``requests`` with the stream's ``system_prompt(length)`` before each prompt (unchanged for length 0)."""
    prefix = system_prompt(stream, length)
    if not prefix:
        return requests
    return [dataclasses.replace(r, prompt_ids=prefix + r.prompt_ids) for r in requests]


def prefix_cache_window(before: dict, after: dict) -> dict:
    """The growth of the ``prefix_cache`` counters between two ``engine.stats()`` snapshots, and the window's block
    and token hit rates; {"skipped": why} when the server reports no prefix cache."""
    a, b = after.get("prefix_cache"), before.get("prefix_cache")
    if a is None or b is None:
        return {"skipped": "the server's stats have no prefix_cache entry"}
    out = {"enabled": a["enabled"], **{key: a[key] - b[key] for key in WINDOW_COUNTERS}}
    out["block_hit_rate"] = out["hit_blocks"] / out["queried_blocks"] if out["queried_blocks"] else 0.0
    out["token_hit_rate"] = out["hit_tokens"] / out["queried_tokens"] if out["queried_tokens"] else 0.0
    out["cached_blocks"] = a["cached_blocks"]
    return out
