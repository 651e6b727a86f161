"""Lookup planning (engine side, CPU): which Engram rows a step needs, known before the first layer runs.
``LookupPlanner.plan`` hashes the step's compressed ids, with each sequence's lookback, into a ``LookupPlan``: per
Engram layer the row ids [T, n_cols] int64 CPU, and the host half of pending tokens' ids (``pending_partials``). Not
deduplicated: the tiers that gain from it deduplicate inside the store."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engram.hashing import NgramHasher


@dataclass(frozen=True)
class LookupPlan:
    row_ids: dict[int, torch.Tensor]  # Engram layer id -> [T, n_cols] int64 global row ids of its table
    pending_partials: torch.Tensor | None = None  # [L, P, n_cols] int64 (hashing.pending_partials); None: P = 0

    def num_rows(self) -> int:
        return sum(int(r.numel()) for r in self.row_ids.values())


class LookupPlanner:
    """Hashes a packed step into a LookupPlan; a model without Engram layers gets empty plans."""

    def __init__(self, hasher: NgramHasher | None):
        self.hasher = hasher

    def plan(self, compressed_ids: torch.Tensor, cu_seqlens: torch.Tensor, lookback: torch.Tensor,
             pending_before: list[list[int]] = ()) -> LookupPlan:
        """compressed_ids [T] (DEAD = -1), cu_seqlens [S+1], lookback [S, max_ngram-1] and each pending token's
        max_ngram-1 ids before it -> LookupPlan (pending rows' ids are placeholders)."""
        if self.hasher is None:
            return LookupPlan({})
        rows, _ = self.hasher.hash_step(compressed_ids, cu_seqlens, lookback)  # {layer: [T, n_cols]}
        partials = None
        if pending_before:
            partials = torch.from_numpy(self.hasher.pending_partials(np.asarray(pending_before, dtype=np.int64)))
        return LookupPlan(rows, partials)
