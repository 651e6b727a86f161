"""Gather from a pinned host table into GPU memory: the fast paths of the ``host`` tier.

Three routes, picked per batch by ``route_for`` (or forced with ``route=``, as benchmarks do):
- "direct": one Triton kernel reads the rows through UVA as the ids come (one launch, no host sync);
- "sorted": the ids are sorted first so that neighbouring reads share host pages; the kernel reads each
  distinct row once (``runs``: first index of each run of equal ids) and stores it at its caller's
  position (``dst`` = the sort permutation); a second, HBM-only pass fills the run's other positions;
- "staged": CPU threads gather the rows into pinned staging and the copy engine moves them (staged.py).
On the device machine a UVA read of a random row pays a host-side address translation that grows with
the span of host memory a batch touches (docs/benchmarks.md, "where the time goes"): small batches go
direct, mid-size ones (``RouteBands.staged_min_rows``) staged, big ones (``sorted_min_rows``, dense
enough that sorted ids share pages) sorted. All routes return the same bytes. The host tier fixes its bands
once at open (``engram.store.host_route``, from StoreOptions); ``route_for`` with the default bands is
what a bare call here uses.
"""
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
    """Batch-size bands of the host tier's routes. Defaults from the wall-clock series of
    bench/results/2026-11-29-gpu-lookup-6.json (32 GiB packed table): direct is fastest up to 16 K ids,
    staged from 64 K to 256 K, sorted from 1 M. Validated by StoreOptions, which the table's bands come from."""

    staged_min_rows: int = 32768  # direct below, staged from here (ids on the CPU)
    sorted_min_rows: int = 524288  # sorted from here
    staged_chunk_rows: int = staged.CHUNK_ROWS  # rows per pipelined copy of the staged route

    def route(self, n: int, ids_on_cpu: bool = True) -> str:
        """The route of a batch of ``n`` ids. Ids already on the GPU never take "staged" (its CPU gather
        would copy them back, a host sync): they go direct below ``staged_min_rows`` and sorted from there."""
        if n < self.staged_min_rows:
            return "direct"
        return "staged" if ids_on_cpu and n < self.sorted_min_rows else "sorted"


DEFAULT_BANDS = RouteBands()
STAGED_MIN_ROWS = DEFAULT_BANDS.staged_min_rows
SORTED_MIN_ROWS = DEFAULT_BANDS.sorted_min_rows
# Sorted 4 M rows from a 32 GiB pinned table (bench/results/2026-11-29-gpu-lookup-3.json): 16-row tiles
# 35 GB/s, 32-row 23 GB/s, 64-row 22 GB/s, 64-row persistent 20 GB/s.
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
    """UVA_CONFIG, with its grid capped at ``max_programs`` programs when that is not 0 and spread at
    ``tiles_per_program`` tiles a program when that is above 1 (launch_config.spread_programs). One object
    per pair: a host table asks for it at every gather."""
    if not max_programs and tiles_per_program == 1:
        return UVA_CONFIG
    return dataclasses.replace(UVA_CONFIG, max_programs=max_programs, tiles_per_program=tiles_per_program)


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                route: str | None = None, chunk_rows: int = staged.CHUNK_ROWS, max_programs: int = 0,
                tiles_per_program: int = 1) -> torch.Tensor:
    """Rows ``ids`` of a pinned host (or device) table, dequantized into a GPU ``out`` [N, dim] ``dtype``.
    ``route``: None = ``route_for``'s choice; "direct", "sorted" or "staged" forces one (a device table
    has no staged route; staged with ids on the GPU copies them to the CPU first, a host sync).
    ``chunk_rows``: rows per pipelined copy of the staged route. ``max_programs``: cap on the UVA kernels'
    grid (0: one program per tile), ``tiles_per_program``: a grid that grows with the batch (1: one program
    per tile); the rows depend on neither. CPU ids should sit in pinned memory: the
    other routes copy them to the GPU with non_blocking=True."""
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
