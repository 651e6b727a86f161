"""PageReader: C pool vs pure-Python fallback give identical bytes; faults name file and offset."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from engram.store import reader as rd
from engram.store.reader import PAGE, DiskReadError, Fault, PageReader, aligned_pages

BACKENDS = ["c", "python"] if rd.c_available() else ["python"]


@pytest.fixture
def backend(request):
    old = rd.set_backend(request.param)
    yield request.param
    rd.set_backend(old)


def make_file(path, n_pages: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size=n_pages * PAGE, dtype=np.uint8)
    data.tofile(path)
    return data


def expected(data: np.ndarray, offsets, size: int) -> np.ndarray:
    return np.concatenate([data[o:o + size] for o in offsets]) if len(offsets) else np.empty(0, np.uint8)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("io", ["direct", "buffered"])
@pytest.mark.parametrize("qd", [1, 3, 64])
def test_random_pages_bitwise(tmp_path, backend, io, qd):
    data = make_file(tmp_path / "v.bin", 97)
    r = PageReader(tmp_path / "v.bin", io=io, queue_depth=qd)
    rng = np.random.default_rng(qd)
    for n in (0, 1, 5, 200):  # includes repeats and n < qd and n > qd
        offs = rng.integers(0, 97, size=n) * PAGE
        out = aligned_pages(n)
        r.read(offs, out)
        assert np.array_equal(out.numpy().reshape(-1), expected(data, offs, PAGE))
    r.close()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("size,crc_page", [(PAGE, PAGE), (2 * PAGE, PAGE), (2 * PAGE, 2 * PAGE)])
def test_checksums_computed_while_reading_equal_crc32c_pages(tmp_path, backend, size, crc_page):
    from engram.store.crc32c import crc32c_pages

    data = make_file(tmp_path / "v.bin", 64, seed=3)
    r = PageReader(tmp_path / "v.bin", io="direct", queue_depth=8)
    rng = np.random.default_rng(size + crc_page)
    for n in (1, 7, 40):
        offs = rng.integers(0, 64 - size // PAGE + 1, size=n) * PAGE
        out = aligned_pages(n * size // PAGE)
        crcs = np.full(n * size // crc_page + 3, 7, dtype=np.uint32)  # 3 spare entries stay untouched
        r.read(offs, out, size, crcs, crc_page)
        assert np.array_equal(out.numpy().reshape(-1), expected(data, offs, size))
        assert np.array_equal(crcs[:-3], crc32c_pages(out.numpy().reshape(-1), crc_page))
        assert (crcs[-3:] == 7).all()
    with pytest.raises(ValueError, match="crcs must be uint32"):
        r.read(offs[:1], aligned_pages(size // PAGE), size, np.empty(0, dtype=np.uint32), crc_page)
    with pytest.raises(ValueError, match="must divide"):
        r.read(offs[:1], aligned_pages(size // PAGE), size, np.empty(8, dtype=np.uint32), 3 * PAGE)
    r.close()


@pytest.mark.parametrize("size", [1, 100, 264, 5000])
def test_backends_agree_on_unaligned_buffered_reads(tmp_path, size):
    data = make_file(tmp_path / "v.bin", 9)
    offs = np.random.default_rng(size).integers(0, 9 * PAGE - size, size=37)
    outs = []
    for b in BACKENDS:
        old = rd.set_backend(b)
        try:
            out = torch.empty(37 * size, dtype=torch.uint8)
            PageReader(tmp_path / "v.bin", io="buffered", queue_depth=4).read(offs, out, size=size)
            outs.append(out)
        finally:
            rd.set_backend(old)
    assert np.array_equal(outs[0].numpy(), expected(data, offs, size))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_short_read_names_file_and_offset_then_recovers(tmp_path, backend):
    data = make_file(tmp_path / "v.bin", 4)
    r = PageReader(tmp_path / "v.bin", io="buffered", queue_depth=2)
    offs = np.array([0, 3 * PAGE + 100, PAGE], dtype=np.int64)  # the middle one runs past EOF
    with pytest.raises(DiskReadError) as ei:
        r.read(offs, aligned_pages(3))
    e = ei.value
    assert e.path == str(tmp_path / "v.bin") and e.offset == 3 * PAGE + 100
    assert str(tmp_path / "v.bin") in str(e) and str(3 * PAGE + 100) in str(e) and "short read" in str(e)
    ok = np.array([PAGE, 2 * PAGE], dtype=np.int64)
    out = aligned_pages(2)
    r.read(ok, out)
    assert np.array_equal(out.numpy().reshape(-1), expected(data, ok, PAGE))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("fault", [Fault(index=2, err=errno.EIO), Fault(index=0, err=0, got=17)])
def test_injected_fault_fails_only_that_read(tmp_path, backend, fault):
    data = make_file(tmp_path / "v.bin", 8)
    r = PageReader(tmp_path / "v.bin", io="direct", queue_depth=3)
    offs = np.array([5, 1, 7, 2], dtype=np.int64) * PAGE
    calls = []

    def hook(o):
        calls.append(o.copy())
        return fault if len(calls) == 1 else None

    r.fault_hook = hook
    with pytest.raises(DiskReadError) as ei:
        r.read(offs, aligned_pages(4))
    assert ei.value.offset == offs[fault.index] and ei.value.errno == fault.err
    assert ("Input/output error" in str(ei.value)) == (fault.err == errno.EIO)
    if fault.err == 0:
        assert f"short read: {fault.got} of {PAGE}" in str(ei.value)
    out = aligned_pages(4)
    r.read(offs, out)  # the next read is not affected
    assert np.array_equal(out.numpy().reshape(-1), expected(data, offs, PAGE))
    assert len(calls) == 2


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_replaced_file_fails_one_read_then_reads_new_file(tmp_path, backend):
    path = tmp_path / "v.bin"
    make_file(path, 4, seed=1)
    r = PageReader(path, io="direct", queue_depth=2)
    new = make_file(tmp_path / "v.tmp", 4, seed=2)
    os.replace(tmp_path / "v.tmp", path)
    offs = np.array([2 * PAGE, 0], dtype=np.int64)
    with pytest.raises(DiskReadError, match="replaced") as ei:
        r.read(offs, aligned_pages(2))
    assert ei.value.offset == 2 * PAGE and str(path) in str(ei.value)
    out = aligned_pages(2)
    r.read(offs, out)
    assert np.array_equal(out.numpy().reshape(-1), expected(new, offs, PAGE))
    r.close()


def test_deleted_file_names_the_path(tmp_path):
    make_file(tmp_path / "v.bin", 2)
    r = PageReader(tmp_path / "v.bin", io="buffered")
    os.unlink(tmp_path / "v.bin")
    with pytest.raises(DiskReadError, match="file is gone"):
        r.read(np.array([0], dtype=np.int64), aligned_pages(1))


def test_direct_rejects_unaligned_buffer_and_bad_args(tmp_path):
    make_file(tmp_path / "v.bin", 2)
    r = PageReader(tmp_path / "v.bin", io="direct")
    if r.io == "direct":
        buf = aligned_pages(2).view(-1)[1:PAGE + 1]
        with pytest.raises(ValueError, match="page-aligned"):
            r.read(np.array([0], dtype=np.int64), buf)
    with pytest.raises(ValueError, match="queue_depth=0"):
        PageReader(tmp_path / "v.bin", queue_depth=0)
    with pytest.raises(ValueError, match="io='mmap'"):
        PageReader(tmp_path / "v.bin", io="mmap")
    with pytest.raises(ValueError, match="contiguous uint8"):
        r.read(np.array([0], dtype=np.int64), torch.empty(10, dtype=torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_concurrent_readers_share_the_pool(tmp_path, backend):
    datas = [make_file(tmp_path / f"v{i}.bin", 16, seed=i) for i in range(4)]
    readers = [PageReader(tmp_path / f"v{i}.bin", io="buffered", queue_depth=8) for i in range(4)]
    errors = []

    def loop(i):
        rng = np.random.default_rng(i)
        for _ in range(30):
            offs = rng.integers(0, 16, size=int(rng.integers(1, 40))) * PAGE
            out = aligned_pages(len(offs))
            readers[i].read(offs, out)
            if not np.array_equal(out.numpy().reshape(-1), expected(datas[i], offs, PAGE)):
                errors.append(i)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_package_works_without_the_extension(tmp_path):
    """With the C module unimportable, reads still work (Python pool) and warn exactly once."""
    make_file(tmp_path / "v.bin", 3)
    code = f"""
import sys, warnings, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "engram.store._pread_pool":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
import numpy as np
from engram.store import reader
assert not reader.c_available() and reader.active_backend() == "python"
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    r = reader.PageReader({str(tmp_path / 'v.bin')!r}, io="buffered", queue_depth=2)
    for _ in range(3):
        out = reader.aligned_pages(2)
        r.read(np.array([0, 8192], dtype=np.int64), out)
ref = np.fromfile({str(tmp_path / 'v.bin')!r}, dtype=np.uint8)
assert (out.numpy().reshape(-1) == np.concatenate([ref[:4096], ref[8192:]])).all()
msgs = [str(x.message) for x in w if "C disk reader is not built" in str(x.message)]
assert len(msgs) == 1, msgs
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.skipif(not rd.c_available(), reason="the C reader is not built")
def test_direct_reads_go_through_a_thread_local_aio_context_equal_to_the_pool(tmp_path, monkeypatch):
    """io="direct" with the C backend reads through Linux AIO (one context per thread), giving the pool's
    bytes and checksums; the fallback when the kernel refuses a context (``_aio_broken``) reads on the pool; a read
    past the end is a short read."""
    from engram.store.crc32c import crc32c_pages

    old = rd.set_backend("c")
    try:
        data = make_file(tmp_path / "v.bin", 64)
        r = PageReader(tmp_path / "v.bin", io="direct", queue_depth=8)
        if r.io != "direct":
            pytest.skip("this file system refuses O_DIRECT")
        assert isinstance(rd._pool(8, "direct"), rd._pread_pool.Aio)
        assert isinstance(rd._pool(8, "buffered"), rd._pread_pool.Pool)
        offs = np.random.default_rng(3).integers(0, 64, 40) * PAGE  # more blocks than the depth, repeats
        got = {}
        for aio in (True, False):
            monkeypatch.setattr(rd, "_aio_broken", not aio)
            out, crcs = aligned_pages(40), np.zeros(40, dtype=np.uint32)
            r.read(offs, out, crcs=crcs)
            got[aio] = out.numpy().reshape(-1).copy(), crcs
        assert isinstance(rd._pool(8, "direct"), rd._pread_pool.Pool)
        monkeypatch.setattr(rd, "_aio_broken", False)
        assert np.array_equal(got[True][0], expected(data, offs, PAGE))
        assert np.array_equal(got[True][0], got[False][0]) and np.array_equal(got[True][1], got[False][1])
        assert np.array_equal(got[True][1], crc32c_pages(got[True][0], PAGE))
        with pytest.raises(DiskReadError, match="short read: 0 of 4096 bytes") as ei:
            r.read(np.array([PAGE, 64 * PAGE], dtype=np.int64), aligned_pages(2))
        assert ei.value.offset == 64 * PAGE
        contexts, errors = [], []

        def loop(seed):  # threads read at once, each through its own context
            contexts.append(rd._pool(8, "direct"))  # held: no context is freed and its id reused
            rng = np.random.default_rng(seed)
            for _ in range(50):
                o = rng.integers(0, 64, int(rng.integers(1, 30))) * PAGE
                out = aligned_pages(len(o))
                r.read(o, out)
                if not np.array_equal(out.numpy().reshape(-1), expected(data, o, PAGE)):
                    errors.append(seed)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len({id(c) for c in contexts}) == 4
    finally:
        rd.set_backend(old)


@pytest.mark.skipif(not rd.c_available(), reason="the C reader is not built")
def test_a_kernel_that_refuses_aio_leaves_direct_reads_on_the_pool(tmp_path, monkeypatch):
    """io_setup failing (no AIO in the kernel, aio-max-nr spent): one warning, then the pool reads O_DIRECT."""

    def refuse(depth):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    old = rd.set_backend("c")
    try:
        monkeypatch.setattr(rd, "_aio_local", threading.local())  # no context made by earlier tests
        monkeypatch.setattr(rd, "_aio_broken", False)
        monkeypatch.setattr(rd._pread_pool, "Aio", refuse)
        data = make_file(tmp_path / "v.bin", 8)
        r = PageReader(tmp_path / "v.bin", io="direct", queue_depth=4)
        offs = np.array([3 * PAGE, 0], dtype=np.int64)
        out = aligned_pages(2)
        with pytest.warns(RuntimeWarning, match="Linux AIO is unavailable"):
            r.read(offs, out)
        assert np.array_equal(out.numpy().reshape(-1), expected(data, offs, PAGE))
        assert rd._aio_broken and isinstance(rd._pool(4, "direct"), rd._pread_pool.Pool)
    finally:
        rd.set_backend(old)
