"""Lookup plan and its executor: what Engram rows a step needs, and fetching them from the store.

At step start ``LookupPlanner.plan`` hashes the step's packed compressed ids (with each sequence's
lookback) into a ``LookupPlan``: per Engram layer the row ids [T, n_cols] and their deduplicated form
(sorted unique ids + inverse), tagged with a plan id. An executor turns a plan into ``StagedRows``;
``SyncLookupExecutor`` does it at once through ``table.submit(...).wait()``. Plan and executor are
separate so an overlapping executor can replace this one without touching the runner. Staged rows carry
their plan id and refuse to serve another plan (stale-row rejection).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engram.config import EngramConfig
from engram.hashing import NgramHasher


@dataclass(frozen=True)
class LayerLookup:
    row_ids: torch.Tensor  # [T, n_cols] int64 global row ids of this layer's table
    unique_ids: torch.Tensor  # [U] int64 sorted distinct row ids (what the store reads)
    inverse: torch.Tensor  # [T * n_cols] int64: row_ids.flatten() == unique_ids[inverse]


@dataclass(frozen=True)
class LookupPlan:
    plan_id: int  # unique per engine; staged rows must carry the same id to be consumed
    seq_ids: tuple[int, ...]  # engine sequence id of each packed sequence
    cu_seqlens: torch.Tensor  # [S+1] int64 token offsets of each sequence in the packed step
    positions: torch.Tensor  # [T] int64 position of each token in its sequence
    compressed_ids: torch.Tensor  # [T] int64 compressed ids of the step (DEAD = -1)
    layers: dict[int, LayerLookup]  # Engram layer id -> its lookups
    next_lookback: torch.Tensor  # [S, max_ngram-1] each sequence's lookback after this step

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def num_unique_rows(self) -> int:
        return sum(int(lk.unique_ids.numel()) for lk in self.layers.values())


class LookupPlanner:
    """Hashes a packed step into a LookupPlan (CPU int64; the plan is small next to the rows)."""

    def __init__(self, cfg: EngramConfig | None, hasher: NgramHasher | None):
        self.cfg = cfg
        self.hasher = hasher
        self._ids = itertools.count()

    def plan(self, seq_ids: list[int], compressed_ids: torch.Tensor, cu_seqlens: torch.Tensor,
             positions: torch.Tensor, lookback: torch.Tensor) -> LookupPlan:
        """compressed_ids [T], cu_seqlens [S+1], positions [T], lookback [S, max_ngram-1] -> LookupPlan."""
        if self.hasher is None:  # no Engram layers: an empty plan
            return LookupPlan(next(self._ids), tuple(seq_ids), cu_seqlens, positions, compressed_ids, {}, lookback)
        rows, next_lookback = self.hasher.hash_step(compressed_ids, cu_seqlens, lookback)  # {layer: [T, n_cols]}
        layers = {}
        for lid, r in rows.items():
            unique, inverse = torch.unique(r.reshape(-1), sorted=True, return_inverse=True)  # [U], [T*n_cols]
            layers[lid] = LayerLookup(row_ids=r, unique_ids=unique, inverse=inverse)
        return LookupPlan(plan_id=next(self._ids), seq_ids=tuple(seq_ids), cu_seqlens=cu_seqlens,
                          positions=positions, compressed_ids=compressed_ids, layers=layers,
                          next_lookback=next_lookback)


class StagedRows:
    """Rows of one plan, per layer [T, n_cols, head_dim]; ``rows(layer_id, plan_id)`` checks the plan."""

    def __init__(self, plan_id: int, rows: dict[int, torch.Tensor]):
        self.plan_id = plan_id
        self._rows = rows

    def rows(self, layer_id: int, plan_id: int) -> torch.Tensor:
        if plan_id != self.plan_id:
            raise RuntimeError(f"stale Engram rows: staged for plan {self.plan_id}, consumed by plan {plan_id}")
        if layer_id not in self._rows:
            raise KeyError(f"no staged rows for Engram layer {layer_id} (plan {self.plan_id} has {sorted(self._rows)})")
        return self._rows[layer_id]


class SyncLookupExecutor:
    """Executes a plan before the model runs: every layer's unique rows are submitted, then waited for."""

    def __init__(self, tables: dict, cfg: EngramConfig | None, dtype: torch.dtype, device: torch.device):
        missing = [lid for lid in (cfg.layer_ids if cfg else ()) if lid not in tables]
        if missing:
            raise ValueError(f"no table for Engram layer(s) {missing} (tables cover {sorted(tables)})")
        self.tables = tables
        self.cfg = cfg
        self.dtype = dtype
        # Tables serve at most float32 on CUDA (the Triton gather); every table value is exact in float32,
        # so float64 models read float32 rows and widen them.
        self.fetch_dtype = torch.float32 if dtype == torch.float64 else dtype
        self.device = torch.device(device)

    def submit(self, plan: LookupPlan) -> StagedRows:
        handles = {lid: self.tables[lid].submit(lk.unique_ids, dtype=self.fetch_dtype)
                   for lid, lk in plan.layers.items()}
        rows = {}
        for lid, lk in plan.layers.items():
            unique_rows = handles[lid].wait().to(self.device, self.dtype)  # [U, head_dim]
            t = lk.row_ids.shape[0]
            inverse = lk.inverse.to(self.device)
            rows[lid] = unique_rows.index_select(0, inverse).reshape(t, self.cfg.n_cols, -1)  # [T, n_cols, D]
        return StagedRows(plan.plan_id, rows)


def staging_bytes(cfg: EngramConfig, max_tokens: int, dtype: torch.dtype) -> int:
    """Peak bytes of one step's staged rows: per layer the unique rows and the expanded [T, n_cols, D]."""
    per_layer = 2 * max_tokens * cfg.n_cols * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    return per_layer * len(cfg.layer_ids)
