"""The ``host`` tier: the table in pinned host memory when CUDA exists (plain RAM otherwise), rows
returned on ``device``.

Without a cache a lookup is one kernel call over the host bytes along the table's ``HostRoute``, decided at
open (engram.store.host_route): with CUDA one of the UVA routes of engram.store.kernels.uva (UVA kernel,
CPU-staged copies or sorted UVA, by batch size), never waiting for the GPU; without, the torch reference
gathers on the CPU. With ``cache`` (a RowCache on ``device``) distinct ids are looked up first and only the
misses cross PCIe, as packed bytes, before one dequantize on ``device`` (the cache's bookkeeping reads
counts back: a cached lookup syncs).

Host layout of an MXFP8 table (``StoreOptions.host_layout``): "packed" (default) keeps each row's value and
scale bytes side by side in one buffer (engram.store.load.load_packed), so a UVA read of a row touches one
host page where "split" (the files' own layout, values and scales in two buffers) touches two; tables
without scales have a single buffer and ignore the layout.
"""
from __future__ import annotations

import torch

from engram.store.base import ResidentTable, Tier
from engram.store.cache import RowCache
from engram.store.format import TableManifest
from engram.store.gpu import default_device
from engram.store.host_route import HostRoute
from engram.store.load import load_table
from engram.store.options import StoreOptions


class HostTable(ResidentTable):
    """A table in (pinned) host memory serving rows to ``device`` (default: CUDA device, else the CPU).

    Layout "packed": ``values`` = packed[:, :value_bytes] and ``scales`` = packed[:, value_bytes:
    value_bytes + scale_cols], strided views (row stride S = value_bytes + scale_cols rounded up to 16,
    272 B for V4.1; unit column stride) of one buffer uint8 [rows, S]. "split": ``values`` uint8 [rows,
    row_stride] and ``scales`` uint8 [rows, scale_cols], two buffers. ``options.load_threads`` workers read
    and CRC-check the files (``options.verify``) into that memory in one pass. ``route``: the HostRoute."""

    tier = Tier.HOST

    def __init__(self, manifest: TableManifest, device: torch.device | str | None = None,
                 cache: RowCache | None = None, options: StoreOptions | None = None, *,
                 progress: bool = False) -> None:
        super().__init__(manifest, default_device(device), cache, options)
        layout = self.options.host_layout
        self.layout = layout if self.scale_cols else "split"  # one buffer either way without scales
        self.values, self.scales = load_table(manifest, "pinned", verify=self.options.verify, progress=progress,
                                              layout=layout, threads=self.options.load_threads)
        # values uint8 [rows, >= value_bytes], scales uint8 [rows, scale_cols] | None, both in host memory
        self.route = HostRoute.decide(self.values, self.device, self.options.route_bands)

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.cache is None:
            return self._gather_resident(ids, out, dtype)
        return super().gather(ids, out=out, dtype=dtype)  # packed misses cross PCIe, decoded on the device

    @property
    def gathers_on_device(self) -> bool:
        """Uncached, through the UVA kernels (device ids never take the staged route)."""
        return self.cache is None and self.route.kernel == "uva"

    def _kernel_gather(self, ids: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return self.route.gather_rows(self.values, self.scales, ids, self.row_dtype, self.dim, self.device,
                                      out=out, dtype=dtype)
