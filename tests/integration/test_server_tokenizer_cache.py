"""A damaged compressed-tokenizer cache ($ENGRAM_CACHE_DIR/compressed_tokenizer/*.npz: truncated, bit-flipped
in its data or in its zip headers) is reported by name as unusable, rebuilt, and `engram serve` and `engram
generate` go on to serve: real subprocesses, real files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from engram.server.launcher import ServerProcess

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache of its own whose tables are the session's (not built again); its tokenizer map is made by a
    first server start."""
    shared = tmp_path_factory.getbasetemp() / "engram-cache" / "tables"
    shared.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("tokcache")
    (root / "tables").symlink_to(shared, target_is_directory=True)
    with ServerProcess(["tiny", "--threads", "1"], root, root / "first.log"):
        pass
    return root


def _map_file(cache: Path) -> Path:
    files = sorted((cache / "compressed_tokenizer").glob("*.npz"))
    assert len(files) == 1, files
    return files[0]


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "data-flipped":  # a byte of map.npy's values: the zip member fails its CRC-32
        data[len(data) // 3] ^= 0x40
    else:  # "header-flipped": the zip's central directory signature: not a zip file
        at = data.rfind(b"PK\x01\x02")
        data[at + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def _check_rebuilt(path: Path, good: np.ndarray, log: str) -> None:
    assert f"compressed-tokenizer cache {path} is unusable" in log and "rebuilding it" in log, log[-3000:]
    with np.load(path) as z:  # a whole, valid map is back in place
        assert np.array_equal(z["map"], good)


@pytest.mark.parametrize("how", ["truncated", "data-flipped", "header-flipped"])
def test_serve_reports_rebuilds_and_serves(cache, tmp_path, how):
    path = _map_file(cache)
    with np.load(path) as z:
        good = z["map"].copy()
    _damage(path, how)
    with ServerProcess(["tiny", "--threads", "1"], cache, tmp_path / "server.log") as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "The tables are",
                                                        "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        log = s.log()
    _check_rebuilt(path, good, log)


def test_generate_reports_rebuilds_and_generates(cache):
    path = _map_file(cache)
    with np.load(path) as z:
        good = z["map"].copy()
    _damage(path, "data-flipped")
    env = dict(os.environ, ENGRAM_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-m", "engram.cli", "generate", "tiny", "--prompt", "Engram tables are",
                        "--max-tokens", "4", "--threads", "1", "--no-progress"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tok/s" in r.stdout
    _check_rebuilt(path, good, r.stderr)
