"""The host tier's cached lookups on CUDA: missed rows go through the table's pinned staging buffer and a
non-blocking copy (no synchronizing copy), and every lookup returns bitwise the gpu tier's rows.
Skipped without CUDA (``make device-test``)."""
import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import open_table, write_table

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make device-test)")]

ROWS, DIM = 5003, 256


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    v, s = quantize_mxfp8(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    d = tmp_path_factory.mktemp("staging") / "t"
    write_table(d, v, s)
    return d


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout", ["packed", "split"])
def test_cached_host_rows_equal_the_gpu_tier(table, layout):
    ref = open_table(table, "gpu", device="cuda")
    t = open_table(table, "host", device="cuda", cache_rows=256, host_layout=layout)
    g = torch.Generator().manual_seed(1)
    for n in (10, 300, 3000, 40):  # misses grow the staging buffer past its first size, then reuse it
        ids = torch.randint(0, ROWS, (n,), generator=g)
        assert torch.equal(_bits(t.gather(ids)), _bits(ref.gather(ids)))
        assert torch.equal(t.gather_raw(ids), ref.gather_raw(ids))
    assert t.staging.capacity >= 3000 and t.staging._buf.is_pinned()
    assert t.stats()["misses"] > 0 and t.stats()["hits"] > 0


def test_staged_fetch_never_copies_synchronously(table):
    """The missed rows' copy is non-blocking: under sync debug mode "error" torch raises on a synchronizing
    copy (the pageable ``.to(device)`` this path replaced); a later fetch keeps earlier results intact."""
    t = open_table(table, "host", device="cuda", cache_rows=256)
    a_ids, b_ids = torch.arange(0, 2000, 3), torch.arange(1, 2000, 3)
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a_vals, a_scales = t.staging.fetch(a_ids)
        b_vals, _ = t.staging.fetch(b_ids)  # reuses the buffer a's copy read
    finally:
        torch.cuda.set_sync_debug_mode(old)
    torch.cuda.synchronize()
    assert a_vals.is_cuda and a_scales.is_cuda
    assert torch.equal(a_vals.cpu(), t.values.index_select(0, a_ids))
    assert torch.equal(a_scales.cpu(), t.scales.index_select(0, a_ids))
    assert torch.equal(b_vals.cpu(), t.values.index_select(0, b_ids))
