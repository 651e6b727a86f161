"""The host tier's missed rows (hot-row cache misses, ``gather_raw``) go through one reusable staging buffer
(``RowStaging``, pinned under CUDA) grown on demand; the rows stay bitwise those of the gpu tier, results
never alias the buffer, and the public API and stats are unchanged. CPU (the same code path as CUDA, with a
plain buffer and a CPU copy); tests/gpu/test_host_miss_staging_gpu.py runs it on CUDA."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import open_table, write_table
from engram.store.host import STAGING_MIN_ROWS, RowStaging

ROWS = 3000


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("staging")
    x = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(0))
    write_table(root / "mx", *quantize_mxfp8(x))
    write_table(root / "bf16", x[:, :48].to(torch.bfloat16))  # 96-B rows at a 128-B stride, no scales
    return root


@pytest.mark.parametrize("name,layout", [("mx", "packed"), ("mx", "split"), ("bf16", "packed")])
def test_cached_lookups_equal_the_gpu_tier_as_staging_grows(tables, name, layout):
    ref = open_table(tables / name, "gpu", device="cpu")
    t = open_table(tables / name, "host", device="cpu", cache_rows=128, host_layout=layout)
    assert isinstance(t.staging, RowStaging) and t.staging.capacity == 0
    g = torch.Generator().manual_seed(1)
    seen = []
    for n in (5, 900, 2500, 40, 2500):  # 2500 distinct ids (most of them misses) outgrow the first buffer
        ids = torch.randperm(ROWS, generator=g)[:n].repeat(2)  # each id twice
        assert torch.equal(_bits(t.gather(ids)), _bits(ref.gather(ids)))
        assert torch.equal(t.gather_raw(ids), ref.gather_raw(ids))
        assert torch.equal(_bits(t.submit(ids).wait()), _bits(ref.gather(ids)))
        seen.append((t.staging.capacity, t.staging._buf.data_ptr()))
    assert seen[0][0] == STAGING_MIN_ROWS and seen[-1][0] == 4096  # the next power of two of the misses
    assert seen[-1] == seen[-2]  # grown once, then reused
    s = t.stats()
    assert s["misses"] > 0 and s["hits"] > 0 and s["read_ops"] > 0


def test_fetch_results_never_alias_the_buffer(tables):
    t = open_table(tables / "mx", "host", device="cpu", host_layout="packed")
    a_ids, b_ids = torch.arange(0, 900, 2), torch.arange(1, 900, 2)
    a_vals, a_scales = t.staging.fetch(a_ids)
    want = (a_vals.clone(), a_scales.clone())
    b_vals, b_scales = t.staging.fetch(b_ids)  # rewrites the buffer a was gathered into
    assert torch.equal(a_vals, want[0]) and torch.equal(a_scales, want[1])
    assert (torch.equal(a_vals, t.values.index_select(0, a_ids))
            and torch.equal(b_scales, t.scales.index_select(0, b_ids)))
    buf = t.staging._buf
    for x in (a_vals, a_scales, b_vals, b_scales):
        assert x.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()


def test_bytes_read_count_the_fetched_rows(tables):
    t = open_table(tables / "mx", "host", device="cpu", cache_rows=64)
    ids = torch.tensor([3, 3, 7, 2999])
    t.gather(ids)
    t.gather(ids)  # all hits now
    s = t.stats()
    assert (s["misses"], s["hits"], s["read_ops"]) == (3, 3, 1)
    assert s["bytes_read"] == 3 * (t.manifest.row_stride + t.scale_cols)


def test_concurrent_lookups_share_the_staging_safely(tables):
    """Uncached ``gather_raw`` and cached ``gather`` from several threads at once: each gets its own rows."""
    ref = open_table(tables / "mx", "gpu", device="cpu")
    raw = open_table(tables / "mx", "host", device="cpu")
    cached = open_table(tables / "mx", "host", device="cpu", cache_rows=256)
    batches = [torch.randint(0, ROWS, (700,), generator=torch.Generator().manual_seed(i)) for i in range(16)]
    with cf.ThreadPoolExecutor(4) as pool:
        got_raw = list(pool.map(raw.gather_raw, batches))
        got_rows = list(pool.map(cached.gather, batches))
    for ids, r, rows in zip(batches, got_raw, got_rows):
        assert torch.equal(r, ref.gather_raw(ids))
        assert torch.equal(_bits(rows), _bits(ref.gather(ids)))


def test_close_drops_the_staging(tables):
    t = open_table(tables / "mx", "host", device="cpu", cache_rows=64)
    t.gather(torch.arange(10))
    t.close()
    assert t.staging is None
    with pytest.raises(RuntimeError, match="is closed"):
        t.gather(torch.arange(3))
