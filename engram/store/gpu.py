"""The ``gpu`` tier: the whole table (values and scales) resident in device memory, or in RAM without CUDA.

Lookups are one fused gather + dequantize over the resident bytes (``engram.store.kernels.gather_rows``);
there is no cache (nothing is faster than the table itself). Loading reads the files in 256 MiB pinned
windows (parallel workers check every chunk's CRC32) while the previous window is copied to the device.
"""
from __future__ import annotations

import torch

from engram.store.base import ResidentTable, Tier
from engram.store.format import TableManifest
from engram.store.load import load_table


def default_device(device: torch.device | str | None) -> torch.device:
    """``device`` when given, else the current CUDA device when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class GpuTable(ResidentTable):
    """A table resident on ``device`` (default: the current CUDA device, else the CPU)."""

    tier = Tier.GPU
    host_backed = False

    def __init__(self, manifest: TableManifest, device: torch.device | str | None = None, *, verify: bool = True,
                 progress: bool = False) -> None:
        super().__init__(manifest, default_device(device))
        target = self.device if self.device.type != "cpu" else "ram"
        self.values, self.scales = load_table(manifest, target, verify=verify, progress=progress)
        # values uint8 [rows, row_stride], scales uint8 [rows, scale_cols] | None, both on self.device

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.int64)
        return self._gather_resident(ids.to(self.device), out, dtype)
