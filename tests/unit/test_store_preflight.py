"""Memory preflight: per-tier needs, refusal messages with sizes and a fitting option, real open_table refusal."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engram.store import MemoryPreflightError, open_table, read_manifest, write_table
from engram.store.format import MANIFEST, values_file_bytes
from engram.store.preflight import GiB, MemoryBudget, machine_budget, memory_need, preflight

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def manifest(tmp_path):
    """A real 64-row table whose manifest is then told to describe 2**30 rows of 256-B MXFP8 (sizes only)."""
    from engram.quant import quantize_mxfp8
    write_table(tmp_path / "t", *quantize_mxfp8(torch.randn(64, 256)))
    m = read_manifest(tmp_path / "t")
    m.rows = 1 << 30  # 256 GiB of values, 8 GiB of scales, 256 MiB of page CRCs
    m.files["page_crc"].bytes = (256 << 30) // 4096 * 4
    return m


def test_needs_per_tier(manifest):
    v, s = 256 << 30, 8 << 30
    assert memory_need(manifest, "gpu", CPU).ram == v + s
    need = memory_need(manifest, "gpu", CUDA)
    assert (need.ram, need.device) == (0, v + s)
    split = memory_need(manifest, "host", CPU, cache_rows=1000, host_layout="split")  # pinned with CUDA, else RAM
    assert split.host_total == v + s + 1000 * (256 + 8 + 24) and split.pinned == (v + s) * torch.cuda.is_available()
    packed = memory_need(manifest, "host", CPU, cache_rows=1000)  # the default: one 272-B row per id
    p = (1 << 30) * 272
    assert packed.host_total == p + 1000 * (256 + 8 + 24) and packed.pinned == p * torch.cuda.is_available()
    assert packed.parts["packed rows"] == p
    disk = memory_need(manifest, "disk", CUDA, cache_rows=1 << 20)
    assert disk.ram == s + (256 << 20) + 2 * 2048 * 4096 and disk.device == (1 << 20) * 288
    with pytest.raises(ValueError, match="tier="):
        memory_need(manifest, "tape", CPU)


def test_refusal_names_sizes_and_a_tier_that_fits(manifest):
    budget = MemoryBudget(ram=64 * GiB, device=None)
    with pytest.raises(MemoryPreflightError) as e:
        preflight(manifest, "gpu", CPU, budget=budget)
    msg = str(e.value)
    assert "264.00 GiB of RAM" in msg and "57.60 GiB is usable" in msg and "values 256.00 GiB" in msg
    assert "Would fit: tier='disk'" in msg and "tier='host'" not in msg.split("Would fit")[1]


def test_refusal_suggests_the_largest_cache_that_fits(manifest):
    budget = MemoryBudget(ram=16 * GiB, device=None)
    with pytest.raises(MemoryPreflightError) as e:
        preflight(manifest, "disk", CPU, cache_rows=1 << 26, budget=budget)  # 18 GiB of cache asked
    msg = str(e.value)
    assert "cache 18.00 GiB" in msg
    rows = int(msg.split("tier='disk' with cache_rows=")[1].split(".")[0].split(" ")[0])
    usable = int(16 * GiB * 0.9) - (8 << 30) - (256 << 20) - 2 * 2048 * 4096  # scales, page CRCs, page buffers
    assert rows == usable // 288  # exactly the largest cache that fits
    preflight(manifest, "disk", CPU, cache_rows=rows, budget=budget)
    with pytest.raises(MemoryPreflightError):
        preflight(manifest, "disk", CPU, cache_rows=rows + 1, budget=budget)


def test_device_memory_and_nothing_fits(manifest):
    with pytest.raises(MemoryPreflightError, match="of device memory") as e:
        preflight(manifest, "gpu", CUDA, budget=MemoryBudget(ram=1 << 40, device=80 * GiB))
    assert "tier='host'" in str(e.value)
    with pytest.raises(MemoryPreflightError, match="No tier fits"):
        preflight(manifest, "host", CPU, budget=MemoryBudget(ram=4 * GiB, device=None))
    assert preflight(manifest, "disk", CPU, budget=MemoryBudget(ram=None, device=None)).ram > 0  # unknown: no check


def test_machine_budget_reads_this_machine():
    b = machine_budget(CPU)
    assert b.ram is None or b.ram > 0
    assert b.device is None


def test_open_table_refuses_before_loading(tmp_path):
    """A sparse 1 TiB table: sizes are real, so read_manifest accepts it; the preflight stops the load."""
    d = tmp_path / "big"
    write_table(d, torch.zeros(8, 64))
    m = read_manifest(d)
    doc = json.loads((d / MANIFEST).read_text())
    rows = (1 << 40) // 256
    size = values_file_bytes(rows, 256)
    doc["rows"] = rows
    doc["files"]["values"].update(bytes=size, crc32=[0] * (-(-size // m.chunk_bytes)))
    crcs = size // 4096 * 4
    doc["files"]["page_crc"].update(bytes=crcs, crc32=[0] * (-(-crcs // m.chunk_bytes)))
    (d / MANIFEST).write_text(json.dumps(doc))
    os.truncate(d / "values.bin", size)  # sparse: takes no disk space
    os.truncate(d / "values.crc32c", crcs)
    with pytest.raises(MemoryPreflightError, match=r"does not fit on tier 'gpu'.*1.00 TiB"):
        open_table(d, "gpu", device="cpu")
    with pytest.raises(MemoryPreflightError, match="tier 'host'"):
        open_table(d, "host", device="cpu")


def _cgroup(tmp_path, files: dict) -> str:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_cgroup_budget_does_not_count_reclaimable_page_cache_as_used(tmp_path):
    """A cgroup at 60 of 64 GiB used, 50 of them inactive page cache, has 54 GiB to give (v2 and v1)."""
    from engram.store.preflight import cgroup_available

    gib = 1 << 30
    v2 = _cgroup(tmp_path / "v2", {"memory.max": f"{64 * gib}\n", "memory.current": f"{60 * gib}\n",
                                   "memory.stat": f"anon {8 * gib}\nactive_file {2 * gib}\n"
                                                  f"inactive_file {50 * gib}\n"})
    assert cgroup_available(v2) == 54 * gib
    v1 = _cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": f"{64 * gib}\n",
                                   "memory/memory.usage_in_bytes": f"{60 * gib}\n",
                                   "memory/memory.stat": f"inactive_file {1}\ntotal_inactive_file {50 * gib}\n"})
    assert cgroup_available(v1) == 54 * gib
    no_stat = _cgroup(tmp_path / "nostat", {"memory.max": f"{64 * gib}\n", "memory.current": f"{60 * gib}\n"})
    assert cgroup_available(no_stat) == 4 * gib
    unlimited = _cgroup(tmp_path / "max", {"memory.max": "max\n", "memory.current": f"{60 * gib}\n"})
    assert cgroup_available(unlimited) is None
