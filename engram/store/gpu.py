"""The ``gpu`` tier: the whole table resident in device memory (RAM without CUDA); lookups are one fused gather +
dequantize (``kernels.gather_rows``), never waiting for the GPU; no cache. Loads through pinned windows."""
from __future__ import annotations

import torch

from engram.store import kernels
from engram.store.base import ResidentTable, StorageBuild, Tier
from engram.store.format import TableManifest
from engram.store.options import StoreOptions
from engram.transfer import to_device


def default_device(device: torch.device | str | None) -> torch.device:
    """``device`` (a CUDA device without an index gets the current one), else the current CUDA device, else the CPU."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class GpuTable(ResidentTable):
    """A table resident on ``device`` (default: the current CUDA device, else the CPU), read from its files
    or, with ``build`` (a ``StorageBuild``), made in memory without any file."""

    tier = Tier.GPU
    host_backed = False

    def __init__(self, manifest: TableManifest, device: torch.device | str | None = None,
                 options: StoreOptions | None = None, *, progress: bool = False,
                 build: StorageBuild | None = None) -> None:
        super().__init__(manifest, default_device(device), options=options)
        target = self.device if self.device.type != "cpu" else "ram"
        self.values, self.scales = self._storage(target, "split", progress, build)  # files, or ``build``
        # values uint8 [rows, row_stride], scales uint8 [rows, scale_cols] | None, both on self.device

    @property
    def gathers_on_device(self) -> bool:
        return self.device.type == "cuda" and kernels.fast_path(self.values) == "hbm"

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self._gather_resident(ids, out, dtype)

    def gather_raw_direct(self, ids: torch.Tensor) -> torch.Tensor:
        """``gather_raw``'s bytes [N, row_bytes] for in-range ``ids`` on ``self.device``, without deduplication or
        counting: device work alone (a CUDA graph captures it; ``record_lookups`` counts replays)."""
        vals = self.values[:, : self.value_bytes].index_select(0, ids)
        return vals if self.scales is None else torch.cat([vals, self.scales.index_select(0, ids)], dim=1)

    def _kernel_gather(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return kernels.gather_rows(self.values, self.scales, to_device(ids, self.device), self.row_dtype, self.dim,
                                   out=out, dtype=dtype)
