"""engram/bench/node_memory.py against real processes (no /proc mocked): a parent process whose two children map one
64 MiB table segment finds the three of them, their Pss of the segment adds up to one copy while each child's Rss is
the whole file; the same children each writing their own private copy of the pages read as two copies (the 1.1 x
check fails), so the measure tells one shared copy from two. Files in the directory that are not segments, and a
segment nobody of the tree maps, count for nothing. And `engram bench serve` reports the node memory of the
data-parallel server it started (tiny, CPU, tier host): one copy of every table for the replicas together."""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engram.bench import node_memory as nm
from engram.store.shared_host import LOCK_NAME, SharedTarget, segment_path

pytestmark = pytest.mark.timeout(600)
SIZE = 64 << 20  # far above what two interpreters' own memory varies by
PAGE = 4096

# Maps every file of argv[2:] (shared read-only, or "private": copy-on-write, every page written: its own copy),
# touches every page, says "ready", and holds them until stdin closes.
CHILD = r"""
import mmap, os, sys
mode, maps = sys.argv[1], []
for path in sys.argv[2:]:
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if mode == "shared":
            m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            sum(m[i] for i in range(0, size, 4096))
        else:
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            for i in range(0, size, 4096):
                m[i] = (m[i] + 1) % 256
    maps.append(m)
print("ready", flush=True)
sys.stdin.read()
"""

# Starts two CHILDs with its own argv, says "ready <pid> <pid>" once both are, and stops them when stdin closes.
PARENT = r"""
import subprocess, sys
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True) for _ in range(2)]
for k in kids:
    assert k.stdout.readline().split() == ["ready"]
print("ready", *(k.pid for k in kids), flush=True)
sys.stdin.read()
for k in kids:
    k.stdin.close()
    k.wait()
"""


@pytest.fixture
def table_dir(request, tmp_path):
    """A directory in /dev/shm (tmpfs, where segments live) when the node has one, else tmp_path."""
    return request.getfixturevalue("shm_dir") if Path("/dev/shm").is_dir() else tmp_path


def _segment(directory: Path, key: str, size: int) -> Path:
    path = segment_path(SharedTarget(str(directory), key, "test"), "packed")
    with open(path, "wb") as f:
        for _ in range(size // (8 << 20)):
            f.write(os.urandom(8 << 20))
    return path


class Tree:
    """PARENT and its two CHILDs mapping ``files``."""

    def __init__(self, mode: str, files: list[Path]):
        self.proc = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode, *map(str, files)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        assert ready, "the children did not map their files in 120 s"
        word, *kids = self.proc.stdout.readline().split()
        assert word == "ready", word
        self.children = [int(k) for k in kids]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def _measure(mode: str, files: list[Path], directory: Path) -> tuple[dict, list[int], Tree]:
    tree = Tree(mode, files)
    try:
        return nm.node_memory(tree.proc.pid, directory), tree.children, tree
    finally:
        tree.close()


def test_one_shared_copy_reads_as_one_and_private_copies_as_two(table_dir):
    seg = _segment(table_dir, "ab" * 16, SIZE)
    _segment(table_dir, "cd" * 16, 8 << 20)  # a segment nobody of the tree maps (another server's, a dead one's)
    other = table_dir / "unrelated.bin"  # a file of the directory that is no segment, mapped all the same
    other.write_bytes(os.urandom(8 << 20))
    (table_dir / LOCK_NAME).touch()
    shared, kids, tree = _measure("shared", [seg, other], table_dir)
    assert shared["pids"] == [tree.proc.pid, *kids] and shared["processes"] == 3  # the walk found the grandchildren
    assert shared["segments"] == 1 and shared["one_copy_bytes"] == SIZE
    assert 0.9 <= shared["shared_tables_pss_over_one_copy"] <= 1.1, shared  # two mappers: one copy
    rss = shared["shared_tables_rss_bytes_per_process"]
    assert rss[0] == 0 and all(r >= 0.9 * SIZE for r in rss[1:]), rss  # each child has every page
    assert shared["pss_total_bytes"] > shared["shared_tables_pss_bytes"]

    private, _, _ = _measure("private", [seg, other], table_dir)  # the mutation: each child its own copy
    print(f"Pss over one copy: shared {shared['shared_tables_pss_over_one_copy']:.3f}, "
          f"private {private['shared_tables_pss_over_one_copy']:.3f}")
    assert private["one_copy_bytes"] == SIZE and private["processes"] == 3
    assert private["shared_tables_pss_over_one_copy"] > 1.8  # two copies: the 1.1 x check fails
    assert all(r >= 0.9 * SIZE for r in private["shared_tables_rss_bytes_per_process"][1:])
    # the node holds one more copy of the segment (and of the unrelated file), the interpreters the same either way
    grown = private["pss_total_bytes"] - shared["pss_total_bytes"]
    assert 0.8 * (SIZE + (8 << 20)) < grown < 1.2 * (SIZE + (8 << 20)), grown


def test_the_tree_walk_agrees_with_the_ppid_scan_and_skips_what_is_gone(table_dir):
    seg = _segment(table_dir, "ef" * 16, 8 << 20)
    tree = Tree("shared", [seg])
    try:
        assert nm.process_tree(tree.proc.pid) == [tree.proc.pid, *sorted(tree.children)]
        assert sorted(nm._children_by_ppid()[tree.proc.pid]) == sorted(tree.children)
        pss, rss = nm.mapped_memory(tree.children[0], table_dir)
        assert rss >= 8 << 20 and 0 < pss < rss  # two children share its pages
    finally:
        tree.close()
    assert nm.process_tree(tree.proc.pid) == [] and nm.total_pss(tree.proc.pid) is None
    assert nm.node_memory(tree.proc.pid, table_dir) == {"skipped": f"process {tree.proc.pid} is not running"}


def test_the_shm_dir_comes_from_the_serve_args():
    assert nm.shm_dir_of("") == nm.shm_dir_of("--threads 1") == "/dev/shm"
    assert nm.shm_dir_of("--engram-config '{\"advanced\": {\"shm_dir\": \"/x\"}}' --threads 1") == "/x"
    assert nm.shm_dir_of("--engram-config='{\"advanced\": {\"shm_dir\": \"/y\"}}'") == "/y"
    assert nm.shm_dir_of("--engram-config '{\"table_rows\": 5}'") == "/dev/shm"
    assert nm.bench_server_memory(None, "") == {"skipped": "--url: not this bench's server"}
    assert "skipped" in nm.bench_server_memory(os.getpid(), "--engram-config '[1]'")


def _bench(argv: list[str], out: Path) -> tuple[int, dict]:
    from engram.cli import main

    rc = main(["bench", "serve", "--model", "tiny", "--input-len", "8:32", "--output-len", "2:4", "--seed", "2",
               "--no-roofline", *argv, "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_bench_serve_reports_one_copy_for_two_data_parallel_replicas(tmp_path, shm_dir, capsys):
    from engram.model.presets import preset_config

    config = json.dumps({"advanced": {"shm_dir": str(shm_dir)}})
    rc, doc = _bench(["--tier", "host", "--device", "cpu", "--num-prompts", "4", "--warmup", "1", "--concurrency",
                      "2", "--serve-args", f"--threads 1 --data-parallel-size 2 --engram-config '{config}'"],
                     tmp_path / "r.json")
    r = doc["result"]
    assert rc == 0 and r["errors"] == 0, r["error_samples"]
    mem = r["node_memory"]
    # the server, its engine process and the two replicas (at least)
    assert mem["processes"] >= 3 and mem["shm_dir"] == os.path.realpath(shm_dir), mem
    assert mem["segments"] == len(preset_config("tiny").engram.layer_ids) and mem["one_copy_bytes"] > 0, mem
    assert 0 < mem["shared_tables_pss_over_one_copy"] <= 1.1, mem
    assert sum(1 for x in mem["shared_tables_rss_bytes_per_process"] if x) == 2, mem  # both replicas map them
    assert "node memory of the server's" in capsys.readouterr().out
    print(nm.summary_line(mem))


def test_bench_serve_against_a_url_skips_the_node_memory(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc, doc = _bench(["--url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--warmup", "0"],
                     tmp_path / "r.json")
    assert rc == 1 and doc["result"]["node_memory"] == {"skipped": "--url: not this bench's server"}
