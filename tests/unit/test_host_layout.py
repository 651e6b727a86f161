"""The host tier's packed layout (value + scale bytes of a row side by side) returns bitwise what the split
layout and the gpu tier return, has the strides its docstring states, and loads only verified bytes."""
from __future__ import annotations

import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import load, open_table, read_manifest, write_table
from engram.store.cache import RowCache
from engram.store.format import TableFormatError
from engram.store.host import HostTable
from engram.store.options import StoreOptions

ROWS = 1000
CHUNK = 4096  # many checksum chunks; 4096 % 3 != 0, so scale rows of dim 96 straddle chunk ends
# name: (row dtype, dim, packed row bytes S, or None where layout does not apply)
TABLES = {"mx96": ("mxfp8", 96, 112), "mx256": ("mxfp8", 256, 272), "bf16-40": ("bf16", 40, None)}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _write(path, row_dtype: str, dim: int, seed: int = 0, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[7] = 0.0
    if row_dtype == "mxfp8":
        v, s = quantize_mxfp8(x)
        s[11, 0] = 0  # scale byte 0 decodes to exactly 0.0
        write_table(path, v, s, chunk_bytes=CHUNK)
    else:
        write_table(path, x.to(torch.bfloat16), chunk_bytes=CHUNK)
    return read_manifest(path)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    return {name: _write(root / name, dt, dim) for name, (dt, dim, _) in TABLES.items()}


def _id_sets():
    g = torch.Generator().manual_seed(3)
    return {"random": torch.randint(0, ROWS, (257,), generator=g),
            "duplicates": torch.tensor([5, 5, 999, 0, 5, 999, 0, 0]),
            "edges": torch.tensor([0, ROWS - 1, 1, ROWS - 2]),
            "empty": torch.zeros(0, dtype=torch.int64)}


@pytest.mark.parametrize("name", list(TABLES))
def test_packed_views_have_the_documented_strides(tables, name):
    m = tables[name]
    _, dim, stride = TABLES[name]
    t = HostTable(m, "cpu", options=StoreOptions().replace(host_layout="packed"))
    if stride is None:  # no scales: one plain buffer, as in the split layout
        assert t.layout == "split" and t.scales is None
        assert t.values.shape == (ROWS, m.row_stride) and t.values.is_contiguous()
        return
    vb, sc = m.value_bytes, m.scale_cols
    assert t.layout == "packed" and load.packed_row_bytes(vb, sc) == stride and stride % 16 == 0
    assert t.values.shape == (ROWS, vb) and t.values.stride() == (stride, 1)
    assert t.scales.shape == (ROWS, sc) and t.scales.stride() == (stride, 1)
    assert t.scales.data_ptr() - t.values.data_ptr() == vb
    assert t.scales.data_ptr() % 8 == 0  # S % 16 == 0 and vb % 8 == 0: the Triton kernel's 8-byte scale load
    whole = t.values.as_strided((ROWS, stride), (stride, 1))  # the buffer behind both views: [rows, S]
    split = HostTable(m, "cpu", options=StoreOptions().replace(host_layout="split"))
    assert torch.equal(whole[:, :vb], split.values[:, :vb])
    assert torch.equal(whole[:, vb:vb + sc], split.scales)
    assert not whole[:, vb + sc:].any(), "padding bytes must be zero"


@pytest.mark.parametrize("name", list(TABLES))
def test_packed_equals_split_and_gpu_tier(tables, name):
    m = tables[name]
    gpu = open_table(m.path, "gpu", device="cpu")
    packed, split = (HostTable(m, "cpu", options=StoreOptions().replace(host_layout="packed")),
                     HostTable(m, "cpu", options=StoreOptions().replace(host_layout="split")))
    cached = HostTable(m, "cpu", RowCache(64, m.value_bytes, m.scale_cols, device="cpu"),
                       StoreOptions().replace(host_layout="packed"))
    for _ in range(2):  # second pass: the cache is warm
        for what, ids in _id_sets().items():
            for dtype in (torch.bfloat16, torch.float32):
                want = _bits(gpu.gather(ids, dtype=dtype))
                for t in (packed, split, cached):
                    assert torch.equal(_bits(t.gather(ids, dtype=dtype)), want), (what, t.layout, dtype)
            raw = gpu.gather_raw(ids)
            assert raw.shape == (ids.numel(), m.value_bytes + m.scale_cols)
            for t in (packed, split, cached):
                got = t.gather_raw(ids)
                assert torch.equal(got, raw), (what, t.layout)
                assert torch.equal(_bits(t.decode_raw(got)), _bits(gpu.gather(ids))), what
    assert cached.stats()["hits"] > 0


@pytest.mark.parametrize("piece", [4 << 20, 1000, 4096 + 272])
@pytest.mark.parametrize("threads", [1, 3])
def test_packed_build_is_independent_of_threads_and_pieces(tables, monkeypatch, piece, threads):
    """Pieces that cut rows anywhere (1000 B: mid-value and mid-scale) place every byte where one pass would."""
    monkeypatch.setattr(load, "_PIECE", piece)
    for name in ("mx96", "mx256"):
        m = tables[name]
        vals, scales = load.load_table(m, "ram", layout="packed", threads=threads)
        ref_v, ref_s = load.load_table(m, "ram", layout="split", threads=1)
        assert torch.equal(vals, ref_v[:, :m.value_bytes]) and torch.equal(scales, ref_s), name
        stride = load.packed_row_bytes(m.value_bytes, m.scale_cols)
        dirty = torch.full((m.rows * stride,), 0xA5, dtype=torch.uint8)  # a reused buffer: old bytes everywhere
        load.fill_packed(m, dirty, threads=threads)
        dirty = dirty.view(m.rows, stride)  # [rows, S]
        assert torch.equal(dirty[:, :m.value_bytes], vals) and torch.equal(dirty[:, m.value_bytes:][:, :m.scale_cols],
                                                                          scales)
        assert not dirty[:, m.value_bytes + m.scale_cols:].any(), "padding must be zeroed"


def _corrupt(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("layout", ["packed", "split"])
@pytest.mark.parametrize("kind", ["values", "scales"])
def test_corrupt_chunk_names_file_and_offset(tmp_path, layout, kind):
    m = _write(tmp_path / "t", "mxfp8", 96, seed=1, rows=5000)  # values 640000 B, scales 15000 B (3.7 chunks)
    name = m.files[kind].name
    _corrupt(m.path / name, 2 * CHUNK + 17)
    chunk_off = 2 * CHUNK
    for threads in (1, 4):
        # values.bin has page checksums: the error names the page, as the disk tier's does
        named = rf"page {chunk_off // 4096} fails its checksum .*" if kind == "values" else ""
        with pytest.raises(TableFormatError, match=rf"{name}: byte {chunk_off}: {named}checksum mismatch") as e:
            HostTable(m, "cpu", options=StoreOptions().replace(host_layout=layout, load_threads=threads))
        assert e.value.file == str(m.path / name) and e.value.offset == chunk_off
    HostTable(m, "cpu", options=StoreOptions().replace(host_layout=layout, verify=False))  # without verification it loads


def test_first_bad_chunk_is_reported(tmp_path):
    m = _write(tmp_path / "t", "mxfp8", 256, seed=2)
    for off in (20 * CHUNK + 1, 3 * CHUNK + 9):
        _corrupt(m.path / m.files["values"].name, off)
    with pytest.raises(TableFormatError) as e:
        HostTable(m, "cpu", options=StoreOptions().replace(host_layout="packed", load_threads=4))
    assert e.value.offset == 3 * CHUNK


def test_bad_arguments_name_the_field(tables):
    m = tables["mx96"]
    with pytest.raises(ValueError, match="layout='interleaved'"):
        HostTable(m, "cpu", options=StoreOptions().replace(host_layout="interleaved"))
    with pytest.raises(ValueError, match="load_threads=0"):
        HostTable(m, "cpu", options=StoreOptions().replace(load_threads=0))
    with pytest.raises(ValueError, match="layout='packed' needs an mxfp8"):
        load.load_packed(tables["bf16-40"], "ram")
    with pytest.raises(ValueError, match="target="):
        load.load_packed(m, "cpu")
    with pytest.raises(ValueError, match="dst must be uint8 host memory of 1000 x 112 bytes"):
        load.fill_packed(m, torch.zeros(ROWS * 111, dtype=torch.uint8))
    with pytest.raises(ValueError, match="host_layout='rows'"):
        open_table(m.path, "host", device="cpu", host_layout="rows")


@pytest.mark.parametrize("layout", ["packed", "split"])
def test_open_table_passes_the_host_layout(tables, layout):
    t = open_table(tables["mx256"].path, "host", device="cpu", host_layout=layout)
    assert t.layout == layout
    assert (t.values.stride(0) == 272) == (layout == "packed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make device-test)")
@pytest.mark.parametrize("name", ["mx96", "mx256"])
def test_packed_pinned_uva_gather_equals_split(tables, name):
    from engram.store import kernels
    from engram.store.pinning import pinned_stats

    import gc

    m = tables[name]
    gc.collect()  # earlier tests' tables (and errors holding them) go first
    before = pinned_stats()
    packed, split = (HostTable(m, options=StoreOptions().replace(host_layout="packed")),
                     HostTable(m, options=StoreOptions().replace(host_layout="split")))
    assert packed.values.is_pinned() and packed.scales.is_pinned()
    assert pinned_stats()["regions"] == before["regions"] + 3  # one packed region; split pins two files
    assert kernels.fast_path(packed.values) == ("uva" if kernels.triton_available() else None)
    ids = torch.randint(0, ROWS, (40000,), device="cuda")  # above SORT_MIN_ROWS: the sorted UVA path
    for batch in (ids, ids[:100], torch.tensor([0, ROWS - 1, 0], device="cuda")):
        assert torch.equal(_bits(packed.gather(batch)), _bits(split.gather(batch)))
        assert torch.equal(packed.gather_raw(batch), split.gather_raw(batch))
    packed.close()
    split.close()
    del packed, split
    gc.collect()
    assert pinned_stats() == before


def test_device_load_reads_windows_in_parallel_and_checks_every_chunk(tmp_path, monkeypatch):
    """load_file into a device (here the CPU device, the same windowed code path as CUDA): bytes equal the
    file across several windows and thread counts; a bad chunk in a later window names file and offset."""
    m = _write(tmp_path / "t", "mxfp8", 96, seed=2, rows=5000)  # values: 157 chunks of 4096 B
    monkeypatch.setattr(load, "DEVICE_WINDOW", 3 * CHUNK + 1)  # 3 chunks per window, 53 windows
    want = torch.from_numpy(__import__("numpy").fromfile(m.path / m.files["values"].name, dtype="uint8"))
    for threads in (1, 3):
        got = load.load_file(m, "values", torch.device("cpu"), threads=threads)
        assert torch.equal(got, want)
    name = m.files["values"].name
    _corrupt(m.path / name, 40 * CHUNK + 5)
    with pytest.raises(TableFormatError, match=rf"{name}: byte {40 * CHUNK}: page 40 fails its checksum .*checksum mismatch"):
        load.load_file(m, "values", torch.device("cpu"), threads=3)
