"""Table format: stride rule, manifest round trip, and every defect refused with file + byte offset."""
from __future__ import annotations

import json
import os

import pytest
import torch

import engram
from engram.quant import quantize_mxfp8
from engram.store import TableFormatError, TableWriter, open_table, read_manifest, verify_table, write_table
from engram.store.format import MANIFEST, PAGE_SIZE, row_stride

CHUNK = 8192  # small checksum chunks so a few-KB table has several


def _mx_table(rows=700, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_mxfp8(torch.randn(rows, dim, generator=g))


@pytest.fixture
def table_dir(tmp_path):
    v, s = _mx_table()
    d = tmp_path / "t"
    write_table(d, v, s, meta={"layer_id": 3, "note": "x"}, chunk_bytes=CHUNK)
    return d


@pytest.mark.parametrize("value_bytes,stride", [(1, 1), (32, 32), (64, 64), (192, 256), (256, 256), (264, 512),
                                                (4096, 4096), (4097, 8192), (12288, 12288)])
def test_row_stride_never_straddles_a_page(value_bytes, stride):
    assert row_stride(value_bytes) == stride
    assert PAGE_SIZE % stride == 0 or stride % PAGE_SIZE == 0
    for r in range(0, 3 * max(1, PAGE_SIZE // stride)):  # first and last byte of a row are on one page
        if stride <= PAGE_SIZE:
            assert (r * stride) // PAGE_SIZE == (r * stride + value_bytes - 1) // PAGE_SIZE


def test_manifest_round_trip(table_dir):
    m = read_manifest(table_dir)
    assert (m.rows, m.dim, m.row_dtype, m.row_stride, m.layer_id) == (700, 64, "mxfp8", 64, 3)
    assert m.meta == {"note": "x"}
    assert m.files["values"].bytes == 700 * 64 + (-700 * 64) % PAGE_SIZE  # padded to whole pages
    assert m.files["scales"].bytes == 700 * 2
    assert len(m.files["values"].crc32) == -(-m.files["values"].bytes // CHUNK)
    doc = json.loads((table_dir / MANIFEST).read_text())
    assert doc["format_version"] == 2 and doc["scale_block"] == 32 and doc["page_size"] == 4096
    rep = verify_table(table_dir)
    assert rep.ok and rep.bytes_checked == sum(f.bytes for f in m.files.values())  # values, scales, page CRCs
    assert m.files["page_crc"].bytes == m.pages * 4 and rep.files[0]["bad_pages"] == []


def test_padded_float_rows(tmp_path):
    x = torch.randn(50, 96).to(torch.bfloat16)  # 192 value bytes -> stride 256
    m = write_table(tmp_path / "b", x)
    assert (m.row_dtype, m.row_stride, m.scale_cols) == ("bf16", 256, 0)
    raw = (tmp_path / "b" / "values.bin").read_bytes()
    assert raw[192:256] == bytes(64)  # the padding is zeros
    t = open_table(tmp_path / "b", "gpu", device="cpu")
    assert torch.equal(t.gather(torch.arange(50)).view(torch.uint8), x.view(torch.uint8))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


# ids avoid the bare word "gpu": tests/conftest.py skips every test whose keywords contain it.
@pytest.mark.parametrize("tier", ["gpu", "host"], ids=["gpu-tier", "host-tier"])
def test_wrong_checksum_names_file_and_chunk_offset(table_dir, tier):
    _flip(table_dir / "values.bin", 3 * CHUNK + 77)
    with pytest.raises(TableFormatError) as e:
        open_table(table_dir, tier, device="cpu")
    assert e.value.file.endswith("values.bin") and e.value.offset == 3 * CHUNK
    assert "checksum" in str(e.value) and f"byte {3 * CHUNK}" in str(e.value)
    rep = verify_table(table_dir)
    assert not rep.ok and rep.files[0]["bad_chunks"] == [3]
    assert rep.errors[0].offset == 3 * CHUNK


def test_wrong_scale_checksum(table_dir):
    _flip(table_dir / "scales.bin", 5)
    with pytest.raises(TableFormatError) as e:
        open_table(table_dir, "gpu", device="cpu")
    assert e.value.file.endswith("scales.bin") and e.value.offset == 0


def test_truncated_and_too_long(table_dir):
    vals = table_dir / "values.bin"
    size = vals.stat().st_size
    os.truncate(vals, size - 100)
    with pytest.raises(TableFormatError) as e:
        open_table(table_dir, "gpu", device="cpu")
    assert e.value.file.endswith("values.bin") and e.value.offset == size - 100 and "truncated" in str(e.value)
    with open(vals, "ab") as f:
        f.write(bytes(300))
    with pytest.raises(TableFormatError) as e:
        read_manifest(table_dir)
    assert e.value.offset == size and "too long" in str(e.value)
    assert not verify_table(table_dir).ok


def test_missing_data_file(table_dir):
    (table_dir / "scales.bin").unlink()
    with pytest.raises(TableFormatError, match="scales.bin: byte 0: data file is missing"):
        open_table(table_dir, "host", device="cpu")


def test_wrong_size_in_manifest(table_dir):
    doc = json.loads((table_dir / MANIFEST).read_text())
    doc["rows"] = 1000  # values.bin and scales.bin would need more bytes
    (table_dir / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(TableFormatError) as e:
        read_manifest(table_dir)
    assert e.value.file.endswith(MANIFEST) and "'bytes'" in str(e.value)
    assert e.value.offset == (table_dir / MANIFEST).read_text().find('"bytes"')


@pytest.mark.parametrize("field,value,needle", [("row_stride", 128, "row_stride"),
                                                ("format_version", 9, "not supported"),
                                                ("row_dtype", "int4", "row_dtype"), ("scale_block", 16, "scale_block")])
def test_bad_manifest_fields(table_dir, field, value, needle):
    doc = json.loads((table_dir / MANIFEST).read_text())
    doc[field] = value
    text = json.dumps(doc)
    (table_dir / MANIFEST).write_text(text)
    with pytest.raises(TableFormatError, match=needle) as e:
        read_manifest(table_dir)
    assert e.value.offset == text.find(f'"{field}"')


def test_invalid_json_offset(table_dir):
    text = (table_dir / MANIFEST).read_text()
    (table_dir / MANIFEST).write_text(text[:40])
    with pytest.raises(TableFormatError, match="invalid JSON") as e:
        read_manifest(table_dir)
    assert 0 < e.value.offset <= 40


def test_half_written_table_is_refused(tmp_path):
    v, s = _mx_table()
    target = tmp_path / "t"
    w = TableWriter(target, 700, 64, "mxfp8", chunk_bytes=CHUNK, sync=False)
    w.append(v[:300], s[:300])  # the process "dies" here: no finish()
    for sink in (w._values, w._scales):
        sink.close(sync=False)  # flush what was written, as the OS would
    assert not target.exists()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".t.partial-")]
    assert len(partial) == 1 and (partial[0] / "values.bin").stat().st_size == 300 * 64
    with pytest.raises(TableFormatError, match="manifest.json: byte 0: missing"):
        open_table(partial[0], "gpu", device="cpu")


def test_writer_error_leaves_nothing_and_keeps_old_table(table_dir):
    before = (table_dir / "values.bin").read_bytes()
    v, s = _mx_table(rows=10, seed=1)
    with pytest.raises(ValueError, match="10 rows written, the table was declared with 20"):
        with TableWriter(table_dir, 20, 64) as w:
            w.append(v, s)
    assert (table_dir / "values.bin").read_bytes() == before
    assert [p.name for p in table_dir.parent.iterdir()] == ["t"]
    write_table(table_dir, v, s)  # a complete new table replaces the old one
    assert read_manifest(table_dir).rows == 10
    assert [p.name for p in table_dir.parent.iterdir()] == ["t"]


def test_writer_refuses_foreign_directory(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "precious.txt").write_text("keep")
    v, s = _mx_table(rows=4)
    with pytest.raises(FileExistsError, match="not an engram table"):
        write_table(tmp_path / "d", v, s)
    assert (tmp_path / "d" / "precious.txt").read_text() == "keep"


def test_write_table_input_checks(tmp_path):
    v, s = _mx_table(rows=4)
    with pytest.raises(ValueError, match="need scales"):
        write_table(tmp_path / "a", v)
    with pytest.raises(ValueError, match="does not match values"):
        write_table(tmp_path / "a", v, s[:3])
    with pytest.raises(ValueError, match="not a row dtype"):
        write_table(tmp_path / "a", torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="take no scales"):
        with TableWriter(tmp_path / "b", 4, 32, "fp32") as w:
            w.append(torch.zeros(4, 32), s[:, :1])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_e8m0_scale_tensor_accepted(tmp_path):
    v, s = _mx_table(rows=8)
    write_table(tmp_path / "e", v, s.view(torch.float8_e8m0fnu))
    assert (tmp_path / "e" / "scales.bin").read_bytes() == s.numpy().tobytes()


def test_layout_fingerprint(tmp_path):
    cfg = engram.EngramConfig.preset("tiny")
    rows = cfg.table_rows(1)
    v, s = _mx_table(rows=rows, dim=cfg.head_dim)
    write_table(tmp_path / "l1", v, s, meta={"layer_id": 1, "fingerprint": cfg.fingerprint(1)})
    open_table(tmp_path / "l1", "gpu", device="cpu", expect=cfg.fingerprint(1))
    other = cfg.replace(vocab_size=(1013, 1511))  # another layout with other primes
    with pytest.raises(TableFormatError, match="fingerprint mismatch") as e:
        open_table(tmp_path / "l1", "gpu", device="cpu", expect=other.fingerprint(1))
    assert e.value.file.endswith(MANIFEST)
    assert e.value.offset == (tmp_path / "l1" / MANIFEST).read_text().find('"fingerprint"')
    with pytest.raises(TableFormatError, match="layer_id"):
        open_table(tmp_path / "l1", "host", device="cpu", expect={**cfg.fingerprint(1), "layer_id": 3})


def test_fingerprint_missing_checks_size(tmp_path):
    v, s = _mx_table(rows=64, dim=32)
    write_table(tmp_path / "r", v, s)
    open_table(tmp_path / "r", "gpu", device="cpu", expect={"rows": 64, "head_dim": 32})
    with pytest.raises(TableFormatError, match="rows=64, expected 65"):
        open_table(tmp_path / "r", "gpu", device="cpu", expect={"rows": 65, "head_dim": 32})
