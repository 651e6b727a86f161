"""Gather from a pinned host table into GPU memory: the fast paths of the ``host`` tier. Routes, picked per batch by
``route_for`` (or forced with ``route=``): "direct" (one Triton kernel reads rows through UVA, no host sync), "sorted"
(ids sorted so neighbouring reads share host pages; each distinct row read once, an HBM pass fills repeats) and "staged"
(CPU threads gather into pinned staging: staged.py). UVA's host address translation grows with the span a batch touches,
hence bands by batch size (``RouteBands``); all routes return the same bytes."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from engram.store.kernels import staged
from engram.store.kernels.launch_config import LaunchConfig

ROUTES = ("direct", "sorted", "staged")


@dataclass(frozen=True)
class RouteBands:
    """Batch-size bands of the host tier's routes (direct below ``staged_min_rows``, staged below ``sorted_min_rows``,
    then sorted); validated by StoreOptions."""

    staged_min_rows: int = 32768  # direct below, staged from here (ids on the CPU)
    sorted_min_rows: int = 524288  # sorted from here
    staged_chunk_rows: int = staged.CHUNK_ROWS  # rows per pipelined copy of the staged route

    def route(self, n: int, ids_on_cpu: bool = True) -> str:
        """The route of ``n`` ids; ids already on the GPU never take "staged" (a host sync): direct, then sorted."""
        if n < self.staged_min_rows:
            return "direct"
        return "staged" if ids_on_cpu and n < self.sorted_min_rows else "sorted"


DEFAULT_BANDS = RouteBands()
STAGED_MIN_ROWS = DEFAULT_BANDS.staged_min_rows
SORTED_MIN_ROWS = DEFAULT_BANDS.sorted_min_rows
# 16-row tiles: the fastest tile for sorted reads from a large pinned table
UVA_CONFIG = LaunchConfig(block_r=16, num_warps=4, programs_per_sm=0, stream=True)


@dataclass
class SortPlan:
    """Ids of one batch in ascending order, and how to put rows read in that order back."""

    sorted_ids: torch.Tensor  # [N] int32 (int64 for tables of 2**31 rows or more), ascending
    perm: torch.Tensor  # [N] int64: sorted_ids[i] belongs at output row perm[i]
    runs: torch.Tensor  # [N] int64: first index of i's run of equal ids (runs[i] == i: i reads the table)


def sort_plan(ids: torch.Tensor, table_rows: int) -> SortPlan:
    """Sort ``ids`` (int [N] on the GPU) and find runs of equal ids, without a host sync."""
    key = ids.to(torch.int32) if table_rows < 2**31 else ids.to(torch.int64)  # narrower keys sort faster
    sorted_ids, perm = torch.sort(key)  # [N], [N] int64
    # First index of each value: a parallel binary search (a cummax over millions of ids runs in one block).
    runs = torch.searchsorted(sorted_ids, sorted_ids)  # [N] int64
    return SortPlan(sorted_ids, perm, runs)


def route_for(n: int, route: str | None = None, bands: RouteBands = DEFAULT_BANDS) -> str:
    """The route for a batch of ``n`` ids: ``route`` when given (checked), else ``bands.route(n)`` (direct
    below staged_min_rows, staged below sorted_min_rows, sorted from there)."""
    if route is None:
        return bands.route(n)
    if route not in ROUTES:
        raise ValueError(f"route={route!r} is not one of {ROUTES}")
    return route


@functools.lru_cache(maxsize=None)
def uva_config(max_programs: int = 0, tiles_per_program: int = 1) -> LaunchConfig:
    """UVA_CONFIG with its grid capped at ``max_programs`` (0: none), spread at ``tiles_per_program``; cached."""
    if not max_programs and tiles_per_program == 1:
        return UVA_CONFIG
    return dataclasses.replace(UVA_CONFIG, max_programs=max_programs, tiles_per_program=tiles_per_program)


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                route: str | None = None, chunk_rows: int = staged.CHUNK_ROWS, max_programs: int = 0,
                tiles_per_program: int = 1) -> torch.Tensor:
    """Rows ``ids`` of a pinned host (or device) table dequantized into a GPU ``out`` [N, dim] ``dtype``. ``route``:
    None picks by ``route_for``; "staged" with GPU ids syncs. ``chunk_rows``: rows per staged copy; ``max_programs`` /
    ``tiles_per_program`` shape the grid, never the rows. CPU ids should be pinned (copied non_blocking)."""
    from engram.store.kernels import triton_gather  # needs triton; route_for and sort_plan do not
    device = staged.device_for(ids, out)
    n = ids.shape[0]
    kind = route_for(n, route)
    if kind == "staged" and values.device.type == "cpu" and n:
        return staged.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype, device=device,
                                  chunk_rows=chunk_rows)
    ids = ids.to(device, non_blocking=True)  # [N]
    if out is None:
        out = torch.empty(n, dim, dtype=dtype, device=device)  # [N, dim]
    cfg = uva_config(max_programs, tiles_per_program)
    if n == 0 or kind != "sorted":
        return triton_gather.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype, cfg=cfg)
    plan = sort_plan(ids, values.shape[0])
    triton_gather.gather_rows(values, scales, plan.sorted_ids, row_dtype, dim, out=out, dtype=dtype,
                              dst=plan.perm, runs=plan.runs, cfg=cfg)
    return triton_gather.copy_duplicates(out, plan.perm, plan.runs)


def gather_raw(values: torch.Tensor, ids: torch.Tensor, *, route: str | None = None,
               chunk_rows: int = staged.CHUNK_ROWS) -> torch.Tensor:
    """Packed bytes (uint8 [N, width], on the GPU) of rows ``ids`` of a pinned host (or device) table
    (``route`` and ``chunk_rows`` as in ``gather_rows``)."""
    from engram.store.kernels import triton_gather
    device = staged.device_for(ids, None)
    n = ids.shape[0]
    kind = route_for(n, route)
    if kind == "staged" and values.device.type == "cpu" and n:
        return staged.stage_rows([values], ids.reshape(-1), device, chunk_rows)[0]
    ids = ids.to(device, non_blocking=True)  # [N]
    if n == 0 or kind != "sorted":
        return triton_gather.gather_raw(values, ids, cfg=UVA_CONFIG)
    out = torch.empty(n, values.shape[1], dtype=torch.uint8, device=device)  # [N, width]
    plan = sort_plan(ids, values.shape[0])
    triton_gather.gather_raw(values, plan.sorted_ids, out, dst=plan.perm, runs=plan.runs, cfg=UVA_CONFIG)
    return triton_gather.copy_duplicates(out, plan.perm, plan.runs)
