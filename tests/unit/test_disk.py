"""DiskTable: rows bitwise equal to the in-memory reference, page accounting, faults isolated per lookup."""
from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import open_table
from engram.store import reader as rd
from engram.store.disk import DiskTable, open_disk_table
from engram.store.options import StoreOptions
from engram.store.format import TableFormatError
from engram.store.page_crc import CorruptPageError
from engram.store.reader import DiskReadError, Fault
from engram.store.writer import write_table

BACKENDS = ["c", "python"] if rd.c_available() else ["python"]


def make_rows(rows: int, dim: int, kind: str, seed: int = 0):
    """(values, scales) as write_table takes them, plus the gpu-tier reference decode of every row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    x[3] = 0.0  # an all-zero row (scale byte 127)
    if kind == "mxfp8":
        vals, scales = quantize_mxfp8(x)
        return vals, scales, lambda ids, dt: dequantize_mxfp8(vals[ids], scales[ids], dtype=dt)
    vals = x.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind])
    return vals, None, lambda ids, dt: vals[ids].to(dt)


@pytest.fixture(scope="module")
def mx_table(tmp_path_factory):
    d = tmp_path_factory.mktemp("disk") / "mx"
    vals, scales, ref = make_rows(3001, 256, "mxfp8")  # 256-B rows, 16 per page, a partial last page
    write_table(d, vals, scales)
    return d, vals, scales, ref


def adversarial_ids(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.empty(0, dtype=torch.int64),
        torch.tensor([0]),
        torch.tensor([rows - 1, 0, rows - 1]),  # last row sits on the padded last page
        torch.full((50,), 17),  # one row many times
        torch.arange(15, 18),  # across a page boundary
        torch.arange(rows - 1, -1, -7),  # descending
        torch.arange(32, 48),  # exactly one full page
        torch.randint(0, rows, (999,), generator=g),  # uniform, with repeats
        torch.randint(0, 40, (300,), generator=g) * 16,  # one row per page: 16x amplification
        torch.arange(rows),  # the whole table
    ]


@pytest.fixture(params=BACKENDS)
def backend(request):
    old = rd.set_backend(request.param)
    yield request.param
    rd.set_backend(old)


@pytest.mark.parametrize("io,chunk_pages", [("direct", 2048), ("buffered", 2048), ("buffered", 3)])
def test_mxfp8_rows_bitwise_equal_reference(mx_table, backend, io, chunk_pages):
    d, vals, scales, ref = mx_table
    with open_disk_table(d, io=io, queue_depth=5, chunk_pages=chunk_pages) as t:
        for ids in adversarial_ids(t.rows):
            for dt in (torch.bfloat16, torch.float32):
                got = t.gather(ids, dtype=dt)
                want = ref(ids, dt)
                assert got.shape == (ids.numel(), 256) and got.dtype == dt
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (ids[:8], dt)
            raw = t.gather_raw(ids)  # [N, 256 + 8]: value bytes then scale bytes
            assert torch.equal(raw[:, :256], vals.view(torch.uint8)[ids])
            assert torch.equal(raw[:, 256:], scales[ids])


@pytest.mark.parametrize("kind,dim", [("bf16", 48), ("fp16", 8), ("fp32", 1100)])
def test_other_dtypes_and_strides(tmp_path, kind, dim):
    """bf16 96 B -> stride 128; fp16 16 B -> 256 rows a page; fp32 4400 B -> two pages per row."""
    vals, _, ref = make_rows(700, dim, kind, seed=dim)
    write_table(tmp_path / "t", vals)
    with open_disk_table(tmp_path / "t", io="direct", queue_depth=3, chunk_pages=5) as t:
        for ids in adversarial_ids(t.rows):
            got = t.gather(ids, dtype=torch.float32)
            assert torch.equal(got.view(torch.uint8), ref(ids, torch.float32).view(torch.uint8))
        if t.stride > t.page:
            t.reset_stats()
            t.gather(torch.tensor([5, 5, 9]))
            s = t.stats()
            assert s["read_ops"] == 2 and s["bytes_read"] == 2 * 8192


@pytest.mark.parametrize("cache_rows", [0, 64, 4096])
def test_disk_equals_gpu_tier_through_open_table(mx_table, cache_rows):
    """The placement function's disk tier, with and without a hot-row cache (64 rows: constant evictions)."""
    d, *_ = mx_table
    gpu = open_table(d, tier="gpu", device="cpu")
    disk = open_table(d, tier="disk", device="cpu", cache_rows=cache_rows, queue_depth=8)
    assert isinstance(disk, DiskTable)
    for _ in range(2):  # the second pass hits the cache
        for ids in adversarial_ids(gpu.rows):
            a, b = gpu.gather(ids), disk.gather(ids)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert torch.equal(gpu.gather_raw(ids), disk.gather_raw(ids))
    s = disk.stats()
    if cache_rows:
        assert s["hits"] > 0 and s["misses"] == s["disk_rows"]
    else:
        assert s["hits"] == 0 and s["disk_rows"] == s["unique_rows"]
    disk.close()
    gpu.close()


def test_stats_count_pages_and_amplification(mx_table):
    d, *_ = mx_table
    with open_disk_table(d, io="buffered") as t:
        t.gather(torch.tensor([0, 1, 15, 16, 16, 40 * 16 + 3]))  # pages 0, 1, 40
        s = t.stats()
        assert (s["lookups"], s["rows"], s["unique_rows"]) == (1, 6, 5)
        assert (s["read_ops"], s["bytes_read"], s["disk_rows"]) == (3, 3 * 4096, 5)
        assert s["page_amplification"] == pytest.approx(3 * 4096 / (5 * 256))
        t.gather(torch.arange(0, 64 * 16, 16))  # cold, one row per page: the worst case
        t.reset_stats()
        t.gather(torch.arange(0, 64 * 16, 16))
        assert t.stats()["page_amplification"] == 16.0
        assert t.resident_bytes == t.rows * 8 + t.manifest.pages * 4 and s["io"] == "buffered"  # scales + page CRCs


def test_gather_into_out_and_errors(mx_table):
    d, _, _, ref = mx_table
    with open_disk_table(d) as t:
        out = torch.empty(4, 256, dtype=torch.bfloat16)
        ids = torch.tensor([9, 2, 9, 3000])
        assert t.gather(ids, out=out) is out
        assert torch.equal(out.view(torch.uint8), ref(ids, torch.bfloat16).view(torch.uint8))
        with pytest.raises(IndexError, match="row id 3001"):
            t.gather(torch.tensor([1, 3001]))
    with pytest.raises(RuntimeError, match="closed"):
        t.gather(torch.tensor([1]))
    with pytest.raises(ValueError, match="engram_config.queue_depth=0"):
        StoreOptions(queue_depth=0)
    with pytest.raises(ValueError, match="engram_config.io='mmap'"):
        open_disk_table(d, io="mmap")


@pytest.mark.parametrize("fault", [Fault(index=1, err=errno.EIO), Fault(index=0, err=0, got=100)])
def test_injected_fault_fails_only_that_lookup(mx_table, backend, fault):
    d, _, _, ref = mx_table
    with open_disk_table(d, io="direct") as t:
        ids = torch.tensor([5, 100, 2000])  # pages 0, 6, 125
        armed = [fault]
        t.reader.fault_hook = lambda offs: armed.pop() if armed else None
        with pytest.raises(DiskReadError) as ei:
            t.gather(ids)
        e = ei.value
        assert e.path == str(d / "values.bin") and e.offset == [0, 6 * 4096, 125 * 4096][fault.index]
        assert f"byte offset {e.offset}" in str(e)
        got = t.gather(ids)
        assert torch.equal(got.view(torch.uint8), ref(ids, torch.bfloat16).view(torch.uint8))
        armed.append(fault)  # the same through submit: wait() raises, the next handle is fine
        h = t.submit(ids)
        with pytest.raises(DiskReadError):
            h.wait()
        assert torch.equal(t.submit(ids).wait().view(torch.uint8), got.view(torch.uint8))
        assert t.stats()["inflight"] == 0


@pytest.mark.parametrize("failing_call", [0, 1, 3])
def test_fault_in_a_pipelined_chunk_fails_that_lookup_only(mx_table, backend, failing_call):
    """chunk_pages=2: the lookup reads 4 chunks, each while the previous one is decoded."""
    d, _, _, ref = mx_table
    with open_disk_table(d, io="buffered", chunk_pages=2) as t:
        ids = torch.tensor([0, 16, 40, 70, 100, 130, 2000, 2999])  # pages 0 1 2 4 | 6 8 125 187
        calls = []

        def hook(offs):
            calls.append(offs.copy())
            return Fault(index=1, err=errno.EIO) if len(calls) == failing_call + 1 else None

        t.reader.fault_hook = hook
        with pytest.raises(DiskReadError) as ei:
            t.gather(ids)
        assert ei.value.offset == calls[failing_call][1]
        t.reader.fault_hook = None
        for _ in range(2):
            got = t.gather(ids, dtype=torch.float32)
            assert torch.equal(got.view(torch.uint8), ref(ids, torch.float32).view(torch.uint8))


def test_truncated_file_is_a_short_read_naming_offset(tmp_path):
    vals, scales, ref = make_rows(160, 256, "mxfp8")  # 10 pages
    write_table(tmp_path / "t", vals, scales)
    with open_disk_table(tmp_path / "t", io="buffered") as t:
        os.truncate(tmp_path / "t" / "values.bin", 5 * 4096 + 512)  # page 5 now ends early
        with pytest.raises(DiskReadError, match=r"short read: 512 of 4096") as ei:
            t.gather(torch.tensor([1, 90, 150]))
        assert ei.value.offset == 5 * 4096
        ok = torch.tensor([1, 70])  # pages 0 and 4 are intact
        assert torch.equal(t.gather(ok).view(torch.uint8), ref(ok, torch.bfloat16).view(torch.uint8))


def test_replaced_values_file_fails_one_lookup_then_is_read_and_checked(tmp_path, backend):
    """The reader reopens a replaced values.bin; its pages are then checked against the CRCs loaded at open,
    so a file with other bytes fails (CorruptPageError) and a byte-identical one serves."""
    vals, scales, ref = make_rows(400, 256, "mxfp8", seed=1)
    write_table(tmp_path / "t", vals, scales)
    vals2, scales2, _ = make_rows(400, 256, "mxfp8", seed=1)
    vals2 = (vals2.to(torch.float32) * 0.5).to(torch.float8_e4m3fn)  # new values, same scales
    write_table(tmp_path / "t2", vals2, scales2)
    shutil.copy(tmp_path / "t" / "values.bin", tmp_path / "same.bin")
    with open_disk_table(tmp_path / "t", io="direct") as t:
        ids = torch.tensor([33, 7])  # pages 2 and 0
        for src in (tmp_path / "t2" / "values.bin", tmp_path / "same.bin"):
            os.replace(src, tmp_path / "t" / "values.bin")
            with pytest.raises(DiskReadError, match="replaced") as ei:
                t.gather(ids)
            assert ei.value.offset == 0 and str(tmp_path / "t" / "values.bin") in str(ei.value)
            if src.name == "values.bin":
                with pytest.raises(CorruptPageError, match="values.bin: byte 0: page 0 fails its checksum"):
                    t.gather(ids)
                assert t.stats()["corrupt_pages"] == 2
        got = t.gather(ids)
        assert torch.equal(got.view(torch.uint8), ref(ids, torch.bfloat16).view(torch.uint8))


def test_corrupt_resident_scales_refused_at_open(tmp_path):
    """The disk tier keeps scales.bin in RAM: it is CRC-checked while read, like the gpu/host tiers' loads."""
    vals, scales, _ = make_rows(160, 256, "mxfp8")
    write_table(tmp_path / "t", vals, scales)
    with open(tmp_path / "t" / "scales.bin", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(TableFormatError, match=r"scales.bin: byte 0: checksum mismatch in chunk 0"):
        open_table(tmp_path / "t", tier="disk", device="cpu")
    with open_table(tmp_path / "t", tier="disk", device="cpu", verify=False) as t:  # opt-out, as for gpu/host
        assert t.gather(torch.tensor([0])).shape == (1, 256)

