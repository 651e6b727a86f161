"""Which fast path runs: attention and the fused small ops take the torch reference on the CPU (and for float64); the backend switches."""
from __future__ import annotations

import pytest
import torch

from engram.model.layers import paged_attention as pa


def test_cpu_and_float64_take_the_reference_and_triton_insists():
    q = torch.zeros(2, 4, 16)
    assert not pa.uses_triton(q) and not pa.uses_triton(q.double())
    old = pa.set_backend("triton")
    try:
        with pytest.raises(RuntimeError, match="cannot run torch.float32 queries on cpu"):
            pa.uses_triton(q)
    finally:
        pa.set_backend(old)


def test_fused_ops_take_the_reference_on_the_cpu_and_triton_insists():
    from engram.model.layers import fused

    x = torch.randn(3, 2, 8)
    assert not fused._fast(x)
    cos, sin = torch.ones(3, 1, 8), torch.zeros(3, 1, 8)
    assert torch.equal(fused.norm_rope(x, None, 1e-6, cos, sin), x)  # angle 0: rotation is the identity
    old = fused.set_backend("triton")
    try:
        with pytest.raises(RuntimeError, match="cannot run torch.float32 on cpu"):
            fused.rms_norm(x, torch.ones(8), 1e-6)
    finally:
        fused.set_backend(old)
