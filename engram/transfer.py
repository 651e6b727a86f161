"""Copies between host and device that never stall the host: a pageable host->device copy synchronises the
CPU with the GPU, one from pinned memory with ``non_blocking=True`` only enqueues it.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(data: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor (or a list, built as ``dtype``) on ``device``: the same tensor off CUDA, else a
    non-blocking copy from pinned memory (the caching host allocator keeps it alive until the copy is done)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def to_host(tensors: list, device: torch.device) -> list:
    """Non-blocking copies into (pinned) host memory of a device's tensors (None stays None); on the CPU the
    tensors themselves. Wait for an event recorded after this call before reading them."""
    if device.type != "cuda":
        return tensors
    return [t if t is None else t.to("cpu", non_blocking=True) for t in tensors]
