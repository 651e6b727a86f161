"""Row-id deduplication of a step's (or a prefetch's) lookup plan, on the host, where the plan is hashed: a prompt
repeats n-grams (every "the" of a text hashes to the same rows), so the tables gather each distinct row once and the
device expands them with an inverse-index gather. Bitwise the rows of the plain gather: the same rows are read, only
fewer times.

``dedupe(row_ids, pending_rows)`` -> ``DedupRows``::

    row_ids [T, n_cols]   r0 r1 r2 | r0 r3 r2 | p  p  p      (pending row: placeholders, patched on the device)
    unique  [U + P*n_cols] r0 r1 r2 r3 | 0  0  0             ascending distinct known ids, then one slot per
    inverse [T * n_cols]   0  1  2  0  3  2  4  5  6         pending id (the Worker writes its patched ids there)

so ``gather(unique)[inverse]`` equals ``gather(row_ids.reshape(-1))`` row for row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DedupRows:
    """One Engram layer's deduplicated ids (CPU int64)."""

    unique: torch.Tensor  # [U + P * n_cols] ascending distinct known ids, then the pending rows' slots (0 unpatched)
    inverse: torch.Tensor  # [T * n_cols] index into ``unique`` of each planned id, row-major over [T, n_cols]
    num_known: int  # U: the distinct ids the host knows (the pending slots follow them)
    n_cols: int  # columns per token row

    @property
    def num_ids(self) -> int:
        return int(self.inverse.numel())

    @property
    def patch_slots(self) -> int:
        """Pending rows given slots (the rows a ``PendingPatch`` must fill: its ``rows`` count)."""
        return (self.unique.numel() - self.num_known) // self.n_cols

    @property
    def num_unique(self) -> int:
        """Rows the tables gather: the distinct known ids plus one per pending id."""
        return int(self.unique.numel())

    def patched_unique(self, pending_ids: torch.Tensor | None) -> torch.Tensor:
        """``unique`` with the pending slots filled by ``pending_ids`` ([P, n_cols] on any device; None when P = 0),
        on that device."""
        if pending_ids is None or pending_ids.numel() == 0:
            return self.unique
        head = self.unique[: self.num_known].to(pending_ids.device, non_blocking=True)
        return torch.cat([head, pending_ids.reshape(-1)])


def dedupe(row_ids: torch.Tensor, pending_rows: list[int] = (), skip_rows: list[int] = (),
           distinct: bool = True) -> DedupRows:
    """``row_ids`` [T, n_cols] int64 CPU; ``pending_rows``: packed rows whose ids are placeholders (async
    scheduling), each given slots of its own after the known ids, in ``pending_rows`` order; ``skip_rows``: rows the
    tables are not asked for (staged ahead: engine/prefetch_plan.py), whose inverse entries point at slot 0 (at least
    one id is kept so the expansion has a row to read; the caller overwrites them); ``distinct`` False keeps every
    other id (the lookups then skip only ``skip_rows``)."""
    t, n_cols = row_ids.shape
    flat = row_ids.numpy().reshape(-1)
    if not pending_rows and not skip_rows and distinct:
        uniq, inverse = np.unique(flat, return_inverse=True)
        return DedupRows(torch.from_numpy(uniq), torch.from_numpy(inverse.reshape(-1).astype(np.int64)), len(uniq),
                         n_cols)
    asked = np.ones(t, dtype=bool)
    asked[list(pending_rows)] = False
    asked[list(skip_rows)] = False
    known = np.repeat(asked, n_cols)  # [T * n_cols]
    if distinct:
        uniq, inv = np.unique(flat[known], return_inverse=True)
    else:
        uniq = flat[known]
        inv = np.arange(len(uniq), dtype=np.int64)
    if len(uniq) == 0 and not pending_rows:
        uniq = flat[:1]  # a real id: every position is overwritten, but the expansion reads one row
    inverse = np.zeros(t * n_cols, dtype=np.int64)
    inverse[known] = inv.reshape(-1)
    # pending row k (in pending_rows order), column c -> slot U + k * n_cols + c
    slots = len(uniq) + np.arange(len(pending_rows) * n_cols, dtype=np.int64).reshape(len(pending_rows), n_cols)
    inverse.reshape(t, n_cols)[list(pending_rows)] = slots
    unique = np.concatenate([uniq, np.zeros(len(pending_rows) * n_cols, dtype=np.int64)])
    return DedupRows(torch.from_numpy(unique), torch.from_numpy(inverse), len(uniq), n_cols)


def host_table_ids(step, dedup: DedupRows | None, host_ids: torch.Tensor) -> torch.Tensor:
    """The CPU ids [M] a table is asked for one layer of ``step``: with ``dedup`` (that layer's), its distinct ids with
    the pending slots filled from ``host_ids`` (the step's patched [T, n_cols] ids), else every planned id."""
    if dedup is None:
        return host_ids.reshape(-1)
    pending = host_ids[step.pending_rows] if step.pending_rows else None  # [P, n_cols], patched
    return dedup.patched_unique(pending)
