"""``FastPathSwitch``: which implementation a function with a fast CUDA path and a torch reference uses.

"auto" takes the fast path where it can run (CUDA, the dtypes it supports, triton importable), "torch"
always takes the reference, "triton" insists on the fast path and raises where it cannot run. The
initial choice comes from an environment variable — a debugging switch (ENGRAM_KERNELS, ENGRAM_ATTENTION,
ENGRAM_FUSED); tests flip it with ``set``.
"""
from __future__ import annotations

import functools
import importlib
import os

CHOICES = ("auto", "torch", "triton")


class FastPathSwitch:
    def __init__(self, what: str, env: str):
        self.what = what  # how errors name it, e.g. "attention backend"
        self.value = "auto"
        self.set(os.environ.get(env, "auto"))

    def set(self, name: str) -> str:
        """Select "auto", "torch" or "triton"; returns the previous choice."""
        if name not in CHOICES:
            raise ValueError(f"{self.what} {name!r} is not one of {CHOICES}")
        old, self.value = self.value, name
        return old

    def fast(self, can_run: bool, what_runs: str) -> bool:
        """Whether to take the fast path, given whether it ``can_run`` here; "triton" raises when it cannot,
        naming ``what_runs`` (e.g. "torch.float32 queries on cpu")."""
        if self.value == "triton" and not can_run:
            raise RuntimeError(f"{self.what} 'triton' cannot run {what_runs}")
        return can_run and self.value != "torch"


@functools.cache
def importable(module: str) -> bool:
    """Whether a fast-path module imports here (Triton modules need triton, which has no CPU backend)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
