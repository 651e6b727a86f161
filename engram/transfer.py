"""Copies between host and device that never stall the host: pinned staging, non-blocking copies.

A pageable host→device copy makes the CPU wait for the GPU (a host synchronisation); copying from page-locked
memory with ``non_blocking=True`` only enqueues it. Every per-step input the engine hands a CUDA device goes
through ``to_device``; on the CPU it is the identity (same tensor, no copy). ``to_host`` is the way back:
non-blocking copies into pinned memory that the caller waits for through an event recorded after them.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(data: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor (or a list, built as ``dtype``) on ``device``; CUDA copies come from pinned memory,
    non-blocking (the caching host allocator keeps the pinned buffer alive until the copy is done). A
    non-contiguous CPU tensor (a column slice of packed rows) is made contiguous first, so the copy is one
    pinned transfer rather than a pageable one."""
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
