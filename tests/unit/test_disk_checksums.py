"""Per-page CRC32C of values.bin (format 2): corruption fails the lookup that reads it, nothing else; old
tables are refused on the disk tier with the command that upgrades them, which then works."""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch

from engram.cli import main
from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import crc32c, open_table, read_manifest, verify_table, write_table
from engram.store import reader as rd
from engram.store.format import MANIFEST, PAGE_CRC_FILE, TableFormatError
from engram.store.page_crc import CorruptPageError

ROWS, DIM = 1000, 256  # 256-B rows, 16 per page: 63 pages, the last one partly padding
BAD_PAGE, BAD_BYTE = 20, 20 * 4096 + 777  # rows 320..335


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _downgrade(d) -> None:
    """Make ``d`` what a format-1 writer wrote: no sidecar, no page checksum fields."""
    doc = json.loads((d / MANIFEST).read_text())
    doc["format_version"] = 1
    del doc["files"]["page_crc"], doc["checksum"]["pages"]
    (d / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
    os.remove(d / PAGE_CRC_FILE)


@pytest.fixture
def table(tmp_path):
    v, s = quantize_mxfp8(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    d = tmp_path / "t"
    write_table(d, v, s, chunk_bytes=16384)
    return d, dequantize_mxfp8(v, s, torch.float32)


@pytest.fixture(params=["c", "numpy"] if rd.c_available() else ["numpy"])
def crc_backend(request):
    old = crc32c.set_backend(request.param)
    yield request.param
    crc32c.set_backend(old)


def test_crc32c_known_values_and_backends_agree():
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c.crc32c(b"") == 0 and crc32c.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 zero bytes
    pages = np.random.default_rng(0).integers(0, 256, 4096 * 9, dtype=np.uint8)
    pages[:4096] = 0xFF
    want = [crc32c.crc32c(pages[i * 4096:(i + 1) * 4096].tobytes()) for i in range(9)]
    for name in ["c", "numpy"] if rd.c_available() else ["numpy"]:
        old = crc32c.set_backend(name)
        try:
            assert crc32c.crc32c_pages(pages, 4096).tolist() == want, name
            assert crc32c.crc32c(b"56789", crc32c.crc32c(b"1234")) == 0xE3069283, name
            assert crc32c.crc32c(bytes([0xFF]) * 32) == 0x62A8AB43, name  # RFC 3720 B.4: 32 bytes of 0xFF
        finally:
            crc32c.set_backend(old)
    with pytest.raises(ValueError, match="not whole pages of 4096"):
        crc32c.crc32c_pages(pages[:5000], 4096)


def test_writer_stores_one_crc_per_page(table):
    d, _ = table
    m = read_manifest(d)
    assert m.format_version == 2 and m.has_page_crcs and m.pages == 63
    stored = np.fromfile(d / PAGE_CRC_FILE, dtype="<u4")
    data = np.fromfile(d / "values.bin", dtype=np.uint8)
    assert stored.tolist() == crc32c.crc32c_pages(data, 4096).tolist()


@pytest.mark.parametrize("cache_rows", [0, 64])
def test_corrupt_page_fails_only_the_lookups_that_read_it(table, crc_backend, cache_rows):
    d, ref = table
    _flip(d / "values.bin", BAD_BYTE)
    with open_table(d, "disk", device="cpu", io="buffered", cache_rows=cache_rows) as t:
        good = torch.tensor([0, 319, 336, 999, 5])  # pages 0, 19, 21, 62: neighbours of the bad page
        assert torch.equal(_bits(t.gather(good, dtype=torch.float32)), _bits(ref[good]))
        for ids in (torch.tensor([330]), torch.tensor([3, 320, 900])):
            with pytest.raises(CorruptPageError) as e:
                t.gather(ids)
            assert e.value.file == str(d / "values.bin") and e.value.offset == BAD_PAGE * 4096
            assert f"values.bin: byte {BAD_PAGE * 4096}: page {BAD_PAGE} fails its checksum" in str(e.value)
        h = t.submit(torch.tensor([321, 1]))  # through a handle: wait() raises it
        with pytest.raises(CorruptPageError, match=f"byte {BAD_PAGE * 4096}"):
            h.wait()
        assert t.stats()["corrupt_pages"] == 3
        assert torch.equal(_bits(t.gather(good, dtype=torch.float32)), _bits(ref[good]))  # still serving
        if t.cache is not None:  # no row of a failed lookup was cached: neither the bad page's nor the others'
            slots = t.cache.lookup(torch.tensor([1, 3, 320, 321, 330, 335, 900]))
            assert (slots == -1).all()
            assert (t.cache.lookup(good) >= 0).all()
        t.reset_stats()
        assert t.stats()["corrupt_pages"] == 0


def test_rows_over_a_page_check_each_page(tmp_path):
    x = torch.randn(20, 2048, generator=torch.Generator().manual_seed(3))  # fp32: 8 KiB rows, 2 pages each
    write_table(tmp_path / "t", x)
    _flip(tmp_path / "t" / "values.bin", 7 * 8192 + 4096 + 3)  # the second page of row 7
    with open_table(tmp_path / "t", "disk", device="cpu", io="buffered") as t:
        assert torch.equal(t.gather(torch.tensor([6, 8]), dtype=torch.float32), x[[6, 8]])
        with pytest.raises(CorruptPageError, match=f"byte {7 * 8192 + 4096}: page 15 fails"):
            t.gather(torch.tensor([8, 7]))


def test_verify_table_reports_every_bad_page(table):
    d, _ = table
    _flip(d / "values.bin", BAD_BYTE)
    _flip(d / "values.bin", 40 * 4096)
    rep = verify_table(d)
    assert not rep.ok and rep.files[0]["bad_pages"] == [BAD_PAGE, 40]
    assert {e.offset for e in rep.errors if isinstance(e, CorruptPageError)} == {BAD_PAGE * 4096, 40 * 4096}


def test_background_verification_finds_a_bad_page(table):
    d, _ = table
    with open_table(d, "disk", device="cpu", io="buffered", background_verify=True) as t:
        assert t.scrubber.wait(30)
        st = t.stats()
        assert (st["verify_state"], st["verified_pages"], st["corrupt_pages"]) == ("done", 63, 0)
    _flip(d / "values.bin", BAD_BYTE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_table(d, "disk", device="cpu", io="buffered", background_verify=True) as t:
            assert t.scrubber.wait(30)
            st = t.stats()
    assert (st["verify_state"], st["corrupt_pages"]) == ("done", 1)
    assert any(f"byte {BAD_PAGE * 4096}: page {BAD_PAGE}" in str(w.message) for w in caught)
    with open_table(d, "disk", device="cpu", io="buffered") as t:
        assert t.scrubber is None and "verify_state" not in t.stats()  # off by default


def test_old_format_is_refused_on_disk_then_upgraded(table, capsys):
    d, ref = table
    _downgrade(d)
    with pytest.raises(TableFormatError) as e:
        open_table(d, "disk", device="cpu")
    assert e.value.file == str(d / MANIFEST)
    assert f"engram convert --add-checksums {d}" in str(e.value) and "format_version 1" in str(e.value)
    ids = torch.tensor([5, 999, 320])
    for tier in ("gpu", "host"):  # the resident tiers check chunk CRCs while loading: format 1 still opens
        with open_table(d, tier, device="cpu") as t:
            assert torch.equal(_bits(t.gather(ids, dtype=torch.float32)), _bits(ref[ids]))
    assert verify_table(d).ok
    assert main(["convert", "--add-checksums", str(d), "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert out == {"table": str(d), "format_version": 2, "pages": 63, "added": True}
    m = read_manifest(d)
    assert m.format_version == 2 and verify_table(d).ok
    with open_table(d, "disk", device="cpu", io="buffered") as t:
        assert torch.equal(_bits(t.gather(ids, dtype=torch.float32)), _bits(ref[ids]))
    assert main(["convert", "--add-checksums", str(d), "--no-progress"]) == 0  # already there: unchanged
    assert json.loads(capsys.readouterr().out.strip())["added"] is False
    assert sorted(p.name for p in d.iterdir()) == [MANIFEST, "scales.bin", "values.bin", PAGE_CRC_FILE]


def test_add_checksums_refuses_a_damaged_table_and_writes_nothing(table, capsys):
    d, _ = table
    _downgrade(d)
    before = (d / MANIFEST).read_bytes()
    _flip(d / "values.bin", BAD_BYTE)
    assert main(["convert", "--add-checksums", str(d), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"values.bin: byte {BAD_BYTE // 16384 * 16384}: checksum mismatch in chunk {BAD_BYTE // 16384}" in err
    assert (d / MANIFEST).read_bytes() == before and not (d / PAGE_CRC_FILE).exists()
    assert main(["convert", "--add-checksums", "--no-progress"]) == 2
    assert "needs table directories" in capsys.readouterr().err


def test_cached_preset_tables_of_format_1_get_their_checksums(tmp_path):
    from engram.config import EngramConfig
    from engram.model.tables import ensure_preset_tables, open_tables
    cfg = EngramConfig.preset("tiny")
    dirs = ensure_preset_tables(cfg, 0, cache_dir=tmp_path, progress=False)
    for d in dirs.values():
        _downgrade(d)  # as a cache made before format 2 holds them
    assert ensure_preset_tables(cfg, 0, cache_dir=tmp_path, progress=False) == dirs
    assert all(read_manifest(d).format_version == 2 for d in dirs.values())
    tables = open_tables(dirs, cfg, "disk", "cpu", {"io": "buffered"})
    assert all(t.gather(torch.tensor([0, 5])).shape == (2, cfg.head_dim) for t in tables.values())


def test_add_checksums_removes_the_files_a_killed_upgrade_left(table, capsys):
    """An upgrade killed between writing its temporary sidecar and renaming it leaves
    ``.values.crc32c.partial-HOST-PID-N``; the next upgrade of that table removes such files of dead processes
    (and says so), and leaves those of a process still running."""
    import os
    import subprocess
    import sys
    import warnings

    from engram.store.writer import _host

    d, _ = table
    _downgrade(d)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a real process that no longer runs
    dead = d / f".{PAGE_CRC_FILE}.partial-{_host()}-{gone.pid}-1"
    live = d / f".{MANIFEST}.partial-{_host()}-{os.getpid()}-1"
    dead.write_bytes(b"\0" * 4096)
    live.write_bytes(b"{}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["convert", "--add-checksums", str(d), "--no-progress"]) == 0
    assert not dead.exists() and live.exists()
    assert any(f"removed {dead} (4096 bytes): an unfinished file left by process {gone.pid}" in str(w.message)
               for w in caught)
    assert read_manifest(d).format_version == 2
