"""The ``host`` tier: the table in pinned host memory when CUDA exists (plain RAM otherwise), rows
returned on ``device``.

Without a cache a lookup is one ``engram.store.kernels.gather_rows`` call over the host bytes (the UVA
kernel of the GPU-kernels work reads pinned memory from the device; the torch reference gathers on the
CPU and copies the [N, dim] rows over). With ``cache`` (a RowCache on ``device``) distinct ids are looked
up first and only the misses cross PCIe, as packed bytes, before one dequantize on ``device``.
"""
from __future__ import annotations

import torch

from engram.store.base import ResidentTable, Tier
from engram.store.cache import RowCache
from engram.store.format import TableManifest
from engram.store.gpu import default_device
from engram.store.load import load_table


class HostTable(ResidentTable):
    """A table in (pinned) host memory serving rows to ``device`` (default: CUDA device, else the CPU)."""

    tier = Tier.HOST

    def __init__(self, manifest: TableManifest, device: torch.device | str | None = None,
                 cache: RowCache | None = None, *, verify: bool = True, progress: bool = False) -> None:
        super().__init__(manifest, default_device(device), cache)
        self.values, self.scales = load_table(manifest, "pinned", verify=verify, progress=progress)
        # values uint8 [rows, row_stride], scales uint8 [rows, scale_cols] | None, both in host memory

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.cache is None:
            return self._gather_resident(ids, out, dtype)
        return super().gather(ids, out=out, dtype=dtype)  # packed misses cross PCIe, decoded on the device
