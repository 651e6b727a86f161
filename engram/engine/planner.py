"""Lookup planning (engine side, CPU): which Engram rows a step needs, known before the first layer runs.
``LookupPlanner.plan`` hashes the step's compressed ids, with each sequence's lookback, into a ``LookupPlan``: per
Engram layer the row ids [T, n_cols] int64 CPU, the host half of pending tokens' ids (``pending_partials``) and, with
dedup on, the distinct ids and their inverse index (row_dedup.py), so a Worker gathers each distinct row once."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engram.engine.row_dedup import DedupRows, dedupe
from engram.hashing import NgramHasher


@dataclass(frozen=True)
class LookupPlan:
    row_ids: dict[int, torch.Tensor]  # Engram layer id -> [T, n_cols] int64 global row ids of its table
    pending_partials: torch.Tensor | None = None  # [L, P, n_cols] int64 (hashing.pending_partials); None: P = 0
    dedup: dict[int, DedupRows] = field(default_factory=dict)  # layer -> distinct ids + inverse; {} with dedup off

    def num_rows(self) -> int:
        return sum(int(r.numel()) for r in self.row_ids.values())

    def dedup_counts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids, distinct ids) per Engram layer in layer order; with dedup off the distinct count is the ids'."""
        ids = tuple(int(r.numel()) for r in self.row_ids.values())
        return ids, tuple(self.dedup[lid].num_unique if lid in self.dedup else n
                          for lid, n in zip(self.row_ids, ids))


class LookupPlanner:
    """Hashes a packed step into a LookupPlan; a model without Engram layers gets empty plans. ``dedup``: also
    deduplicate each layer's ids (row_dedup.py), here on the host where the step is described."""

    def __init__(self, hasher: NgramHasher | None, dedup: bool = True):
        self.hasher = hasher
        self.dedup = dedup

    def plan(self, compressed_ids: torch.Tensor, cu_seqlens: torch.Tensor, lookback: torch.Tensor,
             pending_before: list[list[int]] = (), pending_rows: list[int] = (),
             staged_rows: list[int] = ()) -> LookupPlan:
        """compressed_ids [T] (DEAD = -1), cu_seqlens [S+1], lookback [S, max_ngram-1] and each pending token's
        max_ngram-1 ids before it (at packed rows ``pending_rows``) -> LookupPlan (pending rows' ids are
        placeholders); ``staged_rows``: rows whose Engram rows are staged (prefetch_plan.py), left out of what the
        tables are asked for."""
        if self.hasher is None:
            return LookupPlan({})
        rows, _ = self.hasher.hash_step(compressed_ids, cu_seqlens, lookback)  # {layer: [T, n_cols]}
        partials = None
        if pending_before:
            partials = torch.from_numpy(self.hasher.pending_partials(np.asarray(pending_before, dtype=np.int64)))
        dedup = ({lid: dedupe(r, list(pending_rows), list(staged_rows), self.dedup) for lid, r in rows.items()}
                 if self.dedup or staged_rows else {})
        return LookupPlan(rows, partials, dedup)
