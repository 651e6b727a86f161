"""Which attention path runs: the torch reference on the CPU (and for float64), and the backend switch."""
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
