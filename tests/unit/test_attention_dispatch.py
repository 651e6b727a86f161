"""Which attention path runs: the torch reference on the CPU (and for float64), the backend switch, and the
decode split count (pure host arithmetic, so a CUDA graph bucket can fix it)."""
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


@pytest.mark.parametrize("decoding,n_kv,max_len,want", [(1, 8, 4096, 32), (1, 8, 300, 3), (64, 8, 4096, 1),
                                                         (16, 8, 2048, 3), (1, 1, 10, 1), (256, 8, 100000, 1)])
def test_decode_splits_fill_the_chip_with_at_least_128_keys_each(decoding, n_kv, max_len, want):
    assert pa.decode_splits(decoding, n_kv, max_len) == want
