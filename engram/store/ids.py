"""Row ids on their way into a lookup: their form and their range check. CPU ids are range-checked on the CPU and reach
the GPU through pinned memory with ``non_blocking=True``, so neither makes the host wait. GPU ids are trusted (the
engine's hashing keeps them in range; checking syncs) unless ``StoreOptions.check_device_ids``."""
from __future__ import annotations

from typing import Any

import torch


def as_ids(ids: torch.Tensor | Any) -> torch.Tensor:
    """int64 [N] view of ``ids`` (any integer tensor on any device, list or array); TypeError otherwise."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.int64)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"row ids must be an integer tensor, got {ids.dtype}")
    return ids.reshape(-1).to(torch.int64)


def check_range(ids: torch.Tensor, rows: int, what: Any) -> None:
    """IndexError naming the first id outside [0, rows), its position and ``what``; on a GPU one reduction, one sync."""
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu":  # numpy: cheaper than torch's ops at a decode lookup's few ids
        a = ids.numpy()
        bad = bool(a.min() < 0 or a.max() >= rows)
    else:
        lo, hi = torch.aminmax(ids)
        bad = bool((lo < 0) | (hi >= rows))
    if bad:
        pos = int(((ids < 0) | (ids >= rows)).nonzero()[0, 0])
        raise IndexError(f"row id {int(ids[pos])} (position {pos}) is out of range for table {what} with "
                         f"{rows} rows")

