"""Programmatic dependent launch (PDL) of the decode step's small Triton kernels (Hopper and newer).

A kernel launched with PDL may be scheduled while the kernel before it on its stream is still running; its
programs then wait on the device (``griddepcontrol.wait``: every program of the kernel before has finished
and its memory is visible) before they read or write anything, and release the kernel after them
(``griddepcontrol.launch_dependents``) at once. So nothing a kernel computes changes, and its outputs are
bitwise the same; what it can save is the gap between two dependent kernels, which at batch 1 is a fair
share of the ~6 small launches per layer (norms, q/k rope and KV write, attention's split and combine,
SwiGLU). Captured into a CUDA graph, the launch becomes a programmatic edge between the two kernel nodes.

PDL is used wherever the device can (compute capability 9.0 or newer; docs/log.md has the A/B that decided
it). Kernels take
``USE_PDL: tl.constexpr`` and call ``pdl_enter(USE_PDL)`` (fused_triton.py) first; their launches add
``**launch_options(device)``. The Engram gate kernel, which follows a wait on the lookup stream's event,
is not launched this way.

**Reads before the wait.** Every kernel releases the next only after its own wait has returned, and a kernel
launched without PDL starts only once the one before has finished; so when a kernel's program runs, every
kernel of its stream but the one just before it has finished and its writes are visible. A kernel may
therefore read, before its wait, what the kernel just before it does not write: weights, the step's inputs
(positions, slots, block tables, sequence lengths; copied in before the step's first kernel), cos/sin (made
before the first layer), and the keys and values of earlier steps. The rms norm reads its weight this way,
the q/k norm + rope its weights, cos/sin and slot, the decode attention its sequence's length and block
table (and it asks L2 for its first split's K/V lines), and its combine the lengths. tests/unit/
test_pdl_early_reads.py parses the kernels and fails on an early read not in that list; tests/gpu/test_pdl.py
runs a layer's kernels with PDL on and off, eager and in a graph, and compares the outputs bitwise.
"""
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
    """Keyword arguments of a Triton launch on ``device`` (read-only): the kernel's ``USE_PDL`` constexpr
    and, when it is true, Triton's ``launch_pdl`` launch option."""
    return _ON if active(device) else _OFF
