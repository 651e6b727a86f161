"""``HostRoute``: how an uncached host-tier lookup reads its rows, decided once when the table opens.

At open the table settles which kernel can read its memory ("uva": the Triton kernels read the pinned table
through UVA, which needs CUDA, triton, pinned memory and rows returned on a GPU; else "reference": torch
gathers on the CPU) and the batch-size bands of the UVA routes (StoreOptions.staged_min_rows /
sorted_min_rows / staged_chunk_rows, see engram.store.kernels.uva). A lookup then costs one comparison of its
size with the bands, nothing re-derived per call. Ids from the CPU stay there for the staged route (the CPU
gathers the rows) and go to the GPU through pinned memory without blocking for the others; ids already on
the GPU never take the staged route (it would copy them back, a host sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.store import kernels
from engram.store.kernels import reference
from engram.store.kernels.uva import RouteBands
from engram.transfer import to_device

KERNELS = ("uva", "reference")


@dataclass(frozen=True)
class HostRoute:
    """The read path of one host table: ``kernel`` ("uva" | "reference"), the UVA ``bands`` and the UVA
    kernels' grid: a cap (``max_programs``, 0: none; StoreOptions.uva_max_programs) and a spread
    (``tiles_per_program``, 1: one program per tile; StoreOptions.uva_tiles_per_program)."""

    kernel: str
    bands: RouteBands
    max_programs: int = 0
    tiles_per_program: int = 1

    @classmethod
    def decide(cls, values: torch.Tensor, device: torch.device, bands: RouteBands,
               max_programs: int = 0, tiles_per_program: int = 1) -> "HostRoute":
        """The route of a table whose bytes are ``values`` serving rows on ``device``."""
        uva = device.type == "cuda" and kernels.fast_path(values) == "uva"
        return cls("uva" if uva else "reference", bands, max_programs, tiles_per_program)

    def route(self, n: int, ids_on_cpu: bool) -> str:
        """"reference", or the UVA route ("direct" | "staged" | "sorted") of a batch of ``n`` ids."""
        return self.bands.route(n, ids_on_cpu) if self.kernel == "uva" else "reference"

    def gather_rows(self, values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str,
                    dim: int, device: torch.device, out: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows ``ids`` (int64 [N], checked) dequantized: on ``device`` through UVA, on the CPU by reference."""
        route = self.route(ids.numel(), ids.device.type == "cpu")
        if route == "reference":
            return reference.gather_rows(values, scales, ids.cpu(), row_dtype, dim,
                                         out=out if out is None or out.device.type == "cpu" else None, dtype=dtype)
        from engram.store.kernels import uva
        if route != "staged":
            ids = to_device(ids, device)
        return uva.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype, route=route,
                               chunk_rows=self.bands.staged_chunk_rows, max_programs=self.max_programs,
                               tiles_per_program=self.tiles_per_program)
