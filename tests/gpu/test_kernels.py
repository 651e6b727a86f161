"""GPU-only behaviour of the gather kernels and pinning: dispatch choices, sort plans, pinned lifetimes.

Bitwise parity over dtypes and sizes lives in tests/parity/test_gather_parity.py; this file checks the
machinery around it. Skipped without CUDA (run on the device machine with ``make device-test``).
"""
import gc

import numpy as np
import pytest
import torch

from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import kernels
from engram.store.pinning import pin_tensor, pinned_stats

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make device-test)")]


@pytest.mark.parametrize("method", ["alloc", "register"])
def test_pin_tensor_copies_pins_and_frees(method):
    gc.collect()  # regions of earlier tests' tables that are already garbage go now, not during the counts
    before = pinned_stats()
    t = torch.randn(3000, 77, dtype=torch.float64)  # 1.8 MB, not a multiple of any page
    p = pin_tensor(t, method=method, chunk_bytes=1 << 20, threads=3)  # copied in two chunks by two threads
    assert p.is_pinned() and p.dtype == t.dtype and p.shape == t.shape
    assert torch.equal(p.view(torch.uint8), t.view(torch.uint8))
    if method == "register":
        assert p.data_ptr() % (2 << 20) == 0, "registered region should start on a huge-page boundary"
    assert pinned_stats()["pinned_bytes"] - before["pinned_bytes"] == t.numel() * 8
    assert pin_tensor(p) is p  # already pinned
    gpu = p.cuda(non_blocking=True)  # one async copy across the whole region (both chunks)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), t)
    row = p[5:6]  # a view keeps the registration alive
    del p, gpu
    gc.collect()
    assert pinned_stats()["regions"] == before["regions"] + 1
    assert torch.equal(row, t[5:6])
    del row
    gc.collect()
    assert pinned_stats() == before


def test_pin_tensor_leaves_device_tensors_alone():
    t = torch.ones(4, device="cuda")
    assert pin_tensor(t) is t


def test_dispatch_picks_fast_paths(backend):
    vals = torch.randint(0, 256, (100, 256), dtype=torch.uint8)
    backend("auto")
    assert kernels.fast_path(vals) is None  # pageable host memory: reference
    assert kernels.fast_path(vals.cuda()) == "hbm"
    assert kernels.fast_path(pin_tensor(vals)) == "uva"
    assert kernels.fast_path(vals.cuda(), out=torch.empty(1, 256)) is None  # CPU out: reference
    backend("torch")
    assert kernels.fast_path(vals.cuda()) is None
    backend("triton")
    with pytest.raises(RuntimeError, match="pinned"):
        kernels.fast_path(vals)


def test_pinned_table_lands_on_gpu_and_matches_cpu_reference(backend):
    x = torch.randn(500, 256) * 3
    q, s = quantize_mxfp8(x)
    q8 = q.view(torch.uint8)
    ids = torch.tensor([499, 0, 7, 7, 250])
    backend("torch")
    want = kernels.gather_rows(q8, s, ids, "mxfp8", 256)  # CPU reference, CPU result
    backend("auto")
    got = kernels.gather_rows(pin_tensor(q8), pin_tensor(s), ids, "mxfp8", 256)  # CPU ids are moved over
    assert got.is_cuda and not want.is_cuda
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_hbm_table_with_cpu_ids_and_cpu_scales(backend):
    backend("auto")
    x = torch.randn(300, 64)
    q, s = quantize_mxfp8(x)
    ids = torch.randint(0, 300, (123,))
    got = kernels.gather_rows(q.view(torch.uint8).cuda(), s, ids, "mxfp8", 64, dtype=torch.float32)
    want = dequantize_mxfp8(q, s, dtype=torch.float32)[ids]
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("rows", [1000, 2**31 + 5])
def test_sort_plan_matches_numpy(rows):
    from engram.store.kernels.uva import sort_plan
    g = torch.Generator().manual_seed(rows % 1000)
    ids = torch.randint(0, 50, (5000,), generator=g) * (rows // 50)  # many duplicates, large values
    plan = sort_plan(ids.cuda(), rows)
    assert plan.sorted_ids.dtype == (torch.int32 if rows < 2**31 else torch.int64)
    s, perm = plan.sorted_ids.cpu().long(), plan.perm.cpu()
    assert torch.equal(s, ids.sort().values) and torch.equal(ids[perm], s)
    lead = np.r_[True, s.numpy()[1:] != s.numpy()[:-1]]
    starts = np.maximum.accumulate(np.where(lead, np.arange(len(s)), 0))
    assert np.array_equal(plan.runs.cpu().numpy(), starts)
