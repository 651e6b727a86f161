"""The node's one copy of a table across real processes (store/shared_host.py): two processes that open the same
table on the host tier with ``shared_memory`` grow the node's memory by one table, not two (PSS from
/proc/<pid>/smaps_rollup, engram/bench/node_memory.py; the same two without it grow it by two), and a creator killed
while it fills the segment leaves nothing another process maps: the process waiting for it builds the table again,
rows equal to the files'."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engram.bench.node_memory import total_pss
from engram.quant import quantize_mxfp8
from engram.store import open_table, read_manifest, write_table
from engram.store.shared_host import segment_path, shared_target

ROWS = 200_000  # 200k packed rows of 272 B: 54 MB, far above the processes' other growth
PACKED = 272

# A process that opens the table once privately and frees it (what a first open costs besides the table is then
# paid), opens it again when told ("open"), touches every row (its page mappings are then all present, as a serving
# process's become), prints its digest of every row's bytes, and exits on "exit".
CHILD = r"""
import sys, torch
torch.set_num_threads(1)
from engram.store import open_table
table, shm_dir, shared = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

def digest(t):
    rows = t.values.shape[0]
    packed = torch.as_strided(t.values, (rows, 272), (272, 1))  # values | scales | padding, every byte
    return int(packed.sum(dim=1, dtype=torch.int64).mul(torch.arange(1, rows + 1)).sum())

warm = open_table(table, tier="host", load_threads=1)  # the first open's imports, pools and buffers, then freed
digest(warm)
warm.close()
del warm
print("imported", flush=True)
for line in sys.stdin:
    if line.strip() == "open":
        t = open_table(table, tier="host", shared_memory=shared, shm_dir=shm_dir, load_threads=1)
        print("opened", digest(t), flush=True)
    elif line.strip() == "exit":
        break
"""


def _digest(t) -> int:
    """CHILD's digest: Σ over rows of (row number, from 1) x (sum of the row's bytes)."""
    rows = t.values.shape[0]
    packed = torch.as_strided(t.values, (rows, PACKED), (PACKED, 1))
    return int(packed.sum(dim=1, dtype=torch.int64).mul(torch.arange(1, rows + 1)).sum())


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    g = torch.Generator().manual_seed(11)
    v, s = quantize_mxfp8(torch.randn(ROWS, 256, generator=g))
    path = tmp_path_factory.mktemp("shared-procs") / "t"
    write_table(path, v, s)
    return path


class Child:
    def __init__(self, table: Path, shm_dir: Path, shared: bool):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(table), str(shm_dir), "1" if shared else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.expect("imported")

    def expect(self, word: str, timeout: float = 120.0) -> list[str]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no {word!r} from pid {self.proc.pid} in {timeout} s"
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, f"pid {self.proc.pid} said {line}, expected {word!r}"
        return line[1:]

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def pss(self) -> int:
        """Proportional set size in bytes: a page mapped by k processes counts 1/k to each."""
        pss = total_pss(self.proc.pid)
        assert pss is not None, f"pid {self.proc.pid} is gone"
        return pss

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _growth(table: Path, shm_dir: Path, shared: bool) -> tuple[int, list[int]]:
    """(the two processes' PSS growth together, their digests) from before either opened to after both did."""
    children = [Child(table, shm_dir, shared) for _ in range(2)]
    try:
        before = sum(c.pss() for c in children)
        digests = []
        for c in children:
            c.send("open")
            digests.append(int(c.expect("opened")[0]))
        return sum(c.pss() for c in children) - before, digests
    finally:
        for c in children:
            c.close()


def test_two_processes_grow_the_node_by_one_table_not_two(table, shm_dir):
    size = ROWS * PACKED
    expected = _digest(open_table(table, tier="host"))
    shared, digests = _growth(table, shm_dir, shared=True)
    assert digests == [expected, expected]
    private, digests = _growth(table, shm_dir, shared=False)
    assert digests == [expected, expected]
    print(f"PSS growth of two processes: shared {shared / size:.3f} tables, private {private / size:.3f} tables")
    # each process grows by a few MB besides the table (thread pools, buffers), shared or not
    assert 0.9 * size < shared < 1.25 * size, (shared, size)
    assert private > 1.9 * size, (private, size)
    # sharing saves one whole copy (the processes' own growth varies by a few MB on a loaded machine)
    assert 0.9 * size < private - shared < 1.5 * size, (private - shared, size)
    assert not [p for p in shm_dir.iterdir() if not p.name.endswith(".lock")]  # the last one out unlinked it


def test_a_creator_killed_mid_creation_leaves_nothing_mapped_and_the_waiter_rebuilds(table, shm_dir):
    final = segment_path(shared_target(read_manifest(table), str(shm_dir)), "packed")
    waiter = Child(table, shm_dir, shared=True)
    creator = Child(table, shm_dir, shared=True)
    try:
        creator.send("open")
        deadline = time.monotonic() + 60
        while not list(shm_dir.glob(final.name + ".tmp-*")):
            assert time.monotonic() < deadline and creator.proc.poll() is None, "the creator made no temporary file"
            time.sleep(0.0005)
        waiter.send("open")  # it waits for the creation lock the creator holds
        assert not final.exists()
        os.kill(creator.proc.pid, signal.SIGKILL)  # mid-fill: the segment has no header and no final name yet
        creator.proc.wait(30)
        got = int(waiter.expect("opened")[0])
        assert got == _digest(open_table(table, tier="host"))
        assert final.exists() and not list(shm_dir.glob(final.name + ".tmp-*"))  # rebuilt, the leftover removed
    finally:
        creator.close()
        waiter.close()
