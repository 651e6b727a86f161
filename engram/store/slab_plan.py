"""The read plan of one disk-tier lookup into a slab, and its check: C (csrc/slab_plan.c, with the "c" reader backend)
or numpy, the same arrays either way. ``plan`` fills the slab's ``offsets`` (distinct pages), ``uniq`` / ``uslots``
(distinct ids, their buffer rows) and ``slots`` (every id's row) -> (P, U); ``check`` compares the read pages' CRC32Cs
and places each distinct id's scales -> (bad pages, first bad index or -1)."""
from __future__ import annotations

import numpy as np

from engram.store import reader
from engram.store.page_slabs import PageSlab


def plan(ids: np.ndarray, rows_per_page: int, page_size: int, slab: PageSlab) -> tuple[int, int]:
    slots = slab.slots.numpy()
    if reader.active_backend() == "c":
        return reader._pread_pool.slab_plan(ids, rows_per_page, page_size, slab.offsets, slots, slab.uniq,
                                            slab.uslots)
    n = len(ids)
    uniq, inverse = np.unique(ids, return_inverse=True)  # [U] ascending, [N]
    page_of = uniq // rows_per_page  # [U], ascending
    first = np.empty(len(uniq), dtype=bool)  # the first distinct id of each page
    first[:1] = True
    np.not_equal(page_of[1:], page_of[:-1], out=first[1:])
    pages = page_of[first]  # [P]
    uslots = (np.cumsum(first) - 1) * rows_per_page + uniq % rows_per_page  # [U]
    p, u = len(pages), len(uniq)
    slab.offsets[:p] = pages * page_size
    slab.uniq[:u], slab.uslots[:u] = uniq, uslots
    np.take(uslots, inverse.reshape(-1), out=slots[:n])
    return p, u


def check(slab: PageSlab, n_pages: int, n_unique: int, page_size: int, expected: np.ndarray,
          scales: np.ndarray | None) -> tuple[int, int]:
    placed = slab.scales.numpy() if scales is not None else None
    if reader.active_backend() == "c":
        return reader._pread_pool.slab_check(n_pages, slab.offsets, page_size, slab.crcs, expected, n_unique,
                                             slab.uniq, slab.uslots, scales, scales.shape[1] if scales is not None
                                             else 0, placed)
    bad = np.flatnonzero(slab.crcs[:n_pages] != expected[slab.offsets[:n_pages] // page_size])
    if len(bad):
        return len(bad), int(bad[0])
    if scales is not None:
        placed[slab.uslots[:n_unique]] = scales[slab.uniq[:n_unique]]
    return 0, -1
