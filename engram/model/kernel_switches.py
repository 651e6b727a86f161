"""Kernel and lookup-order choices by name: what a benchmark arm may flip for its engine.

Some fast paths are chosen by process-wide flags, read from the environment (``ENGRAM_*``, torch's BLAS
choice); a decode graph captures whichever was set while the Worker was built, and the lookup order is read
at every step. ``applied({"pdl": False})`` sets the named switches for the duration of a ``with`` block
and restores them after, so one process can build engines that differ only in them (engram bench
placement's ``switches`` arm key, set while the arm's engine is built and while it is measured) and compare
them, interleaved, with confidence intervals. Unknown names are refused with the known ones.

* ``pdl``: the decode step's small Triton kernels are launched with programmatic dependent launch
  (``pdl.ENABLED``, ``ENGRAM_PDL``; Hopper or newer; on by default);
* ``first_lookup_alone``: over host-read tables (the disk tier, hot-row caches) the first Engram layer's
  lookup runs alone before the later layers' are submitted (``lookup.FIRST_LOOKUP_ALONE``,
  ``ENGRAM_FIRST_LOOKUP_ALONE``; read at every step, so it takes effect while set; on by default);
* ``together_when_deep``: with ``first_lookup_alone``, a step whose first layer's row ids fill its table's
  read queue still submits the later layers' lookups with it (``lookup.TOGETHER_WHEN_DEEP``,
  ``ENGRAM_TOGETHER_WHEN_DEEP``; read at every step; on by default);
* ``later_at_first_read``: when decode-graph slabs read the tables together, the later layers' lookups are
  submitted right before the first layer's first read instead of before its plan (``lookup.LATER_AT_FIRST_READ``,
  ``ENGRAM_LATER_AT_FIRST_READ``; read at every step; on by default);
* ``late_caching``: a decode step's disk rows read through a probed hot-row cache are cached during the table's
  next lookup's reads instead of before that lookup (``late_caching.DEFER``, ``ENGRAM_LATE_CACHING``; read at
  every step; on by default);
* ``disk_decode_in_graph``: disk tables' rows are decoded inside the piecewise decode graphs from a slab the
  step's lookup reads into (``cuda_graphs.DISK_DECODE_IN_GRAPH``, ``ENGRAM_DISK_DECODE_IN_GRAPH``; read when a
  Worker's graphs are captured; on by default);
* ``background_lookups``: a decode step whose Engram layers all find their rows on the device (disk tables
  behind a probed hot-row cache) runs its lookups on a thread of its own, beside the engine's host work
  (``step_lookups.BACKGROUND``, ``ENGRAM_BACKGROUND_LOOKUPS``; read at every launch; on by default);
* ``early_host_ids``: a probed slab step's row ids go to the host before the step before's background
  lookups are finished, not after (``step_lookups.EARLY_HOST_IDS``, ``ENGRAM_EARLY_HOST_IDS``; read at every
  launch; on by default);
* ``split_gemv``: at one to four rows the o and down projections write float32 partials over slices of K
  that the next fused add + RMSNorm sums, instead of cuBLAS's split-K GEMM and its reduce kernel
  (``split_linear.ENABLED``, ``ENGRAM_SPLIT_GEMV``; read at every forward, so a decode graph captures
  whichever was set while it was captured; on by default);
* ``cublaslt``: torch's matmuls go through cuBLASLt instead of cuBLAS
  (``torch.backends.cuda.preferred_blas_library``, ``TORCH_BLAS_PREFER_CUBLASLT=1``; its heuristics may
  pick other GEMV kernels for the decode step's projections, e.g. without cuBLAS's split-K reduce).
"""
from __future__ import annotations

import contextlib
import importlib


def _module_flag(module_name: str, attr: str):
    """(get, set) of a module attribute, importing the module on first use."""
    def module():
        try:
            return importlib.import_module(module_name)
        except ImportError as e:
            raise RuntimeError(f"needs {module_name}, which cannot be imported here: {e}") from None

    return (lambda: getattr(module(), attr)), (lambda value: setattr(module(), attr, value))


def _blas_lt():
    """(get, set) of torch's preferred BLAS library being cuBLASLt (CUDA builds only)."""
    import torch

    def get() -> bool:
        return torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt

    def set_(value: bool) -> None:
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt" if value else "cublas")
        except RuntimeError as e:
            raise RuntimeError(f"cannot choose the BLAS library here: {e}") from None

    return get, set_


SWITCHES = {  # name -> (get, set)
    "pdl": _module_flag("engram.model.layers.pdl", "ENABLED"),
    "first_lookup_alone": _module_flag("engram.engine.lookup", "FIRST_LOOKUP_ALONE"),
    "together_when_deep": _module_flag("engram.engine.lookup", "TOGETHER_WHEN_DEEP"),
    "later_at_first_read": _module_flag("engram.engine.lookup", "LATER_AT_FIRST_READ"),
    "late_caching": _module_flag("engram.store.late_caching", "DEFER"),
    "cublaslt": _blas_lt(),
    "disk_decode_in_graph": _module_flag("engram.engine.cuda_graphs", "DISK_DECODE_IN_GRAPH"),
    "background_lookups": _module_flag("engram.engine.step_lookups", "BACKGROUND"),
    "early_host_ids": _module_flag("engram.engine.step_lookups", "EARLY_HOST_IDS"),
    "split_gemv": _module_flag("engram.model.layers.split_linear", "ENABLED"),
}
# read at every step or launch, so they take effect between two steps of one engine (read_cycle.switch_ab)
PER_STEP = ("first_lookup_alone", "together_when_deep", "later_at_first_read", "late_caching", "background_lookups",
            "early_host_ids")


def check(switches: dict) -> None:
    """ValueError for a name not in SWITCHES or a value that is not a bool."""
    for name, value in switches.items():
        if name not in SWITCHES:
            raise ValueError(f"unknown kernel switch {name!r}; known: {list(SWITCHES)}")
        if not isinstance(value, bool):
            raise ValueError(f"kernel switch {name!r}={value!r} must be true or false")


@contextlib.contextmanager
def applied(switches: dict):
    """Set the named switches inside the block, restore them after. RuntimeError naming the switch when it
    cannot be set here (cublaslt without CUDA)."""
    check(switches)
    old = []
    try:
        for name, value in switches.items():
            get, set_ = SWITCHES[name]
            try:
                before = get()
                set_(value)
            except RuntimeError as e:
                raise RuntimeError(f"kernel switch {name!r} {e}") from None
            old.append((set_, before))
        yield
    finally:
        for set_, value in reversed(old):
            set_(value)
