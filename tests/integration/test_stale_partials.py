"""A writer killed with SIGKILL mid-table leaves its `.NAME.partial-*` directory; the next `engram convert` (any
TableWriter) in that directory removes it and says so, while the partial directory of a writer still running
is left alone. Real subprocesses, real files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engram.store import open_table
from engram.store.writer import remove_stale_partials

pytestmark = pytest.mark.timeout(600)

# Starts a table of 1M rows, appends a quarter of them, says so and waits (to be killed, or left running).
WRITER = textwrap.dedent("""
    import sys, time, numpy as np
    from engram.store.writer import TableWriter
    w = TableWriter(sys.argv[1], 1 << 20, 256, "bf16", sync=False)
    w.append(np.zeros((1 << 18, 512), dtype=np.uint8))
    print("appended", flush=True)
    time.sleep(600)
""")


def _start_writer(target: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "appended"
    return p


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.partial-*"))


def _convert(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engram.cli", "convert", "--random", "--rows", "1000", "--dim", "64",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)


def test_next_convert_removes_what_a_killed_writer_left_and_keeps_a_live_ones(tmp_path):
    killed, alive = _start_writer(tmp_path / "t"), _start_writer(tmp_path / "u")
    try:
        (dead_dir,) = _partials(tmp_path, "t")
        (live_dir,) = _partials(tmp_path, "u")
        assert f"-{killed.pid}-" in dead_dir.name and (dead_dir / "values.bin").stat().st_size > 0
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(60) == -signal.SIGKILL
        assert dead_dir.exists()  # nothing cleans up after a SIGKILL by itself

        r = _convert(tmp_path / "t")
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"removed {dead_dir}" in r.stderr and f"process {killed.pid}" in r.stderr, r.stderr[-3000:]
        assert not dead_dir.exists() and _partials(tmp_path, "t") == []
        assert live_dir.exists() and str(live_dir) not in r.stderr  # its writer is still running
        assert open_table(tmp_path / "t", tier="gpu", device="cpu").rows == 1000  # the new table is whole
    finally:
        for p in (killed, alive):
            if p.poll() is None:
                p.kill()
            p.wait(60)
            p.stdout.close()
    with pytest.warns(RuntimeWarning, match=f"process {alive.pid}, which is no longer running"):
        assert remove_stale_partials(tmp_path) == [live_dir]  # now that its writer is gone too


def test_a_table_a_killed_writer_had_moved_aside_is_restored(tmp_path):
    """A writer that dies between moving the old table aside and renaming its new one into place leaves
    `.NAME.old-*` and no NAME: the next writer puts the old table back (and then replaces it as asked)."""
    assert _convert(tmp_path / "t").returncode == 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    aside = tmp_path / f".t.old-{_host()}-{int(dead.stdout)}-1"
    os.rename(tmp_path / "t", aside)
    with pytest.warns(RuntimeWarning, match="restored the table"):
        assert remove_stale_partials(tmp_path) == [aside]
    assert open_table(tmp_path / "t", tier="gpu", device="cpu").rows == 1000
    assert not any(p.name.startswith(".t.") for p in tmp_path.iterdir())


def _host() -> str:
    from engram.store.writer import _host as host

    return host()
