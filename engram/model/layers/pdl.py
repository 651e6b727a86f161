"""Programmatic dependent launch (PDL) of the decode step's small Triton kernels (compute capability 9.0+): a kernel may
be scheduled while the one before runs, its programs waiting on the device (``griddepcontrol.wait``) before touching
memory, so outputs are bitwise the same and only the launch gap is saved. Kernels take ``USE_PDL``, call ``pdl_enter``
first and launch with ``**launch_options(device)``; the Engram gate kernel is not.

**Reads before the wait.** Every kernel of the stream but the one just before has finished, so before its wait a kernel
may read what that one does not write: weights, the step's inputs, cos/sin and earlier steps' K/V
(tests/unit/test_pdl_early_reads.py enforces the list; tests/gpu/test_pdl.py compares outputs bitwise)."""
from __future__ import annotations

import torch

_CAPABLE: dict[int, bool] = {}  # device index -> compute capability >= 9.0


def active(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA device of compute capability 9.0 or newer."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _CAPABLE[idx]


_ON = {"USE_PDL": True, "launch_pdl": True}
_OFF = {"USE_PDL": False}


def launch_options(device: torch.device) -> dict:
    """A Triton launch's keyword arguments on ``device`` (read-only): ``USE_PDL`` and, when true, ``launch_pdl``."""
    return _ON if active(device) else _OFF
