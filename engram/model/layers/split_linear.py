"""Small-batch projections as float32 partial sums over slices of K, summed by the next fused add + RMSNorm.

At one to four rows the decode step's o and down projections are matrix-vector products whose weights
(21 MB and 50 MB for 4b-like) must stream from HBM. cuBLAS runs them split-K: a GEMM writing float32
partial sums over slices of K, then a reduce kernel that sums them into the bf16 output, a separate launch
of about 2 us, 72 of them a step. Here the GEMM is a strided-batched one over ``SPLITS`` slices of K that
writes the partials itself (``torch.bmm(..., out_dtype=torch.float32)``, no copy of the weight: each slice
is a strided view), and the residual add that follows anyway (``fused.add_rms_norm``) sums them in its
prologue. Measured in a CUDA graph over 36 distinct weights on the H200 (scripts/bench_split_gemv.py,
docs/benchmarks.md): o 9.7 -> 8.0 us, down 17.5 -> 15.0 us a projection at one row, reduce included.

``linear(x, weight, bias)`` returns ``Partials`` where it applies (``ENABLED``, CUDA, 2-D ``x`` of at most
``MAX_ROWS`` rows, no bias, a bf16 / fp16 weight whose K divides by ``SPLITS``), else ``F.linear``'s tensor.
``Partials.total()`` is the reference sum (slices added in order in float32, rounded to the input's dtype);
the fused kernel adds them in the same order with the same rounding. Callers that cannot take partials
call ``dense()``. The sum's order differs from cuBLAS's, so the projection's output differs from
``F.linear``'s in the last bits (tests compare against float64); graph replays and eager steps of the same
rows run the same kernels, so they stay bitwise equal.

``ENABLED``: ``ENGRAM_SPLIT_GEMV`` (default 1), kernel switch ``split_gemv``. ``CPU_TOO`` (tests only) takes
the path on the CPU too, with float32 products, so the plumbing runs without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engram.fast_path import env_flag

ENABLED = env_flag("ENGRAM_SPLIT_GEMV", default=True)
CPU_TOO = False  # tests: take the path on the CPU as well
SPLITS = 4
MAX_ROWS = 4


@dataclass
class Partials:
    """A projection's output as ``parts`` float32 [SPLITS, T, N] to be summed, and the dtype of the sum."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:
        """The sum [T, N] in ``dtype``: slices added in order in float32, then rounded (the fused kernel's sum)."""
        acc = self.parts[0]
        for part in self.parts[1:]:
            acc = acc + part
        return acc.to(self.dtype)


def dense(y: torch.Tensor | Partials) -> torch.Tensor:
    """A projection's output as a tensor (partials summed)."""
    return y.total() if isinstance(y, Partials) else y


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear`` returns partials for these tensors."""
    return (ENABLED and (x.is_cuda or CPU_TOO) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and bias is None
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.shape[1] % SPLITS == 0 and weight.is_contiguous() and x.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | Partials:
    """``F.linear(x, weight, bias)``, as ``Partials`` where ``applies``: x [T, K], weight [N, K]."""
    if not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    t, k = x.shape
    n, ks = weight.shape[0], k // SPLITS
    xs = x.view(t, SPLITS, ks).transpose(0, 1)  # [S, T, K/S]
    ws = weight.view(n, SPLITS, ks).permute(1, 2, 0)  # [S, K/S, N]: slice s is weight[:, s*ks:(s+1)*ks].T
    if x.is_cuda:
        parts = torch.bmm(xs, ws, out_dtype=torch.float32)
    else:  # CPU_TOO: bf16 products are exact in float32
        parts = torch.bmm(xs.float(), ws.float())
    return Partials(parts, x.dtype)
