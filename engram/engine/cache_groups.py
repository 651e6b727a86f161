"""The block manager of models whose caches are cache groups (DeepSeek-V4, model/deepseek_v4/cache_layout.py): one pool
of ``num_blocks`` equal pages shared by every group, one block table per group per sequence, the scheduler's interface
of ``BlockManager`` (prefix caching off: nothing is ever cached).

When each page is taken and given back, for a sequence computing tokens [c, e) in a step:

* ``sliding``: pages for the positions it keeps after the step, [max(c, e - (window - 1)), e), are taken when it is
  scheduled; a page is given back once a *collected* step left it wholly before the window (``commit``), never at
  scheduling: a step in flight, or a failed step run again, still reads the window it started from.
* ``csa`` / ``hca``: pages for the entries of its first e tokens, taken when scheduled, kept until it ends.
* ``state``: its fixed pages, taken at its first step, kept until it ends.
* ``free`` (finished, aborted, preempted): every page of every group, at once.

The sliding table doubles as ``seq.block_table`` (-1 where no page is held) so the packed slot mapping stays defined."""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from engram.engine.prefix_cache import PrefixCacheStats
from engram.engine.sequence import Sequence
from engram.model.deepseek_v4.cache_layout import SLIDING_GROUP, STATE_GROUP, CacheGroup, CacheLayout

NO_PAGE = -1  # a table entry that holds no page (out of the window, or not reached yet)


class GroupBlockManager:
    """Pages of every cache group of ``layout`` from one pool of ``num_blocks``."""

    enabled = False  # prefix caching: these caches are not token blocks a prefix could share
    root = None

    def __init__(self, num_blocks: int, layout: CacheLayout):
        if num_blocks < 1:
            raise ValueError(f"GroupBlockManager needs num_blocks >= 1, got {num_blocks}")
        self.num_blocks, self.layout = num_blocks, layout
        self.block_size = layout.block_size
        self._free: deque[int] = deque(range(num_blocks))  # front: freed longest ago
        self._tables: dict[int, dict[str, list[int]]] = {}  # seq id -> group name -> page per logical block
        self._used = {g.name: 0 for g in layout.groups}  # pages each group holds over all sequences
        self.stats = PrefixCacheStats(enabled=False)

    # ----------------------------------------------------------------- counts
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _logical(self, group: CacheGroup, start: int, end: int) -> range:
        """Logical blocks of ``group`` a sequence must hold to compute tokens [start, end)."""
        if group.name == SLIDING_GROUP:
            lo = max(start, end - self.layout.kept)
            return range(lo // self.block_size, -(-end // self.block_size)) if lo < end else range(0)
        if group.name == STATE_GROUP:
            return range(group.pages_per_sequence)
        return range(-(-self.layout.rows_for(group, end) // group.rows_per_page))

    def _missing(self, seq: Sequence, num_new_tokens: int) -> list[tuple[str, int]]:
        """(group, logical block) pairs ``seq`` lacks for its next ``num_new_tokens`` tokens."""
        tables = self._tables.get(seq.seq_id, {})
        start = seq.num_computed_tokens
        out = []
        for g in self.layout.groups:
            table = tables.get(g.name, [])
            out += [(g.name, j) for j in self._logical(g, start, start + num_new_tokens)
                    if j >= len(table) or table[j] == NO_PAGE]
        return out

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return len(self._missing(seq, num_new_tokens))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    # ----------------------------------------------------------------- taking and giving back
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self._missing(seq, num_new_tokens)
        if len(missing) > len(self._free):
            raise RuntimeError(f"sequence {seq.request_id!r} needs {len(missing)} cache-group pages, "
                               f"{len(self._free)} are free")
        tables = self._tables.setdefault(seq.seq_id, {g.name: [] for g in self.layout.groups})
        for name, j in missing:
            table = tables[name]
            table.extend([NO_PAGE] * (j + 1 - len(table)))
            table[j] = self._free.popleft()
            self._used[name] += 1
        sliding = tables[SLIDING_GROUP]
        end_block = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        sliding.extend([NO_PAGE] * (end_block - len(sliding)))  # every new token's logical block exists
        seq.block_table = sliding

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """A collected step computed ``seq``'s first ``num_tokens`` tokens: give back the sliding pages wholly before
        the window it keeps now."""
        tables = self._tables.get(seq.seq_id)
        if tables is None:
            return
        sliding = tables[SLIDING_GROUP]
        lo, _ = self.layout.window_range(num_tokens)
        for j in range(min(lo // self.block_size, len(sliding))):
            if sliding[j] != NO_PAGE:
                self._give_back(SLIDING_GROUP, sliding[j])
                sliding[j] = NO_PAGE

    def free(self, seq: Sequence) -> None:
        """Every page of every group ``seq`` holds goes back to the pool (last page first)."""
        tables = self._tables.pop(seq.seq_id, {})
        for name, table in tables.items():
            for page in reversed(table):
                if page != NO_PAGE:
                    self._give_back(name, page)
        seq.block_table = []

    def _give_back(self, group: str, page: int) -> None:
        self._free.append(page)
        self._used[group] -= 1

    # ----------------------------------------------------------------- the scheduler's prefix-cache calls
    def lookup(self, seq: Sequence) -> list[int]:
        return []

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        return self.can_allocate(seq, num_new_tokens)

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        if seq.seq_id in self._tables or seq.num_computed_tokens:
            raise RuntimeError(f"sequence {seq.request_id!r} is not fresh: it holds cache-group pages")
        self.allocate(seq, num_new_tokens)

    def reset(self) -> int:
        self.stats.resets += 1
        return 0

    # ----------------------------------------------------------------- what the step and stats carry
    def group_tables(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """Group name -> [S, width] int64 page of each logical block of each packed sequence (-1: none)."""
        out = {}
        for g in self.layout.groups:
            rows = [self._tables.get(s.seq_id, {}).get(g.name, []) for s in seqs]
            table = np.full((len(rows), max(map(len, rows), default=0)), NO_PAGE, dtype=np.int64)
            for i, row in enumerate(rows):
                table[i, :len(row)] = row
            out[g.name] = torch.from_numpy(table)
        return out

    def group_stats(self) -> dict[str, dict[str, int]]:
        """Per group: pages held and their bytes (the engine's ``stats()['cache_groups']``)."""
        return {name: {"blocks": n, "bytes": n * self.layout.page_bytes} for name, n in self._used.items()}

    def held(self, seq: Sequence) -> dict[str, int]:
        """Pages ``seq`` holds per group."""
        return {name: sum(p != NO_PAGE for p in t) for name, t in self._tables.get(seq.seq_id, {}).items()}
