"""`engram serve` that cannot start exits non-zero with the reason on stderr (a supervisor restarts it),
instead of staying up answering 503: real subprocesses, one per cause."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from engram.server.launcher import free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return dict(os.environ, ENGRAM_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "engram-cache"),
                PYTHONUNBUFFERED="1")


def _serve(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engram.cli", "serve", *args, "--threads", "1",
                           "--port", str(free_port()), "--log-level", "warning"],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needles", [
    (["no-such-model"], ["model failed to load", "no-such-model"]),
    (["tiny", "--max-model-len", "1000000"], ["model failed to load", "max_model_len=1000000"]),
    pytest.param(["tiny", "--device", "cuda"], ["model failed to load", "CUDA"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_load_failure_exits_1_with_the_reason(env, args, needles):
    r = _serve(env, *args)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    last = [line for line in r.stderr.splitlines() if line.startswith("engram serve: error:")]
    assert last, r.stderr[-3000:]
    assert all(n in last[-1] for n in needles), last[-1]


def test_bad_option_exits_2_before_the_port_opens(env):
    r = _serve(env, "tiny", "--max-request-bytes", "0")
    assert r.returncode == 2 and "--max-request-bytes=0 must be >= 1" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("args,needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs=0"),
    (["--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "--max-num-batched-tokens=8"),
    (["--timeout-request-body", "0"], "--timeout-request-body=0"),
    (["--engram-config", '{"no_such_key": 1}'], "no_such_key"),
])
def test_bad_engine_or_http_option_exits_2_before_the_port_opens(env, args, needle):
    r = _serve(env, "tiny", *args)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert needle in r.stderr and "engram: serving" not in r.stdout, (r.stdout[-1000:], r.stderr[-3000:])


def test_port_in_use_exits_3_before_loading(env):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "engram.cli", "serve", "tiny", "--threads", "1", "--port", str(port),
                            "--log-level", "warning"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, (r.returncode, r.stderr[-3000:])
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr[-3000:]
    assert "engram: serving" not in r.stdout, r.stdout[-1000:]
