"""Prefix-cache keys and counters (engine side, CPU). A full KV block is named by a hash chain: block k's key is
``blake2b(key of block k-1 | its block_size raw token ids)``, block 0's parent being the engine's *content key* — a digest
of everything besides the tokens that decides what a block holds (the model, its dtype, the Engram config and tables).
Equal keys therefore mean equal token prefixes over the same weights and tables, so a block's K/V, its tokens' Engram
lookback (a function of the tokens) and the paper variant's conv inputs stored with it can be reused as they are.
``PrefixCacheStats`` counts what admissions asked for and found (``engine.stats()["prefix_cache"]``)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KEY_BYTES = 16  # blake2b digest size: a 128-bit chain, collisions out of reach of any cache size


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block holding ``token_ids`` after the block keyed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def extend_keys(keys: list[bytes], token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """Append to ``keys`` (a sequence's chain so far) the keys of every further block that ``token_ids`` fills."""
    for k in range(len(keys), len(token_ids) // block_size):
        keys.append(block_key(keys[-1] if keys else root, token_ids[k * block_size:(k + 1) * block_size]))
    return keys


def content_key(loaded: Any) -> bytes:
    """The root of every chain: a digest of the model's name, dtype and config, the Engram config, and each table's
    identity (its directory and the bytes of its meta file, or the seed tables built in memory came from)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (loaded.name, loaded.dtype, loaded.model_config, loaded.engram_config,
                 getattr(loaded, "memory_table_seed", None)):
        h.update(repr(part).encode())
    for layer, path in sorted(getattr(loaded, "table_dirs", {}).items()):
        h.update(f"{layer}:{path}".encode())
        meta = Path(path) / "meta.json"
        if meta.is_file():
            h.update(meta.read_bytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counters since start (or the last reset of the counters with the cache): one query per admission."""

    enabled: bool
    queries: int = 0  # admissions that looked for a cached prefix
    queried_blocks: int = 0  # full blocks of known tokens those admissions could have reused
    hit_blocks: int = 0  # blocks found and reused
    queried_tokens: int = 0  # tokens those admissions had to compute without the cache
    hit_tokens: int = 0  # tokens reused instead of computed (hit_blocks * block_size)
    resets: int = 0  # reset_prefix_cache calls that dropped the cache

    def record(self, num_tokens: int, num_full_blocks: int, num_hit_blocks: int, block_size: int) -> None:
        self.queries += 1
        self.queried_blocks += num_full_blocks
        self.hit_blocks += num_hit_blocks
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_blocks * block_size

    def snapshot(self, cached_blocks: int) -> dict[str, Any]:
        """The ``prefix_cache`` entry of ``engine.stats()``; hit rates are 0.0 before the first query."""
        return {"enabled": self.enabled, "queries": self.queries, "queried_blocks": self.queried_blocks,
                "hit_blocks": self.hit_blocks, "queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens,
                "block_hit_rate": self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0,
                "token_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
                "cached_blocks": cached_blocks, "resets": self.resets}
