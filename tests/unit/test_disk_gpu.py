"""Disk tier returning rows on CUDA: bitwise equal to the gpu tier, with and without a device-side cache."""
from __future__ import annotations

import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import open_table
from engram.store.writer import write_table

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with make device-test)")]


@pytest.mark.parametrize("cache_rows", [0, 128])
def test_disk_rows_on_cuda_equal_gpu_tier(tmp_path, cache_rows):
    g = torch.Generator().manual_seed(0)
    vals, scales = quantize_mxfp8(torch.randn(5000, 256, generator=g))
    write_table(tmp_path / "t", vals, scales)
    gpu = open_table(tmp_path / "t", tier="gpu", device="cuda")
    disk = open_table(tmp_path / "t", tier="disk", device="cuda", cache_rows=cache_rows, queue_depth=16)
    batches = [torch.randint(0, 5000, (n,), generator=g) for n in (0, 1, 48, 3000)] + [torch.arange(5000)]
    for ids in batches * 2:
        for dt in (torch.bfloat16, torch.float32):
            a, b = gpu.gather(ids.cuda(), dtype=dt), disk.gather(ids, dtype=dt)
            assert b.device.type == "cuda" and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(gpu.gather_raw(ids.cuda()), disk.gather_raw(ids))
    h = disk.submit(batches[3])
    assert torch.equal(h.wait().view(torch.uint8), gpu.gather(batches[3].cuda()).view(torch.uint8))
    assert (disk.stats()["hits"] > 0) == bool(cache_rows)
    disk.close()
    gpu.close()


def test_a_slab_is_not_reused_while_its_decode_is_queued(tmp_path):
    """One-read lookups decode from a pinned slab over UVA after the host has moved on: a lookup whose
    decode waits behind a delayed stream keeps its slab until the decode ran, so the next lookup reads
    into another one (reusing it would overwrite the pages under the queued kernel: wrong rows)."""
    g = torch.Generator().manual_seed(2)
    vals, scales = quantize_mxfp8(torch.randn(4000, 256, generator=g))
    write_table(tmp_path / "t", vals, scales)
    gpu = open_table(tmp_path / "t", tier="gpu", device="cuda")
    disk = open_table(tmp_path / "t", tier="disk", device="cuda", queue_depth=8)
    a_ids, b_ids = torch.randint(0, 4000, (24,), generator=g), torch.randint(0, 4000, (24,), generator=g)
    disk.gather(b_ids)  # one idle slab
    torch.cuda.synchronize()
    slow = torch.cuda.Stream()
    with torch.cuda.stream(slow):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the decode below is queued behind it
        a = disk.gather(a_ids)
    b = disk.gather(b_ids)  # the idle slab is a's: still read by a's queued decode, so b takes a new one
    torch.cuda.synchronize()
    assert len(disk._slabs._idle) == 2
    assert torch.equal(a.view(torch.uint8), gpu.gather(a_ids.cuda()).view(torch.uint8))
    assert torch.equal(b.view(torch.uint8), gpu.gather(b_ids.cuda()).view(torch.uint8))
    disk.close()
    gpu.close()


def test_a_pinned_slab_decodes_on_the_gpu_reading_its_slots_over_uva(tmp_path):
    """decode_slab on CUDA: the UVA gather reads the pinned slab and its pinned slots (no copy to the device),
    bitwise the gpu tier's rows; in a captured graph too, replayed after the slab was read again."""
    g = torch.Generator().manual_seed(3)
    vals, scales = quantize_mxfp8(torch.randn(4000, 256, generator=g))
    write_table(tmp_path / "t", vals, scales)
    gpu = open_table(tmp_path / "t", tier="gpu", device="cuda")
    disk = open_table(tmp_path / "t", tier="disk", device="cuda", queue_depth=8)
    slab = disk.new_slab(48)
    assert slab.pinned and slab.slots.is_pinned()
    out = torch.empty(48, 256, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 4000, (48,), generator=g)
    disk.read_slab(ids, slab)
    disk.decode_slab(slab, 48, out)
    assert torch.equal(out.view(torch.uint8), gpu.gather(ids.cuda()).view(torch.uint8))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            disk.decode_slab(slab, 48, out)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        ids = torch.randint(0, 4000, (48,), generator=g)
        torch.cuda.synchronize()  # the last replay has read the slab
        disk.read_slab(ids, slab)
        graph.replay()
        assert torch.equal(out.view(torch.uint8), gpu.gather(ids.cuda()).view(torch.uint8))
    disk.close()
    gpu.close()
