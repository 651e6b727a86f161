"""The shared copies a table takes (``shared_parts``: which segments of shared_host.py, how many bytes each, from the
table's manifest, never from the machine's memory) and the check made before anything is filled (``check_shared``):
the segments still to be created must fit in the tmpfs directory; the bytes of those that exist are mapped, not
allocated, so the memory preflight does not count them again."""
from __future__ import annotations

from typing import Iterable

from engram.store.base import Tier
from engram.store.format import TableManifest
from engram.store.load import packed_row_bytes
from engram.store.options import StoreOptions
from engram.store.shared_host import check_capacity, segment_path, shared_target


def shared_parts(m: TableManifest, tier: Tier | str, host_layout: str = "packed") -> list[tuple[str, int]]:
    """(part, data bytes) of each segment opening ``m`` on ``tier`` maps: the host tier's rows (one "packed" buffer,
    or "values" and "scales"), the disk tier's resident "scales" and "page_crc"; none for the gpu tier."""
    tier = Tier.parse(tier)
    files = m.files
    if tier is Tier.HOST:
        if host_layout == "packed" and m.scale_cols:
            return [("packed", m.rows * packed_row_bytes(m.value_bytes, m.scale_cols))]
        values = files["values"].bytes if "values" in files else m.rows * m.row_stride  # built in memory: no padding
        return [("values", values)] + ([("scales", m.rows * m.scale_cols)] if m.scale_cols else [])
    if tier is Tier.DISK:
        return [(k, files[k].bytes) for k in ("scales", "page_crc") if k in files]
    return []


def check_shared(manifests: Iterable[TableManifest], tier: Tier | str, options: StoreOptions) -> int:
    """SharedMemoryError when the segments of ``manifests`` on ``tier`` that do not exist yet do not fit in
    ``options.advanced.shm_dir``; else the bytes of those that exist (mapped from another process's copy)."""
    shm_dir, layout = options.advanced.shm_dir, options.advanced.host_layout
    needs, existing = [], 0
    for m in manifests:
        target = shared_target(m, shm_dir)
        for part, nbytes in shared_parts(m, tier, layout):
            needs.append((target, part, nbytes))
            if segment_path(target, part).exists():
                existing += nbytes
    check_capacity(needs)
    return existing
