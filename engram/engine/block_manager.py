"""Paged KV blocks with automatic prefix caching: ``num_blocks`` blocks of ``block_size`` tokens, one block table per
sequence; position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

Blocks are reference-counted. A full block whose tokens a *collected* step computed is registered under its prefix key
(engine/prefix_cache.py) by ``commit``; when its last user frees it, it stays in the free list with its key, so a later
sequence whose tokens start the same way takes it back (``lookup`` / ``admit``) instead of computing it. Allocation
takes the free block freed longest ago and forgets its key (LRU eviction); a sequence frees its blocks last-first, so
the tail of a prefix is evicted before its head. With ``root=None`` (prefix caching off) no block is ever registered
and this is a plain free list."""
from __future__ import annotations

from collections import OrderedDict

from engram.engine.prefix_cache import PrefixCacheStats, extend_keys
from engram.engine.sequence import Sequence


class BlockManager:
    """``root``: the content key chains start from (``prefix_cache.content_key``); None turns prefix caching off."""

    def __init__(self, num_blocks: int, block_size: int, root: bytes | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root = root
        # Invariant: a block is in ``_free`` iff its reference count is 0; front = freed longest ago (evicted first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # registered block -> its prefix key
        self._block_of: dict[bytes, int] = {}  # prefix key -> the one block registered under it
        self.stats = PrefixCacheStats(enabled=root is not None)

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are reused or evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to compute ``num_new_tokens`` more tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise RuntimeError(f"sequence {seq.request_id!r} needs {need} KV blocks, {len(self._free)} are free")
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        seq.block_table = []

    def group_tables(self, seqs: list[Sequence]) -> dict:
        """The step's cache-group tables (engine/cache_groups.py): none, a paged KV's table is ``block_tables``."""
        return {}

    def group_stats(self) -> dict:
        """Pages per cache group (engine/cache_groups.py): none here."""
        return {}

    # ----------------------------------------------------------------- prefix caching
    def lookup(self, seq: Sequence) -> list[int]:
        """The registered blocks of ``seq``'s longest cached block prefix (no side effects). At least the last token
        is left to compute (its logits are needed), and only tokens the engine has read are keyed. A request asking for
        prompt logprobs computes its whole prompt (cached rows would never be scored), as in vLLM."""
        if not self.enabled or seq.params.prompt_logprobs is not None:
            return []
        keys = extend_keys(seq.block_keys, seq.token_ids, self.block_size, self.root)
        limit = min(len(keys), (seq.num_scheduled_tokens - 1) // self.block_size)
        hits = []
        for key in keys[:limit]:
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether a fresh ``seq`` can take ``hits`` and blocks for ``num_new_tokens`` tokens after them."""
        new = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        idle_hits = sum(1 for b in hits if self._refs[b] == 0)  # they leave the free list when taken
        return new + idle_hits <= len(self._free)

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Give a fresh ``seq`` its cached prefix (``hits``, from ``lookup``) and blocks for the next tokens; it starts
        computing at the first uncached token. Records the query."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"sequence {seq.request_id!r} is not fresh: it holds {len(seq.block_table)} blocks")
        if self.enabled:
            full = min(len(seq.token_ids) // self.block_size, (seq.num_scheduled_tokens - 1) // self.block_size)
            self.stats.record(seq.num_scheduled_tokens, full, len(hits), self.block_size)
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        self.allocate(seq, num_new_tokens)

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Register ``seq``'s full blocks among its first ``num_tokens`` tokens, which a collected step computed and
        the engine has read. A key already registered keeps its first block (this one stays private)."""
        if not self.enabled:
            return
        upto = min(num_tokens, len(seq.token_ids)) // self.block_size
        if upto <= seq.num_committed_blocks:
            return
        keys = extend_keys(seq.block_keys, seq.token_ids[:upto * self.block_size], self.block_size, self.root)
        for k in range(seq.num_committed_blocks, upto):
            block, key = seq.block_table[k], keys[k]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
        seq.num_committed_blocks = upto

    def reset(self) -> int:
        """Forget every registered block (vLLM's reset_prefix_cache); blocks in use stay with their sequences, which
        register no block computed before the reset again. -> how many keys were dropped."""
        dropped = len(self._block_of)
        self._block_of.clear()
        self._key_of.clear()
        self.stats.resets += 1
        return dropped

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
