"""``engram generate --tensor-parallel-size 2`` launched by a real ``torchrun --standalone --nproc-per-node 2`` (c10d
rendezvous, env:// group): rank 0 runs the engine with the TorchrunExecutor, rank 1 serves its steps; the tokens equal
a TP1 run's; neither rank has a gloo thread left when the command returns (one that outlives the interpreter can abort
the process at exit); a WORLD_SIZE other than the TP size is refused."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engram.engine.torchrun import torchrun_rank

pytestmark = pytest.mark.timeout(600)
TORCHRUN = Path(sys.executable).parent / "torchrun"
ENTRY = Path(__file__).resolve().parents[1] / "torchrun_entry.py"  # engram, then its rank's gloo threads
ARGS = ["tiny", "--device", "cpu", "--dtype", "float64", "--prompt", "hello world", "--prompt", "the cat sat",
        "--max-tokens", "6", "--no-progress", "--json", "--threads", "1"]


def _run(cmd: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ENGRAM_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _tokens(out: str) -> list[list[int]]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"request_id"')]
    return [r["token_ids"] for r in rows]


@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="no torchrun")
def test_torchrun_two_ranks_match_tp1(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    tp1 = _run([sys.executable, "-m", "engram", "generate", *ARGS], cache)
    assert tp1.returncode == 0, tp1.stderr[-2000:]
    run = _run([str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(ENTRY), "generate",
                *ARGS, "--tensor-parallel-size", "2"], cache)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_tokens(tp1.stdout)) == 2 and _tokens(run.stdout) == _tokens(tp1.stdout)  # rank 0 prints alone
    # both ranks left their groups before the command returned: no gloo thread is left to outlive the interpreter
    left = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(left, key=lambda r: r["rank"]) == [{"rank": 0, "gloo_threads": 0}, {"rank": 1, "gloo_threads": 0}]

    bad = _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "engram", "generate", *ARGS,
                "--tensor-parallel-size", "4"], cache)
    assert bad.returncode != 0
    assert "--tensor-parallel-size=4 under torchrun with WORLD_SIZE=2" in bad.stderr + bad.stdout


def test_torchrun_rank_reads_the_rendezvous_environment():
    assert torchrun_rank({}) is None
    assert torchrun_rank({"RANK": "1", "WORLD_SIZE": "2"}) is None  # no rendezvous address: not torchrun's
    assert torchrun_rank({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}) == 1
