"""Memory preflight: before a table loads, compare the bytes its tier needs with what the machine allows.
``memory_need`` splits a footprint into RAM, pinned RAM and device memory; ``machine_budget`` reads available RAM
(cgroup-capped) and free device memory; ``preflight`` raises ``MemoryPreflightError`` naming sizes and a fit."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engram.store.cache import RowCache
from engram.store.format import TableManifest
from engram.store.load import packed_row_bytes
from engram.store.sizes import fmt_bytes

GiB = 1 << 30
HEADROOM_FRACTION = 0.10  # of RAM left for the process itself, the page cache and the OS
DEVICE_HEADROOM_FRACTION = 0.05  # of free device memory left for activations, allocator slack


class MemoryPreflightError(MemoryError):
    """A table would not fit where it was asked to go; the message says the sizes and what would fit."""


@dataclass
class MemoryNeed:
    """Bytes one opened table takes, by kind of memory."""

    ram: int = 0  # plain host memory (resident scales, caches and buffers on a CPU-only machine)
    pinned: int = 0  # page-locked host memory (also counts against RAM)
    device: int = 0  # device memory on the CUDA device
    parts: dict[str, int] | None = None  # what the bytes are, for the message

    @property
    def host_total(self) -> int:
        return self.ram + self.pinned


@dataclass
class MemoryBudget:
    """Bytes the machine allows now; None = unknown (not checked)."""

    ram: int | None  # available RAM, capped by the cgroup limit
    device: int | None  # free memory on the target CUDA device (None without CUDA)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _read_stat(path: str, key: str) -> int:
    """One ``key value`` line of a cgroup memory.stat file; 0 when absent or unreadable."""
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0


_CGROUP_FILES = (  # (limit, usage, stat, the stat key of the page cache nobody is using) for v2, then v1
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
)


def cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under the cgroup memory limit (v2 or v1; inactive file pages not counted), None when unlimited."""
    for limit_f, usage_f, stat_f, inactive_key in _CGROUP_FILES:
        limit = _read_int(f"{root}/{limit_f}")
        if limit is not None and limit < (1 << 60):
            usage = _read_int(f"{root}/{usage_f}") or 0
            working_set = max(0, usage - _read_stat(f"{root}/{stat_f}", inactive_key))
            return max(0, limit - working_set)
    return None


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, None when unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_budget(device: torch.device | None = None) -> MemoryBudget:
    ram = [v for v in (mem_available(), cgroup_available()) if v is not None]
    dev = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        dev = torch.cuda.mem_get_info(device)[0]
    return MemoryBudget(ram=min(ram) if ram else None, device=dev)


def memory_need(m: TableManifest, tier: str, device: torch.device, cache_rows: int = 0,
                host_layout: str = "packed", chunk_pages: int = 2048) -> MemoryNeed:
    """What opening ``m`` on ``tier`` with rows on ``device`` takes (``host_layout``, ``chunk_pages``: the tier's)."""
    values = m.rows * m.row_stride
    scales = m.rows * m.scale_cols
    cache = RowCache.bytes_for_rows(cache_rows, m.value_bytes, m.scale_cols) if cache_rows else 0
    cuda = device.type == "cuda"
    need = MemoryNeed(parts={})
    if tier == "gpu":
        need.parts = {"values": values, "scales": scales}
        if cuda:
            need.device = values + scales
        else:
            need.ram = values + scales
    elif tier == "host":
        if host_layout == "packed" and m.scale_cols:  # one buffer of rows padded to 16 B (load.py)
            rows_bytes = m.rows * packed_row_bytes(m.value_bytes, m.scale_cols)
            need.parts = {"packed rows": rows_bytes, "cache": cache}
        else:
            rows_bytes = values + scales
            need.parts = {"values": values, "scales": scales, "cache": cache}
        if torch.cuda.is_available():
            need.pinned = rows_bytes
        else:
            need.ram = rows_bytes
        if cuda:
            need.device = cache
        else:
            need.ram += cache
    elif tier == "disk":
        # a lookup in progress holds two chunks of page buffers (one being read while the other decodes)
        buffers = 2 * chunk_pages * max(m.page_size, m.row_stride)
        page_crcs = m.files["page_crc"].bytes if "page_crc" in m.files else 0
        need.parts = {"resident scales": scales, "page checksums": page_crcs, "cache": cache, "I/O buffers": buffers}
        need.ram = scales + page_crcs + buffers
        if cuda:
            need.device = cache
        else:
            need.ram += cache
    else:
        raise ValueError(f"tier={tier!r} is not one of ['gpu', 'host', 'disk']")
    return need


def _shortfalls(need: MemoryNeed, budget: MemoryBudget) -> list[str]:
    """Shortfalls as sentences (empty when it fits)."""
    short = []
    if budget.ram is not None:
        allowed = int(budget.ram * (1 - HEADROOM_FRACTION))
        if need.host_total > allowed:
            kind = "RAM (pinned)" if need.pinned else "RAM"
            short.append(f"needs {fmt_bytes(need.host_total)} of {kind} but {fmt_bytes(allowed)} is usable "
                         f"({fmt_bytes(budget.ram)} available incl. cgroup limit, {HEADROOM_FRACTION:.0%} kept free)")
    if budget.device is not None:
        allowed = int(budget.device * (1 - DEVICE_HEADROOM_FRACTION))
        if need.device > allowed:
            short.append(f"needs {fmt_bytes(need.device)} of device memory but {fmt_bytes(allowed)} is usable "
                         f"({fmt_bytes(budget.device)} free)")
    return short


def preflight(m: TableManifest, tier: str, device: torch.device, cache_rows: int = 0,
              budget: MemoryBudget | None = None, host_layout: str = "packed", chunk_pages: int = 2048,
              mapped_bytes: int = 0) -> MemoryNeed:
    """Raise MemoryPreflightError when ``m`` does not fit on ``tier``; return the need when it does. ``mapped_bytes``:
    host bytes mapped from the node's shared copy that another process made (shared_preflight.py), not counted."""
    budget = budget if budget is not None else machine_budget(device)
    need = memory_need(m, tier, device, cache_rows, host_layout, chunk_pages)
    if mapped_bytes:
        pinned = min(need.pinned, mapped_bytes)
        need.pinned, need.ram = need.pinned - pinned, max(0, need.ram - (mapped_bytes - pinned))
    short = _shortfalls(need, budget)
    if not short:
        return need
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in need.parts.items() if v)
    msg = (f"table {m.path} ({m.rows} rows x {m.row_stride} B) does not fit on tier {tier!r}: "
           + "; ".join(short) + f" [{parts}].")
    return _raise_with_hint(msg, m, tier, device, cache_rows, budget, host_layout, chunk_pages)


def _raise_with_hint(msg: str, m: TableManifest, tier: str, device: torch.device, cache_rows: int,
                     budget: MemoryBudget, host_layout: str, chunk_pages: int) -> MemoryNeed:
    def fits(t: str, rows: int) -> bool:
        return not _shortfalls(memory_need(m, t, device, rows, host_layout, chunk_pages), budget)

    hints = []
    for t in ("gpu", "host", "disk"):  # the asked tier with a smaller cache, or another tier
        rows = 0 if t == "gpu" else cache_rows
        if t != tier and fits(t, rows):
            hints.append(f"tier={t!r}" + (f" with cache_rows={rows}" if rows else ""))
        elif rows and fits(t, 0):
            lo, hi = 0, rows - 1  # the largest cache that fits: bytes grow with rows
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(t, mid) else (lo, mid - 1)
            hints.append(f"tier={t!r} with cache_rows={lo}" if lo else f"tier={t!r} without a cache")
    hint = (" Would fit: " + " or ".join(hints) + ".") if hints else " No tier fits on this machine."
    raise MemoryPreflightError(msg + hint)

