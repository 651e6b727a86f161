"""Small-batch projections as float32 partial sums over slices of K, summed by the next fused add + RMSNorm.

At one to four rows the decode step's o and down projections are matrix-vector products whose weights must
stream from HBM. cuBLAS runs them split-K: a GEMM writing float32 partial sums over slices of K, then a reduce
kernel, a launch of its own per projection. Here the GEMM is a strided-batched one over ``SPLITS`` slices of K
that writes the partials itself (``torch.bmm(..., out_dtype=torch.float32)``, each slice a strided view of the
weight), and the residual add that follows anyway (``fused.add_rms_norm``) sums them in its prologue; the
A/A-controlled engine A/B that keeps it is in docs/log.md.

``linear(x, weight, bias)`` returns ``Partials`` where it applies (CUDA, 2-D ``x`` of at most ``MAX_ROWS``
rows, no bias, a bf16 / fp16 weight whose K divides by ``SPLITS``), else ``F.linear``'s tensor;
``any_device=True`` (tests) takes the path on the CPU too, with float32 products. ``Partials.total()`` is the
reference sum (slices added in order in float32, rounded to the input's dtype); the fused kernel adds them in
the same order with the same rounding. Callers that cannot take partials call ``dense()``. The sum's order
differs from cuBLAS's, so the output differs from ``F.linear``'s in the last bits (tests compare against
float64); graph replays and eager steps of the same rows run the same kernels, so they stay bitwise equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, any_device: bool = False) -> bool:
    """Whether ``linear`` returns partials for these tensors."""
    return ((x.is_cuda or any_device) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and bias is None
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.shape[1] % SPLITS == 0 and weight.is_contiguous() and x.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           any_device: bool = False) -> torch.Tensor | Partials:
    """``F.linear(x, weight, bias)``, as ``Partials`` where ``applies``: x [T, K], weight [N, K]."""
    if not applies(x, weight, bias, any_device):
        return F.linear(x, weight, bias)
    t, k = x.shape
    n, ks = weight.shape[0], k // SPLITS
    xs = x.view(t, SPLITS, ks).transpose(0, 1)  # [S, T, K/S]
    ws = weight.view(n, SPLITS, ks).permute(1, 2, 0)  # [S, K/S, N]: slice s is weight[:, s*ks:(s+1)*ks].T
    if x.is_cuda:
        parts = torch.bmm(xs, ws, out_dtype=torch.float32)
    else:  # any_device: bf16 products are exact in float32
        parts = torch.bmm(xs.float(), ws.float())
    return Partials(parts, x.dtype)
