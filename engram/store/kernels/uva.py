"""Gather from a pinned host table straight into GPU memory (UVA): the fast path of the ``host`` tier.

Random rows over a table of many gigabytes thrash the GPU's translation of host addresses (FACTS.md:
8 GB/s random vs 52 GB/s sorted at 4 M rows), so batches of at least ``SORT_MIN_ROWS`` ids are sorted
first: the kernel walks the sorted ids (neighbouring reads share pages), reads each distinct row once
(``runs`` gives the first index of each run of equal ids) and stores it straight at its caller's position
(``dst`` = the sort permutation); a second, HBM-only pass copies the row to the run's other positions.
Smaller batches are gathered as they come, one launch. Nothing here synchronizes with the host.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engram.store.kernels import triton_gather
from engram.store.kernels.launch_config import LaunchConfig

SORT_MIN_ROWS = int(os.environ.get("ENGRAM_UVA_SORT_MIN_ROWS", "16384"))
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
    # First index of each value: a parallel binary search (cummax over 4 M ids ran in one block: 12 ms).
    runs = torch.searchsorted(sorted_ids, sorted_ids)  # [N] int64
    return SortPlan(sorted_ids, perm, runs)


def _device_for(ids: torch.Tensor, out: torch.Tensor | None) -> torch.device:
    if ids.is_cuda:
        return ids.device
    if out is not None and out.is_cuda:
        return out.device
    return torch.device("cuda", torch.cuda.current_device())


def _use_sort(n: int, sort: bool | None) -> bool:
    return n >= SORT_MIN_ROWS if sort is None else sort


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                sort: bool | None = None) -> torch.Tensor:
    """Rows ``ids`` of a pinned host (or device) table, dequantized into a GPU ``out`` [N, dim] ``dtype``.
    ``sort``: None = sort batches of SORT_MIN_ROWS ids or more; True / False forces it (benchmarks)."""
    device = _device_for(ids, out)
    ids = ids.to(device, non_blocking=True)  # [N]
    n = ids.shape[0]
    if out is None:
        out = torch.empty(n, dim, dtype=dtype, device=device)  # [N, dim]
    if n == 0 or not _use_sort(n, sort):
        return triton_gather.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype, cfg=UVA_CONFIG)
    plan = sort_plan(ids, values.shape[0])
    triton_gather.gather_rows(values, scales, plan.sorted_ids, row_dtype, dim, out=out, dtype=dtype,
                              dst=plan.perm, runs=plan.runs, cfg=UVA_CONFIG)
    return triton_gather.copy_duplicates(out, plan.perm, plan.runs)


def gather_raw(values: torch.Tensor, ids: torch.Tensor, *, sort: bool | None = None) -> torch.Tensor:
    """Packed bytes (uint8 [N, stride], on the GPU) of rows ``ids`` of a pinned host (or device) table."""
    device = _device_for(ids, None)
    ids = ids.to(device, non_blocking=True)  # [N]
    n = ids.shape[0]
    if n == 0 or not _use_sort(n, sort):
        return triton_gather.gather_raw(values, ids, cfg=UVA_CONFIG)
    out = torch.empty(n, values.shape[1], dtype=torch.uint8, device=device)  # [N, stride]
    plan = sort_plan(ids, values.shape[0])
    triton_gather.gather_raw(values, plan.sorted_ids, out, dst=plan.perm, runs=plan.runs, cfg=UVA_CONFIG)
    return triton_gather.copy_duplicates(out, plan.perm, plan.runs)
