"""The Triton probe of a hot-row cache's mirrored tags (store/kernels/cache_probe.py) on a GPU (skipped
elsewhere): bitwise the torch reference's outputs; a resolve with a missing row waits for the pinned flag, then
takes the host's plan as it was when the flag was set; a failed lookup or a wait that gives up reports FAILED;
and it runs inside a CUDA graph."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engram.store.cache import RowCache
from engram.store.kernels import cache_probe, triton_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA + Triton")]


def _fetch(ids: torch.Tensor):
    return (ids[:, None] % 251).to(torch.uint8).expand(-1, 16).contiguous(), None


def _cache(rows: int = 4096, ways: int = 8) -> tuple[RowCache, torch.Tensor]:
    cache = RowCache(rows, 16, ways=ways, device="cuda")
    cache.reserve_overflow(4096)
    tags = cache.mirror_tags()
    rng = np.random.default_rng(0)
    for _ in range(20):
        cache.slots_np(np.unique(rng.integers(0, 50_000, 300)), _fetch)
    torch.cuda.synchronize()
    return cache, tags


def _inputs(n: int):
    """(the host plan [3, n] pinned, the flag [1] pinned, the plan id [1], out [3, n], status [1])."""
    host = torch.stack([torch.arange(n), torch.arange(n) + 1000, torch.full((n,), -1)]).pin_memory()
    return (host, torch.full((1,), -1, dtype=torch.int64).pin_memory(), torch.tensor([7], device="cuda"),
            torch.full((3, n), -5, dtype=torch.int64, device="cuda"),
            torch.full((1,), -1, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("n", [1, 33, 1024, 3000])
def test_kernel_matches_the_reference(n):
    cache, tags = _cache()
    cached = cache.tags[cache.tags >= 0]
    rng = np.random.default_rng(n)
    ids = cached[torch.from_numpy(rng.integers(0, len(cached), n))].cuda()
    ids[::7] = -1  # padding
    for missing in (False, True):
        if missing:
            ids[n // 2] = 10**9  # never cached
        host, flag, plan, out, status = _inputs(n)
        cache_probe.signal(flag, 7)
        want_out, want_status = out.clone(), status.clone()
        cache_probe.resolve_slots_reference(ids, tags, host.cuda(), flag, plan, want_out, want_status)
        cache_probe.resolve_slots(ids, tags, host, flag, plan, out, status)
        assert torch.equal(out, want_out) and torch.equal(status, want_status)
        assert int(status) == (cache_probe.WAITED if missing else cache_probe.FOUND)


def test_a_missing_row_waits_for_the_flag_and_takes_the_hosts_plan_then():
    cache, tags = _cache()
    n = 64
    ids = torch.full((n,), 10**9, dtype=torch.int64, device="cuda")
    host, flag, plan, out, status = _inputs(n)
    host.zero_()
    waiter = torch.cuda.Stream()
    with torch.cuda.stream(waiter):
        cache_probe.resolve_slots(ids, tags, host, flag, plan, out, status)
    time.sleep(0.05)
    assert not waiter.query()  # still waiting
    host.copy_(torch.stack([torch.arange(100, 100 + n), torch.arange(n), torch.arange(n)]))  # the plan, then
    cache_probe.signal(flag, 6)  # an older step's flag: not this one
    time.sleep(0.01)
    assert not waiter.query()
    cache_probe.signal(flag, 7)
    waiter.synchronize()
    assert int(status) == cache_probe.WAITED and torch.equal(out.cpu(), host)


def test_a_failed_lookup_or_a_wait_that_gives_up_reports_failed():
    cache, tags = _cache()
    ids = torch.full((8,), 10**9, dtype=torch.int64, device="cuda")
    host, flag, plan, out, status = _inputs(8)
    waiter = torch.cuda.Stream()
    with torch.cuda.stream(waiter):
        cache_probe.resolve_slots(ids, tags, host, flag, plan, out, status)
    cache_probe.signal(flag, 7, ok=False)
    waiter.synchronize()
    assert int(status) == cache_probe.FAILED
    host, flag, plan, out, status = _inputs(8)
    cache_probe.resolve_slots(ids, tags, host, flag, plan, out, status, spin_limit=1000)  # nobody signals
    torch.cuda.synchronize()
    assert int(status) == cache_probe.FAILED


def test_resolve_inside_a_cuda_graph():
    cache, tags = _cache()
    n = 48
    cached = cache.tags[cache.tags >= 0][:n].cuda()
    ids = cached.clone()
    host, flag, plan, out, status = _inputs(n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cache_probe.resolve_slots(ids, tags, host, flag, plan, out, status)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache_probe.resolve_slots(ids, tags, host, flag, plan, out, status)
    for step, missing in ((8, False), (9, True), (10, False)):
        plan.fill_(step)
        ids.copy_(cached)
        if missing:
            ids[3] = 10**9
            host[0].copy_(torch.arange(step, step + n))
            cache_probe.signal(flag, step)
        graph.replay()
        torch.cuda.synchronize()
        want = (torch.arange(step, step + n) if missing else cache.lookup(cached.cpu())).tolist()
        assert out[cache_probe.SLOTS].tolist() == want
        assert int(status) == (cache_probe.WAITED if missing else cache_probe.FOUND)


def test_admit_probed_over_uva_caches_the_bytes_the_host_copies_would(tmp_path):
    """``DiskTable.admit_probed`` on CUDA copies the rows a probed lookup read straight from the slab's pinned
    pages over UVA (its slab then waits for that copy: a new ``slab.done``); with the torch backend the host
    copies them out first (the reference). Five steps of probed lookups over a cache that evicts: both leave
    the cache bitwise the same (tags, value bytes, MXFP8 scales), and every cached row is the table's row."""
    from engram.store import kernels
    from engram.store.disk import open_disk_table
    from engram.store.writer import write_table
    from tests.unit.test_disk import make_rows

    d = tmp_path / "mx"
    vals, scales, _ = make_rows(3001, 256, "mxfp8")
    write_table(d, vals, scales)
    states = []
    for backend in ("torch", "auto"):
        old = kernels.set_backend(backend)
        try:
            with open_disk_table(d, device="cuda", io="buffered",
                                 cache=RowCache(64, 256, 8, ways=4, device="cuda")) as t:
                slab = t.new_slab(64)
                rng = np.random.default_rng(0)
                for step in range(1, 6):
                    t.read_slab(torch.from_numpy(rng.integers(0, 3001, 40)), slab, plan=step)
                    before = slab.done
                    assert t.admit_probed(slab) > 0
                    assert (slab.done is not before) == (backend == "auto")
                torch.cuda.synchronize()
                values, scale_bytes = t.cache.storage()
                states.append((t.cache.tags.clone(), values[:64].cpu(), scale_bytes[:64].cpu()))
        finally:
            kernels.set_backend(old)
    for want, got in zip(*states):
        assert torch.equal(want, got)
    tags, values, scale_bytes = states[1]
    held = torch.nonzero(tags.reshape(-1) >= 0).reshape(-1)
    assert len(held) > 30
    rows = tags.reshape(-1)[held]
    assert torch.equal(values[held], vals[rows].view(torch.uint8))
    assert torch.equal(scale_bytes[held], scales[rows].view(torch.uint8))
