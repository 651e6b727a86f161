"""CUDA paths of the store: gpu tier in device memory, host tier pinned with a device cache, same bits as CPU."""
from __future__ import annotations

import pytest
import torch

from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import open_table, write_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda") / "t"
    x = torch.randn(5000, 256, generator=torch.Generator().manual_seed(0))
    v, s = quantize_mxfp8(x)
    write_table(d, v, s, chunk_bytes=1 << 16)
    return d, dequantize_mxfp8(v, s, torch.bfloat16)


@pytest.mark.parametrize("tier,kw", [("gpu", {}), ("host", {}), ("host", {"cache_rows": 512}),
                                     ("disk", {"cache_rows": 512, "io": "buffered"})])
def test_cuda_tiers_match_reference(table, tier, kw):
    path, ref = table
    with open_table(path, tier, **kw) as t:
        assert t.device.type == "cuda"
        if tier == "gpu":
            assert t.values.is_cuda
        if tier == "host":
            assert t.values.is_pinned()
        if t.cache is not None:
            assert t.cache.values.is_cuda
        for seed in range(3):
            ids = torch.randint(0, 5000, (1000,), generator=torch.Generator().manual_seed(seed))
            for dev_ids in (ids, ids.cuda()):
                got = t.gather(dev_ids)
                assert got.is_cuda
                assert torch.equal(got.cpu().view(torch.uint8), ref[ids].view(torch.uint8))
        assert t.gather(torch.zeros(0, dtype=torch.int64, device="cuda")).shape == (0, 256)
        with pytest.raises(IndexError, match="row id 5000"):  # CPU ids are always checked
            t.gather(torch.tensor([5000]))
        st = t.stats()
        assert st["rows"] == 6000 and (st["unique_rows"] > 0) == (tier == "disk" or "cache_rows" in kw)
    if tier != "disk":  # device ids are checked only on request (a host sync per lookup)
        with open_table(table[0], tier=tier, device="cuda", check_device_ids=True, **kw) as t:
            with pytest.raises(IndexError, match="row id 5000"):
                t.gather(torch.tensor([5000], device="cuda"))


@pytest.mark.parametrize("programs,tiles_per_program", [(1, 1), (5, 1), (64, 1), (0, 1), (0, 24), (0, 3)])
def test_a_capped_uva_grid_gathers_the_same_rows(table, programs, tiles_per_program):
    """uva_max_programs / uva_tiles_per_program: fewer programs striding over the tiles (what a gather
    beside other kernels uses; (0, 24) is the default, (0, 1) one program per tile)."""
    path, ref = table
    with open_table(path, "host", uva_max_programs=programs, uva_tiles_per_program=tiles_per_program) as t:
        assert (t.route.max_programs, t.route.tiles_per_program) == (programs, tiles_per_program)
        for n in (1, 1000, 4096):
            ids = torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(n))
            for dev_ids in (ids, ids.cuda()):
                got = t.gather(dev_ids)
                assert torch.equal(got.cpu().view(torch.uint8), ref[ids].view(torch.uint8))


def test_cuda_out_buffer(table):
    path, ref = table
    with open_table(path, "host") as t:
        out = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
        assert t.gather(torch.tensor([1, 2, 3]), out=out) is out
        assert torch.equal(out.cpu().view(torch.uint8), ref[[1, 2, 3]].view(torch.uint8))
