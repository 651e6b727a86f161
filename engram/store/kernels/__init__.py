"""Gather kernels behind one function: ``gather_rows`` / ``gather_raw``. ``reference.py`` is plain torch and runs
everywhere; with backend "auto" the Triton kernels take over for tables on a CUDA device (triton_gather.py) or in pinned
host memory (uva.py), bitwise equal, rows on the GPU (ids' device, else ``out``'s, else the current one).
``set_backend("torch")`` or ``ENGRAM_KERNELS=torch`` forces the reference; "triton" raises where it cannot run."""
from __future__ import annotations

import functools

import torch

from engram.fast_path import FastPathSwitch
from engram.store.kernels import reference, uva

SWITCH = FastPathSwitch("kernel backend", "gather")


def set_backend(name: str) -> str:
    """Select "auto" (fast path where available), "torch" (reference) or "triton"; returns the old one."""
    return SWITCH.set(name)


def get_backend() -> str:
    return SWITCH.value


@functools.cache
def triton_available() -> bool:
    """True when CUDA is up and the Triton kernels import (triton has no CPU backend)."""
    if not torch.cuda.is_available():
        return False
    try:
        from engram.store.kernels import triton_gather  # noqa: F401
    except ImportError:
        return False
    return True


def fast_path(values: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    """Which fast kernel serves this table: "hbm", "uva" or None (the torch reference)."""
    if SWITCH.value == "torch":
        return None
    kind = None
    if out is None or out.is_cuda:
        if values.is_cuda:
            kind = "hbm"
        elif values.device.type == "cpu" and torch.cuda.is_available() and values.is_pinned():
            kind = "uva"
    if kind is not None and not triton_available():
        kind = None
    if kind is None and SWITCH.value == "triton":
        raise RuntimeError(f"kernel backend 'triton' needs triton, CUDA, a table on a CUDA device or in pinned "
                           f"host memory and a CUDA out; got table on {values.device} (pinned: "
                           f"{values.device.type == 'cpu' and torch.cuda.is_available() and values.is_pinned()}), "
                           f"out on {None if out is None else out.device}, triton usable: {triton_available()}")
    return kind


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantized rows ``ids`` of a packed table (see reference.gather_rows for the contract)."""
    kind = fast_path(values, out)
    if kind == "hbm":
        from engram.store.kernels import triton_gather
        if scales is not None and not scales.is_cuda:
            scales = scales.to(values.device)
        return triton_gather.gather_rows(values, scales, ids.to(values.device, non_blocking=True), row_dtype,
                                         dim, out=out, dtype=dtype)
    if kind == "uva":
        return uva.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype)
    return reference.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype)


def gather_raw(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Packed bytes of rows ``ids`` (uint8 [N, stride])."""
    kind = fast_path(values)
    if kind == "hbm":
        from engram.store.kernels import triton_gather
        return triton_gather.gather_raw(values, ids.to(values.device, non_blocking=True))
    if kind == "uva":
        return uva.gather_raw(values, ids)
    return reference.gather_raw(values, ids)
