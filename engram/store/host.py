"""The ``host`` tier: the table in pinned host memory when CUDA exists (plain RAM otherwise), rows returned on
``device``; with ``shared_memory`` the node's one copy (store/shared_host.py), mapped and registered here.

Uncached, a lookup is one kernel call along the table's ``HostRoute`` (engram.store.host_route: a UVA route with CUDA,
never waiting for the GPU; the torch reference without). With a ``cache`` only the misses cross PCIe, through
``RowStaging``, before one dequantize on ``device`` (a cached lookup syncs). MXFP8 tables are "packed" by default
(``host_layout``; load.load_packed), so a UVA read of a row touches one host page."""
from __future__ import annotations

import threading

import torch

from engram.store.base import ResidentTable, StorageBuild, Tier
from engram.store.cache import RowCache
from engram.store.format import TableManifest
from engram.store.gpu import default_device
from engram.store.host_route import HostRoute
from engram.store.kernels.staged import row_sources
from engram.store.options import StoreOptions
from engram.store.shared_host import shared_target

STAGING_MIN_ROWS = 1024  # the smallest staging buffer, in rows; it grows to the next power of two on demand


class RowStaging:
    """Rows of a host table fetched by id on their way to ``device`` (cache misses, ``gather_raw``): the CPU
    ``index_select``s them into one reusable staging buffer (pinned under CUDA, grown to powers of two of rows, at least
    STAGING_MIN_ROWS), and one non-blocking copy moves them on the current stream. Returned tensors are new, never the
    buffer. The buffer is rewritten only after its last copy's event; one fetch at a time (a lock). Rows come from
    ``kernels.staged.row_sources(values, scales)``."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor | None, device: torch.device) -> None:
        self.sources = row_sources(values, scales)  # uint8 [R, w_j] host tensors
        self.widths = [s.shape[1] for s in self.sources]
        self.value_bytes = values.shape[1]
        self.scale_cols = scales.shape[1] if scales is not None else 0
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self.capacity = 0  # rows the buffer holds per source
        self._buf: torch.Tensor | None = None  # uint8 [capacity * sum(widths)]: source j at capacity * sum(w_<j)
        self._copied: torch.cuda.Event | None = None  # after the last copy that read _buf
        self._lock = threading.Lock()

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``ids`` (int64 [M], CPU, in range) -> (values uint8 [M, >= value_bytes], scales uint8 [M, scale_cols] |
        None) on ``device``; waits only for the buffer's previous copy."""
        m = ids.numel()
        with self._lock:
            if self._copied is not None:
                self._copied.synchronize()  # the previous copy has read the buffer
                self._copied = None
            if m > self.capacity:
                self._grow(m)
            staged, off = [], 0
            for src, w in zip(self.sources, self.widths):
                host = self._buf[off:off + m * w].view(m, w)  # [M, w_j] in the buffer
                torch.index_select(src, 0, ids, out=host)
                staged.append(host.to(self.device, non_blocking=True, copy=True))  # [M, w_j] on device
                off += self.capacity * w
            if self.pinned:
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))
        if len(self.sources) == 1 and self.scale_cols:  # whole packed rows: values | scales side by side
            vb = self.value_bytes
            return staged[0][:, :vb], staged[0][:, vb:vb + self.scale_cols]
        return staged[0], (staged[1] if self.scale_cols else None)

    def _grow(self, rows: int) -> None:
        self.capacity = max(STAGING_MIN_ROWS, 1 << (rows - 1).bit_length())
        self._buf = None  # the old buffer first: both need not be held at once
        self._buf = torch.empty(self.capacity * sum(self.widths), dtype=torch.uint8, pin_memory=self.pinned)


class HostTable(ResidentTable):
    """A table in (pinned) host memory serving rows to ``device`` (default: the CUDA device, else the CPU). "packed":
    ``values`` and ``scales`` are strided views of one buffer uint8 [rows, S] (S = ``packed_row_bytes``); "split": two
    buffers. Loaded from the files (CRC-checked when ``options.verify``) or made by ``build``. ``route``: the HostRoute;
    ``staging``: the RowStaging for missed rows and ``gather_raw``."""

    tier = Tier.HOST

    def __init__(self, manifest: TableManifest, device: torch.device | str | None = None,
                 cache: RowCache | None = None, options: StoreOptions | None = None, *,
                 progress: bool = False, build: StorageBuild | None = None) -> None:
        super().__init__(manifest, default_device(device), cache, options)
        layout = self.options.advanced.host_layout
        self.layout = layout if self.scale_cols else "split"  # one buffer either way without scales
        # one copy per node (shared_memory): a segment of the node's tmpfs that every process opening the table maps
        target = shared_target(manifest, self.options.advanced.shm_dir) if self.options.shared_memory else "pinned"
        self.values, self.scales = self._storage(target, layout, progress, build)
        # values uint8 [rows, >= value_bytes], scales uint8 [rows, scale_cols] | None, both in host memory
        adv = self.options.advanced
        self.route = HostRoute.decide(self.values, self.device, adv.route_bands, adv.uva_max_programs,
                                      adv.uva_tiles_per_program)
        self.staging = RowStaging(self.values, self.scales, self.device)

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

    def _rows_by_id(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``ids`` (CPU) through ``staging``: on ``self.device``, copied without blocking."""
        return self.staging.fetch(ids.cpu())

    def close(self) -> None:
        super().close()
        self.staging = None
