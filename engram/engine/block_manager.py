"""Paged KV blocks: a free list of ``num_blocks`` blocks of ``block_size`` tokens, one block table per sequence.
Position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``; no prefix sharing."""
from __future__ import annotations

from collections import deque

from engram.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
