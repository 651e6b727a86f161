"""GPU tests share one process: a failed test must not keep its engine's memory for the tests after it.

pytest keeps the last failure in ``sys.last_value`` / ``sys.last_traceback`` (for post-mortem debugging), and
those frames hold the failed test's engine, its KV cache sized to most of the GPU included; every later test that
sizes its KV cache from the free memory would then fail too. After each test: drop them, collect, empty the cache.
"""
from __future__ import annotations

import gc
import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_gpu_memory_after_each_test():
    yield
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
