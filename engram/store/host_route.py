"""``HostRoute``: how an uncached host-tier lookup reads its rows, decided once when the table opens. The kernel ("uva":
Triton over UVA, needing CUDA, triton, pinned memory and rows on a GPU; else "reference": torch on the CPU) and the UVA
routes' batch-size bands (StoreOptions) are fixed at open; a lookup costs one comparison. CPU ids stay there for the
staged route and go to the GPU through pinned memory otherwise; GPU ids never take the staged route."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.store import kernels
from engram.store.kernels import reference
from engram.store.kernels.uva import RouteBands
from engram.transfer import to_device
from engram.store.kernels import uva

KERNELS = ("uva", "reference")


@dataclass(frozen=True)
class HostRoute:
    """One host table's read path: ``kernel`` ("uva" | "reference"), the UVA ``bands`` and the UVA grid's cap
    (``max_programs``, 0: none) and spread (``tiles_per_program``, 1: one program per tile)."""

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
        if route != "staged":
            ids = to_device(ids, device)
        return uva.gather_rows(values, scales, ids, row_dtype, dim, out=out, dtype=dtype, route=route,
                               chunk_rows=self.bands.staged_chunk_rows, max_programs=self.max_programs,
                               tiles_per_program=self.tiles_per_program)
