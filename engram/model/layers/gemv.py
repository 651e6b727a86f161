"""``linear(x, weight, bias)``: the decoder layers' projections (packed q/k/v, o, packed gate/up, down).

The reference is ``torch.nn.functional.linear`` (cuBLAS on CUDA), which runs everywhere. On CUDA, for a
few rows (``MAX_ROWS``: decode at batch 1-4) of bf16 / fp16 / fp32 and weights of at most ``MAX_OUT``
rows (the LM head stays with cuBLAS, which reads it at ~94 % of the copy bandwidth), the Triton
matrix-vector kernel of gemv_triton.py can take over; launched with programmatic dependent launch, it
loads its first weight chunk while the kernel before it still runs. Its switch is ``ENGRAM_GEMV``
("torch" unless set, until the H200 A/B decides the default; "auto" takes the kernel where it can run,
"triton" insists on it; kernel switch ``gemv``); the parity tests are tests/gpu/test_gemv.py.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engram.fast_path import FastPathSwitch, importable

SWITCH = FastPathSwitch("small-batch GEMV backend")
SWITCH.set(os.environ.get("ENGRAM_GEMV", "torch"))
FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROWS = 4  # gemv_triton.MAX_ROWS, repeated so that this module imports without triton
MAX_OUT = 65536  # weights with more rows (LM heads) stay with cuBLAS


def gemv_fast(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes the Triton kernel for these tensors: only for at most MAX_ROWS rows and
    MAX_OUT weight rows (others always go to cuBLAS, whatever the switch says); "triton" raises where the
    kernel cannot run them."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or weight.shape[0] > MAX_OUT:
        return False
    can_run = (x.is_cuda and x.dtype in FAST_DTYPES and weight.dtype == x.dtype and x.stride(-1) == 1
               and weight.stride(-1) == 1 and importable("engram.model.layers.gemv_triton"))
    return SWITCH.fast(can_run, f"{x.dtype} rows (stride {x.stride()}) on {x.device}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight[out, in].T (+ bias [out]) -> [T, out], x's dtype."""
    if gemv_fast(x, weight):
        from engram.model.layers import gemv_triton

        return gemv_triton.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def project(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through ``linear`` (the same weight and bias)."""
    return linear(x, layer.weight, layer.bias)
