"""RMSNorm as Llama/Qwen compute it: ``y = w * (x / sqrt(mean(x**2) + eps))`` over the last dim, statistics in float32
(float64 stays float64), returned in the input dtype (fused.rms_norm)."""
from __future__ import annotations

import torch
from torch import nn

from engram.model.layers.fused import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one fused kernel on CUDA, the torch reference elsewhere
