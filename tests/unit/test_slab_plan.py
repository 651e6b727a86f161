"""slab_plan.plan / check (engram/store/slab_plan.py): the C versions (csrc/slab_plan.c) give the numpy
reference's arrays exactly, on ids with repeats, shared pages and every rows-per-page of the format."""
from __future__ import annotations

import numpy as np
import pytest

from engram.store import reader as rd
from engram.store import slab_plan
from engram.store.page_slabs import SlabPool

needs_c = pytest.mark.skipif(not rd.c_available(), reason="the C reader is not built")


def run(backend: str, fn, *args):
    old = rd.set_backend(backend)
    try:
        return fn(*args)
    finally:
        rd.set_backend(old)


def planned(backend: str, ids: np.ndarray, rpp: int, page: int = 4096):
    slab = SlabPool(page, page // rpp, 8, pinned=False).acquire(max(1, len(ids)), max(1, len(ids)))
    p, u = run(backend, slab_plan.plan, ids, rpp, page, slab)
    return (p, u), slab, (slab.offsets[:p].copy(), slab.uniq[:u].copy(), slab.uslots[:u].copy(),
                          slab.slots.numpy()[:len(ids)].copy())


def id_sets(rows: int):
    g = np.random.default_rng(0)
    return [np.array([0]), np.array([rows - 1, 0, rows - 1]), np.full(50, 17), np.arange(15, 18),
            np.arange(rows - 1, -1, -97), g.integers(0, rows, 999), g.integers(0, 40, 300) * 16,
            g.integers(0, 64, 24), np.empty(0, dtype=np.int64)]


@needs_c
@pytest.mark.parametrize("rpp", [1, 2, 16, 64])
def test_the_c_plan_equals_the_numpy_plan(rpp):
    for ids in id_sets(5000):
        ids = ids.astype(np.int64)
        (pc, uc), _, c = planned("c", ids, rpp)
        (pn, un), _, ref = planned("python", ids, rpp)
        assert (pc, uc) == (pn, un) == (len(np.unique(ids // rpp)), len(np.unique(ids)))
        for a, b in zip(c, ref):
            assert np.array_equal(a, b)
        if len(ids):  # every id's slot holds that id: page of the slot's page index, slot within the page
            offs, uniq, uslots, slots = ref
            assert np.array_equal(offs[slots // rpp] // 4096 * rpp + slots % rpp, ids)


@pytest.mark.parametrize("backend", ["python", pytest.param("c", marks=needs_c)])
def test_check_finds_bad_pages_and_places_scales(backend):
    rows, rpp = 4000, 16
    g = np.random.default_rng(1)
    expected = g.integers(0, 2**32, rows // rpp + 1, dtype=np.uint32)
    scales = g.integers(0, 256, (rows, 8), dtype=np.uint8)
    ids = g.integers(0, rows, 200).astype(np.int64)
    (p, u), slab, (offs, uniq, uslots, slots) = planned(backend, ids, rpp)
    slab.crcs[:p] = expected[offs // 4096]  # the pages read back intact
    assert run(backend, slab_plan.check, slab, p, u, 4096, expected, scales) == (0, -1)
    placed = slab.scales.numpy()
    assert np.array_equal(placed[slots], scales[ids])  # each id's scales at its buffer row
    slab.crcs[3] ^= 1
    slab.crcs[7] ^= 4
    assert run(backend, slab_plan.check, slab, p, u, 4096, expected, scales) == (2, 3)
    slab.crcs[3] ^= 1
    slab.crcs[7] ^= 4
    assert run(backend, slab_plan.check, slab, p, u, 4096, expected, None) == (0, -1)  # no scales (bf16 rows)


@needs_c
def test_the_c_functions_refuse_buffers_too_small():
    from engram.store import _pread_pool as c

    ids = np.arange(10, dtype=np.int64)
    small = np.empty(4, dtype=np.int64)
    big = np.empty(10, dtype=np.int64)
    with pytest.raises(ValueError, match="offsets holds 32 bytes, 80 needed"):
        c.slab_plan(ids, 16, 4096, small, big, big, big)
    with pytest.raises(ValueError, match="past the 2 pages"):
        c.slab_check(1, np.array([8192], dtype=np.int64), 4096, np.zeros(1, np.uint32), np.zeros(2, np.uint32),
                     0, big, big, None, 0, None)
