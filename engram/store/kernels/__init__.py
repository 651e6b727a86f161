"""Gather kernels behind one function: ``gather_rows`` / ``gather_raw``.

``reference.py`` is plain torch and runs everywhere; fast CUDA paths (Triton, added by the GPU-kernels
work) are chosen at runtime when the table lives on a CUDA device or in pinned host memory. Tests flip
the backend with ``set_backend("torch")`` or the environment variable ``ENGRAM_KERNELS=torch``.
"""
from __future__ import annotations

import os

import torch

from engram.store.kernels import reference

_BACKEND = os.environ.get("ENGRAM_KERNELS", "auto")
BACKENDS = ("auto", "torch", "triton")


def set_backend(name: str) -> str:
    """Select "auto" (fast path where available), "torch" (reference) or "triton"; returns the old one."""
    global _BACKEND
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is not one of {BACKENDS}")
    old, _BACKEND = _BACKEND, name
    return old


def get_backend() -> str:
    return _BACKEND


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantized rows ``ids`` of a packed table (see reference.gather_rows for the contract)."""
    return reference.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype)


def gather_raw(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Packed bytes of rows ``ids`` (uint8 [N, stride])."""
    return reference.gather_raw(values, ids)
