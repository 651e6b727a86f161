"""``FastPathSwitch``: which implementation a function with a fast path and a reference uses.

"auto" takes the fast path where it can run, the reference's name always takes the reference, and the fast
name insists on the fast path and raises where it cannot run. Whether it can run is decided per call for a
Triton kernel (``fast``) and once per process for a C extension (``available``, ``use_fast``). A switch
named by ``kernel`` starts from ENGRAM_KERNELS (engram/envs.py); tests flip it with ``set``.
"""
from __future__ import annotations

import functools
import importlib
import warnings
from typing import Callable

from engram import envs

CHOICES = ("auto", "torch", "triton")


class FastPathSwitch:
    """A switch named ``what`` (how errors name it, e.g. "attention backend") over ``choices``: "auto", the
    ``fast`` implementation's name and the reference's name, in the order errors list them.

    ``available`` (optional) says whether the fast implementation exists in this process at all; with it,
    ``set(fast)`` raises ``RuntimeError(missing)`` when it does not, and ``fallback_warning`` (optional) is
    warned once when "auto" falls back to the reference for that reason.
    """

    def __init__(self, what: str, kernel: str | None = None, choices: tuple[str, str, str] = CHOICES,
                 fast: str = "triton", available: Callable[[], bool] | None = None, missing: str = "",
                 fallback_warning: str | None = None):
        if len(choices) != 3 or choices[0] != "auto" or fast not in choices[1:]:
            raise ValueError(f"{what}: choices {choices} must be 'auto' and two names, {fast!r} among them")
        self.what = what
        self.choices = choices
        self.fast_name = fast
        self.reference = next(c for c in choices[1:] if c != fast)
        self.available = available
        self.missing = missing  # the RuntimeError's message when the fast path is forced but not available
        self.fallback_warning = fallback_warning
        self._warned = False
        self.value = "auto"
        if kernel is not None:
            self.set(envs.kernel_choice(kernel))

    def set(self, name: str) -> str:
        """Select one of ``choices``; returns the previous choice. ValueError for another name,
        RuntimeError when ``name`` forces a fast path that ``available`` says is not there."""
        if name not in self.choices:
            raise ValueError(f"{self.what} {name!r} is not one of {self.choices}")
        if name == self.fast_name and self.available is not None and not self.available():
            raise RuntimeError(self.missing)
        old, self.value = self.value, name
        return old

    def fast(self, can_run: bool, what_runs: str) -> bool:
        """Whether to take the fast path, given whether it ``can_run`` here; a forced fast path raises when
        it cannot, naming ``what_runs`` (e.g. "torch.float32 queries on cpu")."""
        if self.value == self.fast_name and not can_run:
            raise RuntimeError(f"{self.what} {self.fast_name!r} cannot run {what_runs}")
        return can_run and self.value != self.reference

    def active(self) -> str:
        """For a switch with ``available``: the implementation in use now, the fast name or the
        reference's ("auto" resolves to the fast one when available). Warns nothing."""
        if self.value == self.reference or (self.value == "auto" and not self.available()):
            return self.reference
        return self.fast_name

    def use_fast(self, stacklevel: int = 1) -> bool:
        """``active() == fast``, warning ``fallback_warning`` the first time "auto" falls back because the
        fast path is not available; ``stacklevel`` counts from the caller of ``use_fast`` (1: the caller)."""
        if self.active() == self.fast_name:
            return True
        if self.value == "auto" and self.fallback_warning is not None and not self._warned:
            self._warned = True
            warnings.warn(self.fallback_warning, RuntimeWarning, stacklevel=stacklevel + 1)
        return False


@functools.cache
def importable(module: str) -> bool:
    """Whether a fast-path module imports here (Triton modules need triton, which has no CPU backend)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
