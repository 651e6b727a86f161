"""Every tier names what is wrong with a table the same way, on real files: a corrupt values.bin page by its
page number and byte offset (gpu and host tiers as the disk tier does), a file that shrank under the disk
tier by its real size, without "[Errno 0]"."""
from __future__ import annotations

import os

import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import TableFormatError, open_table, write_table
from engram.store.page_crc import CorruptPageError
from engram.store.reader import DiskReadError

ROWS, DIM = 5000, 256  # 16 rows of 256 B per 4 KiB page: 313 pages, one 1.28 MB chunk


@pytest.fixture
def table(tmp_path):
    torch.manual_seed(0)
    v, s = quantize_mxfp8(torch.randn(ROWS, DIM))
    write_table(tmp_path / "t", v, s)
    return tmp_path / "t"


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("page", [0, 17, 312])
def test_every_tier_names_the_corrupt_page(table, page):
    _flip(table / "values.bin", page * 4096 + 100)
    errors = {}
    for tier in ("gpu", "host"):
        with pytest.raises(CorruptPageError) as e:
            open_table(table, tier=tier, device="cpu")
        errors[tier] = e.value
    disk = open_table(table, tier="disk", io="buffered")
    with pytest.raises(CorruptPageError) as e:
        disk.gather(torch.arange(ROWS))
    errors["disk"] = e.value
    for tier, err in errors.items():
        assert isinstance(err, TableFormatError)
        assert err.offset == page * 4096 and f"page {page} fails its checksum" in str(err), (tier, str(err))
        assert err.file.endswith("values.bin"), (tier, err.file)
    assert "chunk 0" in str(errors["gpu"])  # the chunk check that found it is still named


def test_a_corrupt_scales_file_still_names_its_chunk(table):
    _flip(table / "scales.bin", 10)
    with pytest.raises(TableFormatError, match=r"scales\.bin: byte 0: checksum mismatch in chunk 0"):
        open_table(table, tier="gpu", device="cpu")


def test_disk_short_read_quotes_the_real_file_size(table):
    t = open_table(table, tier="disk", io="buffered")
    assert t.gather(torch.arange(4)).shape == (4, DIM)
    os.truncate(table / "values.bin", 8192)  # the same inode shrinks under the open table
    with pytest.raises(DiskReadError) as e:
        t.gather(torch.tensor([ROWS - 1]))
    msg = str(e.value)
    assert "short read" in msg and "file is 8192 bytes now" in msg, msg
    assert "[Errno 0]" not in msg and str(os.path.getsize(table / "values.bin")) in msg
    assert e.value.errno == 0 and e.value.offset == (ROWS - 1) // 16 * 4096
