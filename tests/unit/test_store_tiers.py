"""Every tier (and cache setting) returns bitwise the dequantized reference rows, for any ids."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import Tier, open_table, write_table
from engram.store.base import STAT_KEYS

ROWS = 1000
# (tier, open_table kwargs); ids avoid the bare word "gpu" (tests/conftest.py skips tests keyed "gpu").
SETUPS = [("gpu", {}), ("host", {}), ("host", {"cache_rows": 64}), ("host", {"cache_rows": 64, "cache_policy": "lfu"}),
          ("host", {"cache_rows": 5000}), ("disk", {"io": "buffered"}), ("disk", {"cache_rows": 64, "io": "buffered"})]
SETUP_IDS = ["gpu-tier", "host", "host-lru64", "host-lfu64", "host-cache-all", "disk", "disk-lru64"]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """One table per row dtype, with the float reference it must reproduce."""
    root = tmp_path_factory.mktemp("tables")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 64, generator=g) * torch.logspace(-3, 3, ROWS).unsqueeze(1)
    x[7] = 0.0  # an all-zero row (scale byte 127)
    v, s = quantize_mxfp8(x)
    s[11, 0] = 0  # scale byte 0 (seen in checkpoints) must decode to exactly 0.0
    out = {"mxfp8": (root / "mx", dequantize_mxfp8(v, s, torch.float32))}
    write_table(root / "mx", v, s, chunk_bytes=8192)
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        y = x[:, :48].to(dt)  # 48 values: padded strides for bf16/fp16 (96 -> 128 B) and fp32 (192 -> 256 B)
        write_table(root / name, y)
        out[name] = (root / name, y.to(torch.float32))
    return out


def _id_sets():
    g = torch.Generator().manual_seed(1)
    return {
        "random": torch.randint(0, ROWS, (300,), generator=g),
        "duplicates": torch.tensor([5, 5, 5, 0, 5, ROWS - 1, 0]),
        "first-last": torch.tensor([0, ROWS - 1]),
        "single": torch.tensor([11]),
        "empty": torch.zeros(0, dtype=torch.int64),
        "int32": torch.tensor([3, 2, 1], dtype=torch.int32),
    }


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
@pytest.mark.parametrize("row_dtype", ["mxfp8", "bf16", "fp16", "fp32"])
def test_rows_bitwise_equal_reference(tables, setup, row_dtype):
    tier, kw = setup
    path, ref32 = tables[row_dtype]
    with open_table(path, tier, device="cpu", **kw) as t:
        assert t.tier is Tier(tier)
        for _ in range(2):  # second pass: warm cache
            for name, ids in _id_sets().items():
                for dtype in (torch.bfloat16, torch.float32):
                    got = t.gather(ids, dtype=dtype)
                    want = ref32[ids.long()].to(dtype)
                    assert got.shape == (ids.numel(), t.dim) and got.dtype == dtype, name
                    assert torch.equal(_bits(got), _bits(want)), f"{name} {dtype}"


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_zero_scale_and_zero_row_are_exact_zeros(tables, setup):
    tier, kw = setup
    path, _ = tables["mxfp8"]
    with open_table(path, tier, device="cpu", **kw) as t:
        rows = t.gather(torch.tensor([11, 7]), dtype=torch.float32)
    assert torch.all(rows[0, :32] == 0)  # exactly +-0.0 (sign of the fp8 value), not 2**-127 * v
    assert torch.all(rows[0, 32:] != 0)
    assert torch.equal(_bits(rows[1]), _bits(torch.zeros(64)))


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_out_of_range_names_id_and_size(tables, setup):
    tier, kw = setup
    with open_table(tables["mxfp8"][0], tier, device="cpu", **kw) as t:
        for bad in (ROWS, -1, 10**12):
            with pytest.raises(IndexError, match=rf"row id {bad} .*with {ROWS} rows"):
                t.gather(torch.tensor([0, bad, 3]))
            with pytest.raises(IndexError, match=rf"row id {bad}"):
                t.gather_raw(torch.tensor([bad]))
        with pytest.raises(TypeError, match="integer"):
            t.gather(torch.tensor([1.0]))
        assert torch.equal(_bits(t.gather(torch.tensor([ROWS - 1]))), _bits(t.gather(torch.tensor([ROWS - 1]))))


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
@pytest.mark.parametrize("row_dtype", ["mxfp8", "bf16"])
def test_gather_raw_is_the_packed_row(tables, setup, row_dtype):
    tier, kw = setup
    path, _ = tables[row_dtype]
    ids = torch.tensor([3, 999, 3, 0, 500])
    with open_table(path, tier, device="cpu", **kw) as t:
        raw = t.gather_raw(ids)
        assert raw.dtype == torch.uint8 and raw.shape == (5, t.row_bytes)
        m = t.manifest
        values = (path / "values.bin").read_bytes()
        for i, r in enumerate(ids.tolist()):
            want = values[r * m.row_stride: r * m.row_stride + m.value_bytes]
            if m.scale_cols:
                want += (path / "scales.bin").read_bytes()[r * m.scale_cols:(r + 1) * m.scale_cols]
            assert bytes(raw[i].numpy()) == want
        assert torch.equal(_bits(t.decode_raw(raw)), _bits(t.gather(ids)))
        assert t.gather_raw(torch.zeros(0, dtype=torch.int64)).shape == (0, t.row_bytes)


@pytest.mark.parametrize("setup", SETUPS[:5], ids=SETUP_IDS[:5])
def test_out_buffer_submit_and_stats(tables, setup):
    tier, kw = setup
    with open_table(tables["mxfp8"][0], tier, device="cpu", **kw) as t:
        ids = torch.tensor([1, 2, 2, 3])
        out = torch.empty(4, t.dim, dtype=torch.bfloat16)
        assert t.gather(ids, out=out) is out
        assert torch.equal(_bits(out), _bits(t.gather(ids)))
        with pytest.raises(ValueError, match="out has shape"):
            t.gather(ids, out=torch.empty(3, t.dim, dtype=torch.bfloat16))
        h = t.submit(ids, dtype=torch.float32)
        assert h.done() and not h.cancel()
        assert torch.equal(_bits(h.wait()), _bits(t.gather(ids, dtype=torch.float32)))
        bad = t.submit(torch.tensor([ROWS]))
        with pytest.raises(IndexError):
            bad.wait()
        t.reset_stats()
        t.gather(torch.tensor([4, 4, 9]))
        t.gather(torch.zeros(0, dtype=torch.int64))
        st = t.stats()
        assert set(STAT_KEYS) <= set(st)
        resident = t.tier is Tier.GPU or t.cache is None  # no dedupe: distinct ids counted only on request
        assert (st["lookups"], st["rows"], st["unique_rows"]) == (2, 3, 0 if resident else 2)
        assert st["bytes_read"] > 0 and st["read_ops"] >= 1
        if "cache_rows" in kw:
            assert st["hits"] + st["misses"] == 2
        else:
            assert st["hits"] == st["misses"] == st["evictions"] == 0


def test_gpu_tier_takes_no_cache_and_bad_options(tables):
    path = tables["mxfp8"][0]
    with pytest.raises(ValueError, match="takes no cache"):
        open_table(path, "gpu", device="cpu", cache_rows=10)
    with pytest.raises(ValueError, match="tier='nvme'"):
        open_table(path, "nvme")
    with pytest.raises(ValueError, match="cache_policy"):
        open_table(path, "host", cache_rows=4, cache_policy="fifo")
    with pytest.raises(ValueError, match="io="):
        open_table(path, "disk", io="mmap")


def test_closed_table_refuses(tables):
    t = open_table(tables["mxfp8"][0], "host", device="cpu")
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.gather(torch.tensor([1]))


def test_cache_bytes_sizes_the_cache(tables):
    with open_table(tables["mxfp8"][0], "host", device="cpu", cache_bytes=100 * (64 + 2 + 24)) as t:
        assert t.cache.capacity == 96  # 100 rows rounded down to whole 8-way sets


def test_concurrent_gathers_are_consistent(tables):
    path, ref = tables["mxfp8"]
    with open_table(path, "host", device="cpu", cache_rows=32) as t:
        batches = [torch.randint(0, ROWS, (64,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
        with cf.ThreadPoolExecutor(4) as pool:
            # lookups from several threads share one cache: the table serializes the cache step
            outs = list(pool.map(lambda ids: (ids, t.gather(ids, dtype=torch.float32)), batches))
        for ids, got in outs:
            assert torch.equal(_bits(got), _bits(ref[ids]))


@pytest.mark.parametrize("tier", ["gpu", "host"], ids=["gpu-tier", "host-tier"])
@pytest.mark.parametrize("count_unique", [None, False, True])
def test_count_unique_is_off_unless_asked(tables, tier, count_unique):
    path, ref = tables["mxfp8"]
    kw = {} if count_unique is None else {"count_unique": count_unique}
    with open_table(path, tier, device="cpu", **kw) as t:
        ids = torch.tensor([1, 1, 2])
        assert torch.equal(_bits(t.gather(ids, dtype=torch.float32)), _bits(ref[ids]))
        st = t.stats()
        assert (st["lookups"], st["rows"], st["unique_rows"]) == (1, 3, 2 if count_unique else 0)
