"""``engram.model.layers.gemv.linear`` on any machine: cuBLAS (torch) by default, the Triton GEMV never on
the CPU ("auto" falls back, "triton" raises naming what it cannot run), and rows, weights or layouts
outside the kernel's reach always go to torch. The kernel itself: tests/gpu/test_gemv.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engram.model.layers import gemv


@pytest.fixture
def switch():
    old = gemv.SWITCH.value
    yield gemv.SWITCH
    gemv.SWITCH.set(old)


@pytest.mark.skipif("ENGRAM_GEMV" in os.environ, reason="the environment chooses the backend")
def test_cublas_is_the_default():
    assert gemv.SWITCH.value == "torch"


def test_auto_falls_back_on_the_cpu_and_triton_refuses_by_name(switch):
    x, w, b = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
    switch.set("auto")
    assert not gemv.gemv_fast(x, w)
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
    switch.set("triton")
    with pytest.raises(RuntimeError, match="small-batch GEMV backend 'triton' cannot run torch.float32 rows"):
        gemv.linear(x, w)


def test_what_the_kernel_never_takes_goes_to_torch_even_when_forced(switch):
    switch.set("triton")
    w = torch.randn(8, 16)
    too_many_rows = torch.randn(gemv.MAX_ROWS + 1, 16)
    assert not gemv.gemv_fast(too_many_rows, w)
    assert torch.equal(gemv.linear(too_many_rows, w), F.linear(too_many_rows, w))
    lm_head = torch.empty(gemv.MAX_OUT + 1, 4)  # an LM head's rows: cuBLAS reads it near the copy bandwidth
    assert not gemv.gemv_fast(torch.randn(1, 4), lm_head)
    assert not gemv.gemv_fast(torch.randn(2, 3, 16), w)  # not a [T, in] matrix


def test_project_is_the_layer(switch):
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    switch.set("auto")
    assert torch.equal(gemv.project(layer, x), layer(x))
