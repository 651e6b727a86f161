"""pin_tensor without CUDA hands the same tensor back; argument checks hold everywhere. pinned_empty_filled
and the parallel verified load give back exactly the file's bytes, pin once with CUDA and keep nothing
from a failed fill."""
import gc
import weakref

import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import load, read_manifest, write_table
from engram.store.format import TableFormatError
from engram.store.pinning import HUGE_PAGE, pin_tensor, pinned_empty_filled, pinned_stats

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make device-test)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_pin_without_cuda_returns_same_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert pin_tensor(t) is t
    assert pinned_stats()["regions"] == 0


@pytest.mark.parametrize("kw", [{"chunk_bytes": 0}, {"chunk_bytes": 1000}, {"threads": 0}, {"method": "mlock"}])
def test_pin_rejects_bad_arguments(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        pin_tensor(torch.zeros(4), **kw)


def test_copy_chunks_copies_every_byte_with_a_short_last_chunk():
    from engram.store.pinning import _copy_chunks
    src = torch.randint(0, 256, (3 * 4096 + 123,), dtype=torch.uint8)  # 3 full chunks and a short one
    dst = torch.zeros_like(src)
    _copy_chunks(dst, src, chunk_bytes=4096, threads=3)
    assert torch.equal(dst, src)


def test_filled_buffer_holds_what_fill_wrote_on_a_huge_page_boundary():
    n = 3 * 4096 + 5
    want = torch.randint(0, 256, (n,), dtype=torch.uint8)
    got = pinned_empty_filled(n, lambda dst: dst.copy_(want))
    assert got.dtype == torch.uint8 and got.shape == (n,) and torch.equal(got, want)
    assert got.data_ptr() % HUGE_PAGE == 0
    assert got.is_pinned() == torch.cuda.is_available()
    assert pinned_empty_filled(0, lambda dst: None).shape == (0,)
    with pytest.raises(ValueError, match="method='mlock'"):
        pinned_empty_filled(8, lambda dst: None, method="mlock")


def test_failed_fill_keeps_nothing():
    before = pinned_stats()
    seen = []

    def fill(dst):
        seen.append(weakref.ref(dst))
        dst[:100] = 7
        raise TableFormatError("x.bin", 4096, "checksum mismatch in chunk 1")

    with pytest.raises(TableFormatError, match="x.bin: byte 4096"):
        pinned_empty_filled(1 << 20, fill)
    assert seen[0]() is None, "the destination of a failed fill must be freed"
    assert pinned_stats() == before


def _table(path, rows: int, dim: int):
    v, s = quantize_mxfp8(torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)))
    write_table(path, v, s, chunk_bytes=8192)
    return read_manifest(path)


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("target", ["ram", "pinned"])
def test_parallel_load_is_the_file(tmp_path, threads, target):
    m = _table(tmp_path / "t", rows=3001, dim=96)  # scales.bin 9003 B: one full 8 KiB chunk and a short one
    for kind in ("values", "scales"):
        got = load.load_file(m, kind, target, threads=threads)
        assert bytes(got.numpy()) == (m.path / m.files[kind].name).read_bytes(), kind


def test_parallel_load_in_small_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "_PIECE", 1000)  # pieces that cut chunks anywhere still CRC to the chunk's value
    m = _table(tmp_path / "t", rows=3001, dim=64)
    got = load.load_file(m, "scales", "pinned", threads=3)
    assert bytes(got.numpy()) == (m.path / m.files["scales"].name).read_bytes()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", ["register", "alloc"])
def test_filled_pinned_and_freed(method):
    before = pinned_stats()
    n = 5 * 1000 * 1000 + 3
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    p = pinned_empty_filled(n, lambda dst: dst.copy_(src), method=method)
    assert p.is_pinned() and torch.equal(p, src)
    assert pinned_stats()["pinned_bytes"] - before["pinned_bytes"] == n
    assert pinned_stats()["regions"] == before["regions"] + 1
    assert torch.equal(p.cuda(non_blocking=True).cpu(), src)  # one copy over the one registration
    del p
    gc.collect()
    assert pinned_stats() == before


@pytest.mark.gpu
@needs_cuda
def test_pinned_load_registers_and_a_bad_chunk_pins_nothing(tmp_path):
    m = _table(tmp_path / "t", rows=3001, dim=256)
    gc.collect()
    before = pinned_stats()
    got = load.load_file(m, "values", "pinned", threads=4)
    assert got.is_pinned() and pinned_stats()["regions"] == before["regions"] + 1
    del got
    gc.collect()
    assert pinned_stats() == before
    with open(m.path / "values.bin", "r+b") as f:
        f.seek(3 * 8192 + 1)
        f.write(b"\xff\x00")
    with pytest.raises(TableFormatError, match=r"values.bin: byte 24576: page 6 fails its checksum .*checksum mismatch"):
        load.load_file(m, "values", "pinned", threads=4)
    assert pinned_stats() == before
    m = _table(tmp_path / "u", rows=3001, dim=256)
    with open(m.path / "scales.bin", "r+b") as f:  # split layout: values pin fine, then the scales fail
        f.write(b"\xff")
    with pytest.raises(TableFormatError, match=r"scales.bin: byte 0: checksum mismatch"):
        load.load_table(m, "pinned", verify=True, layout="split", threads=4)
    assert pinned_stats() == before, "the values pinned before the bad scales chunk must be freed at once"
