"""The ``host`` tier: the table in pinned host memory when CUDA exists (plain RAM otherwise), rows
returned on ``device``.

Without a cache a lookup is one ``engram.store.kernels.gather_rows`` call over the host bytes (the UVA
kernel of the GPU-kernels work reads pinned memory from the device; the torch reference gathers on the
CPU and copies the [N, dim] rows over). With ``cache`` (a RowCache on ``device``) distinct ids are looked
up first and only the misses cross PCIe, as packed bytes, before one dequantize on ``device``.
"""
from __future__ import annotations

import torch

from engram.store.base import TableBackend, Tier
from engram.store.cache import RowCache
from engram.store.format import TableManifest
from engram.store.gpu import default_device
from engram.store.load import load_table


class HostTable(TableBackend):
    """A table in (pinned) host memory serving rows to ``device`` (default: CUDA device, else the CPU)."""

    tier = Tier.HOST

    def __init__(self, manifest: TableManifest, device: torch.device | str | None = None,
                 cache: RowCache | None = None, *, verify: bool = True, progress: bool = False) -> None:
        super().__init__(manifest, default_device(device), cache)
        self.values, self.scales = load_table(manifest, "pinned", verify=verify, progress=progress)
        # values uint8 [rows, row_stride], scales uint8 [rows, scale_cols] | None, both in host memory
        self.pinned = self.values.is_pinned() if torch.cuda.is_available() else False

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.cache is None:
            return self._gather_resident(self.values, self.scales, ids, out, dtype)
        return super().gather(ids, out=out, dtype=dtype)

    def _fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = ids.to("cpu")
        self._count(bytes_read=ids.numel() * (self.manifest.row_stride + self.scale_cols), read_ops=1)
        vals = self.values.index_select(0, ids)  # [M, row_stride] on the host
        scales = self.scales.index_select(0, ids) if self.scales is not None else None
        return vals, scales  # packed bytes: the caller moves them across PCIe, then dequantizes on the device

    def close(self) -> None:
        super().close()
        self.values = self.scales = None
