"""Preset tables built straight in memory (``tables_in_memory``): the rows are bitwise the file-generated
table's, the objects are the tiers' usual GpuTable / HostTable, and the option is validated and refused
where it cannot apply. CPU, small tables; chunks are shrunk so every table spans many generator chunks."""
from __future__ import annotations

import pytest
import torch

from engram.model.options import RuntimeOptions
from engram.model.loader import load_model, save_model
from engram.model.presets import preset_config
from engram.model.tables import (generate_random_table, open_random_table, open_random_tables, random_manifest,
                                 random_rows)
from engram.store import MemoryPreflightError, StoreOptions, convert, load, open_table, read_manifest
from engram.store import preflight
from engram.store.convert import convert_random
from engram.store.gpu import GpuTable
from engram.store.host import HostTable
from engram.store.build import RowChunks, build_table
from engram.store.load import load_table

SEED = 5


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.fixture
def small_chunks(monkeypatch):
    """convert_random's chunks (and random_rows', which follow them) shrunk to 8 KiB of values."""
    monkeypatch.setattr(convert, "RANDOM_CHUNK_BYTES", 8192)


@pytest.mark.parametrize("row_dtype,dim,rows", [("mxfp8", 64, 1000), ("mxfp8", 96, 333), ("bf16", 40, 250),
                                                ("fp32", 48, 77)])
def test_built_rows_equal_convert_random_files(tmp_path, small_chunks, row_dtype, dim, rows):
    """build_table over random_rows equals load_table of convert_random's files byte for byte (padding too),
    in every layout and target, whatever the number of workers or device windows."""
    convert_random(tmp_path / "t", rows, dim, seed=SEED, row_dtype=row_dtype, progress=False, chunk_bytes=4096)
    m = read_manifest(tmp_path / "t")
    chunks = random_rows(rows, dim, SEED, row_dtype)
    assert chunks.rows < rows  # several chunks, the last one short
    for layout in ("split", "packed"):
        want = load_table(m, "ram", layout=layout)
        for threads in (1, 3):
            got = build_table(m, chunks, "pinned", layout=layout, threads=threads)
            for g, w in zip(got, want):
                assert (g is None) == (w is None)
                if w is not None:
                    assert g.shape == w.shape and torch.equal(_bits(g), _bits(w))
    # a device target (here the CPU device: the windowed code path CUDA takes), windows of two chunks
    load.DEVICE_WINDOW, old = 2 * chunks.rows * (m.row_stride + m.scale_cols), load.DEVICE_WINDOW
    try:
        got = build_table(m, chunks, torch.device("cpu"), threads=2)
    finally:
        load.DEVICE_WINDOW = old
    want = load_table(m, torch.device("cpu"))
    assert torch.equal(got[0], want[0]) and (want[1] is None or torch.equal(got[1], want[1]))


def test_preset_tables_equal_the_generated_files(tmp_path, small_chunks):
    """Every layer of the tiny preset, on tier gpu and host (both layouts): the rows, the decoded rows, the
    class, ``gathers_on_device`` and the stats equal those of the table generated to files."""
    cfg = preset_config("tiny").engram
    g = torch.Generator().manual_seed(0)
    for lid in cfg.layer_ids:
        generate_random_table(tmp_path / f"layer{lid}", cfg, lid, SEED, progress=False)
        all_ids = torch.arange(cfg.table_rows(lid))
        ids = torch.randint(0, cfg.table_rows(lid), (500,), generator=g)
        for tier, opts in (("gpu", {}), ("host", {"host_layout": "packed"}), ("host", {"host_layout": "split"}),
                           ("host", {"cache_rows": 64})):
            f = open_table(tmp_path / f"layer{lid}", tier, device="cpu", expect=cfg.fingerprint(lid), **opts)
            t = open_random_table(cfg, lid, SEED, tier, "cpu", StoreOptions().replace(**opts), progress=False)
            assert type(t) is type(f) is (GpuTable if tier == "gpu" else HostTable)
            assert t.manifest.fingerprint == f.manifest.fingerprint and t.rows == f.rows
            assert torch.equal(t.gather_raw(all_ids), f.gather_raw(all_ids))
            assert torch.equal(_bits(t.gather(ids)), _bits(f.gather(ids)))
            assert torch.equal(_bits(t.submit(ids, dtype=torch.float32).wait()),
                               _bits(f.gather(ids, dtype=torch.float32)))
            assert t.gathers_on_device == f.gathers_on_device
            assert t.stats() == f.stats()
            assert str(t.manifest.path) == f"memory:random-seed{SEED}/layer{lid}"


def test_loader_option_builds_tables_without_files(tmp_path):
    """``tables_in_memory``: no table directory, no file in the cache; the rows equal the cached tables'."""
    mem = load_model("tiny", tier="host", dtype="float32", device="cpu", cache_dir=tmp_path / "mem",
                     engram_config={"tables_in_memory": True, "seed": SEED}, progress=False)
    assert mem.table_dirs == {} and mem.memory_table_seed == SEED and not (tmp_path / "mem").exists()
    files = load_model("tiny", tier="host", dtype="float32", device="cpu", cache_dir=tmp_path / "files",
                       engram_config={"seed": SEED}, progress=False)
    tables, ref = mem.open_tables(), files.open_tables()
    assert sorted(tables) == sorted(ref) and all(isinstance(t, HostTable) for t in tables.values())
    for lid, t in tables.items():
        ids = torch.arange(t.rows)
        assert torch.equal(t.gather_raw(ids), ref[lid].gather_raw(ids))
    with pytest.raises(ValueError, match="built in memory .*tables_in_memory"):
        save_model(tmp_path / "ckpt", mem)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_option_is_validated_at_construction(value):
    with pytest.raises(ValueError, match=rf"^engram_config.tables_in_memory={value!r}: must be true or false"):
        RuntimeOptions.from_dict({"tables_in_memory": value})
    assert RuntimeOptions.from_dict({"tables_in_memory": True}).tables_in_memory


def test_disk_tier_and_checkpoints_are_refused(tmp_path):
    opts = RuntimeOptions.from_dict({"tables_in_memory": True})
    with pytest.raises(ValueError, match="tables_in_memory=true: tier 'disk' serves tables from their files"):
        opts.tier("disk")
    assert opts.tier("host") == "host"
    with pytest.raises(ValueError, match="tables_in_memory=true: tier 'disk'"):
        load_model("tiny", tier="disk", device="cpu", engram_config={"tables_in_memory": True}, progress=False)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match=r"tables_in_memory=true builds a preset's random tables .* is a checkpoint"):
        load_model(tmp_path / "ckpt", device="cpu", engram_config={"tables_in_memory": True}, progress=False)
    cfg = preset_config("tiny").engram
    with pytest.raises(ValueError, match="memory:random-seed0/layer1: tier 'disk' serves tables from their files"):
        open_random_table(cfg, 1, 0, "disk", "cpu")
    with pytest.raises(ValueError, match="cache_rows=8: the gpu tier .* takes no cache"):
        open_random_tables(cfg, 0, "gpu", "cpu", {"cache_rows": 8})


def test_memory_preflight_runs_before_anything_is_built(monkeypatch):
    cfg = preset_config("tiny").engram
    monkeypatch.setattr(preflight, "machine_budget",
                        lambda device=None: preflight.MemoryBudget(ram=1 << 16, device=None))
    with pytest.raises(MemoryPreflightError, match="table memory:random-seed0/layer1 .* does not fit on tier 'host'"):
        open_random_table(cfg, 1, 0, "host", "cpu", progress=False)
    assert open_random_table(cfg, 1, 0, "host", "cpu", StoreOptions().replace(check_memory=False), progress=False).rows


def test_a_failing_chunk_raises_and_nothing_is_kept():
    m = random_manifest(preset_config("tiny").engram, 1, 0)
    made = []

    def make(k):
        if k == 3:
            raise RuntimeError("chunk 3 broke")
        made.append(k)
        return torch.zeros(min(100, m.rows - 100 * k), m.value_bytes, dtype=torch.uint8), \
            torch.zeros(min(100, m.rows - 100 * k), m.scale_cols, dtype=torch.uint8)

    for target in ("pinned", torch.device("cpu")):
        with pytest.raises(RuntimeError, match="chunk 3 broke"):
            build_table(m, RowChunks(100, make), target, threads=2)
    with pytest.raises(ValueError, match=r"chunk 0 made uint8 shapes \(\(100, 64\), \(100, 2\)\), expected"):
        build_table(m, RowChunks(100, lambda k: (torch.zeros(100, 64, dtype=torch.uint8),
                                                 torch.zeros(100, 2, dtype=torch.uint8))), "ram", threads=1)


def test_progress_bar_only_on_a_terminal(capsys):
    bar = load._bar(True, 10, "build", tty_only=True)  # pytest captures stderr: not a terminal
    assert bar.disable
    bar.close()
