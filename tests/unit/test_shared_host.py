"""The node's one copy of a table (store/shared_host.py) in one process: opened twice it is created once and mapped
once, rows bitwise the private host tier's (packed, split, built in memory, the disk tier's resident parts); the last
close unlinks it; a segment whose header fails, names another table or has another size is never mapped; a creator's
leftover temporary file is removed; no room in the directory is a clear error before anything is filled."""
from __future__ import annotations

import gc
import os
import struct

import pytest
import torch

from engram.config import EngramConfig
from engram.model.tables import open_random_table, open_random_tables
from engram.quant import quantize_mxfp8
from engram.store import open_table, read_manifest, write_table
from engram.store import shared_host
from engram.store.options import StoreOptions
from engram.store.shared_host import HEADER_BYTES, SharedMemoryError, segment_path, shared_target
from engram.store.shared_preflight import check_shared, shared_parts

ROWS = 3000


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    v, s = quantize_mxfp8(torch.randn(ROWS, 256, generator=g))
    path = tmp_path_factory.mktemp("shared") / "t"
    write_table(path, v, s, chunk_bytes=1 << 16)
    return path


def _segments(d) -> list[str]:
    return sorted(p.name.rsplit("-", 1)[1] for p in d.iterdir() if not p.name.endswith(".lock"))


def _same(a, b, ids) -> bool:
    return torch.equal(a.gather(ids).view(torch.uint8), b.gather(ids).view(torch.uint8))


@pytest.mark.parametrize("layout", ["packed", "split"])
def test_two_opens_create_once_map_once_and_the_last_close_unlinks(table, shm_dir, layout):
    before = shared_host.shared_stats()
    opts = dict(shared_memory=True, shm_dir=str(shm_dir), host_layout=layout)
    a, b = open_table(table, tier="host", **opts), open_table(table, tier="host", **opts)
    private = open_table(table, tier="host", host_layout=layout)
    after = shared_host.shared_stats()
    assert (after["created"] - before["created"], after["mapped"] - before["mapped"]) == (1, 1) if layout == "packed" \
        else (2, 2)
    assert _segments(shm_dir) == (["packed"] if layout == "packed" else ["scales", "values"])
    ids = torch.randint(0, ROWS, (500,), generator=torch.Generator().manual_seed(0))
    assert _same(a, private, ids) and _same(b, private, ids)
    assert a.values.data_ptr() != b.values.data_ptr()  # two mappings of one file
    a.close()
    del a
    gc.collect()
    assert _segments(shm_dir)  # b still maps it
    b.close()
    del b
    gc.collect()
    assert _segments(shm_dir) == []


def test_disk_tier_shares_its_scales_and_page_checksums(table, shm_dir):
    d = open_table(table, tier="disk", shared_memory=True, shm_dir=str(shm_dir), io="buffered")
    assert _segments(shm_dir) == ["page_crc", "scales"]
    ids = torch.randint(0, ROWS, (300,), generator=torch.Generator().manual_seed(1))
    assert _same(d, open_table(table, tier="host"), ids)
    m = read_manifest(table)
    assert dict(shared_parts(m, "disk")) == {"scales": m.files["scales"].bytes, "page_crc": m.files["page_crc"].bytes}


def test_tables_built_in_memory_are_shared_and_equal_the_private_build(shm_dir):
    cfg = EngramConfig.preset("tiny")
    opts = StoreOptions(shared_memory=True).replace(shm_dir=str(shm_dir))
    shared = open_random_tables(cfg, seed=5, tier="host", options=opts, progress=False)
    again = open_random_tables(cfg, seed=5, tier="host", options=opts, progress=False)
    private = open_random_tables(cfg, seed=5, tier="host", progress=False)
    assert len(_segments(shm_dir)) == len(cfg.layer_ids)  # one packed segment per layer, mapped by both
    for lid in cfg.layer_ids:
        ids = torch.arange(cfg.table_rows(lid))
        assert _same(shared[lid], private[lid], ids) and _same(again[lid], private[lid], ids)
    other_seed = open_random_table(cfg, cfg.layer_ids[0], seed=6, tier="host", options=opts, progress=False)
    assert len(_segments(shm_dir)) == len(cfg.layer_ids) + 1  # another seed is another table
    assert not _same(other_seed, private[cfg.layer_ids[0]], torch.arange(64))


def _write_segment_header(path, **change) -> None:
    """Rewrite a segment's header with fields changed (CRC recomputed unless ``crc`` is given)."""
    with open(path, "r+b") as f:
        raw = f.read(shared_host._HEAD.size)
        fields = list(shared_host._HEAD.unpack(raw))
        names = ["magic", "version", "header", "nbytes", "key", "part", "pid", "created"]
        for k, v in change.items():
            if k != "crc":
                fields[names.index(k)] = v
        head = shared_host._HEAD.pack(*fields)
        f.seek(0)
        f.write(head + struct.pack("<I", change.get("crc", shared_host.zlib.crc32(head))))


@pytest.mark.parametrize("defect", ["crc", "nbytes", "key"])
def test_a_bad_segment_in_use_is_refused_and_one_nobody_maps_is_rebuilt(table, shm_dir, defect):
    opts = dict(shared_memory=True, shm_dir=str(shm_dir))
    target = shared_target(read_manifest(table), str(shm_dir))
    path = segment_path(target, "packed")
    first = open_table(table, tier="host", **opts)
    whole = path.read_bytes()
    change = {"crc": 1234, "nbytes": 7, "key": b"0" * 32}[defect]
    _write_segment_header(path, **{defect: change})
    with pytest.raises(SharedMemoryError, match=str(path)):  # `first` maps it: never removed under a reader
        open_table(table, tier="host", **opts)
    first.close()
    del first
    gc.collect()
    assert not path.exists()  # the last close unlinks it
    path.write_bytes(whole)
    _write_segment_header(path, **{defect: change})  # a bad segment that no process maps
    rebuilt = open_table(table, tier="host", **opts)  # removed, built again from the files
    assert _same(rebuilt, open_table(table, tier="host"), torch.arange(ROWS))
    size = os.path.getsize(path)
    assert shared_host._check_header(path.read_bytes()[:HEADER_BYTES], target, "packed", size - HEADER_BYTES,
                                     size)[0] is None


def test_a_creators_leftover_temporary_file_is_removed(table, shm_dir):
    path = segment_path(shared_target(read_manifest(table), str(shm_dir)), "packed")
    stale = path.with_name(path.name + ".tmp-999999")
    stale.write_bytes(b"half a table")
    t = open_table(table, tier="host", shared_memory=True, shm_dir=str(shm_dir))
    assert not stale.exists() and path.exists()
    assert _same(t, open_table(table, tier="host"), torch.arange(ROWS))


def test_no_room_in_the_directory_is_a_clear_error_before_anything_is_filled(shm_dir):
    m = shared_host_manifest(rows=1 << 36)  # 17 TiB of packed rows: more than any /dev/shm_dir here
    opts = StoreOptions(shared_memory=True).replace(shm_dir=str(shm_dir))
    with pytest.raises(SharedMemoryError, match=r"free of .* need .* more; enlarge it .*shared_memory off"):
        check_shared([m], "host", opts)
    assert list(shm_dir.iterdir()) == []
    with pytest.raises(SharedMemoryError, match="shm_dir='/no/such/dir'"):
        check_shared([m], "host", opts.replace(shm_dir="/no/such/dir"))


def shared_host_manifest(rows: int):
    """A manifest of ``rows`` MXFP8 rows of 256 values built in memory (no files), as model/tables.py makes them."""
    from pathlib import Path

    from engram.store.format import TableManifest, row_stride

    return TableManifest(path=Path("memory:test/layer0"), rows=rows, dim=256, row_dtype="mxfp8",
                         row_stride=row_stride(256), files={}, layer_id=0, meta={"in_memory": True})


def test_shm_dir_must_be_absolute():
    with pytest.raises(ValueError, match=r"engram_config.advanced.shm_dir='shm_dir': must be an absolute path"):
        StoreOptions.from_dict({"shared_memory": True, "advanced": {"shm_dir": "shm_dir"}})


def test_the_memory_preflight_does_not_count_a_copy_another_process_made(table):
    from engram.store.preflight import MemoryBudget, MemoryPreflightError, preflight

    m = read_manifest(table)
    size = ROWS * 272
    budget = MemoryBudget(ram=size, device=None)  # less than the table once the headroom is kept
    with pytest.raises(MemoryPreflightError):
        preflight(m, "host", torch.device("cpu"), budget=budget)
    need = preflight(m, "host", torch.device("cpu"), budget=budget, mapped_bytes=size)
    assert need.host_total == 0
