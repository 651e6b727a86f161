"""RMSNorm as Llama/Qwen compute it: statistics in float32 (float64 stays float64), weight applied last.

``y = w * (x / sqrt(mean(x**2) + eps))`` over the last dim, returned in the input dtype.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x if dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
