"""A hot-row cache on a GPU uploads its placements through a ring of pinned buffers kept between calls
(RowCache._upload, skipped without CUDA): with the device held back behind a long kernel (the ring's buffers
still queued: uploads then go through fresh pinned copies, never a host wait) and with it keeping up (the ring
reused), every cached row, its mirrored tag and its slot are as the CPU cache has them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.store import cache as cache_mod
from engram.store.cache import RowCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _fetch(ids: torch.Tensor):
    return (ids[:, None] * 7 % 251).to(torch.uint8).expand(-1, 16).contiguous(), None


@pytest.mark.parametrize("lagging", [True, False])
def test_uploads_through_the_ring_cache_what_the_cpu_cache_does(lagging):
    gpu, cpu = RowCache(2048, 16, ways=4, device="cuda"), RowCache(2048, 16, ways=4)
    for c in (gpu, cpu):
        c.reserve_overflow(2048)
    gpu.mirror_tags()
    rng = np.random.default_rng(0)
    calls = 4 * cache_mod.STAGING_RING
    for k in range(calls):
        ids = np.unique(rng.integers(0, 20_000, 200 + 50 * (k % 3)))  # sizes vary: the buffers grow
        if lagging:
            torch.cuda._sleep(2_000_000)  # each upload waits behind this
        got = gpu.slots_np(ids, _fetch)
        if not lagging:
            torch.cuda.synchronize()
        assert np.array_equal(got, cpu.slots_np(ids, _fetch))
    torch.cuda.synchronize()
    assert torch.equal(gpu.values.cpu(), cpu.values) and torch.equal(gpu.tags, cpu.tags)
    assert torch.equal(gpu.dev_tags.cpu(), cpu.tags)
    assert all(buf is not None for buf, _ in gpu._staging)  # the ring's buffers were used
