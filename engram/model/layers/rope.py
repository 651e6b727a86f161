"""Rotary position embedding, HF "rotate half" layout: angles per token from its absolute position, in float32 (float64
for float64 models), cast to the activation dtype; applied by fused.norm_rope."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions LongTensor[T] -> cos, sin [T, 1, head_dim] in ``dtype``."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        half = torch.arange(0, self.head_dim, 2, dtype=work, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** half)  # [hd/2]
        angles = positions.to(work).unsqueeze(-1) * inv_freq  # [T, hd/2]
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [T, 1, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)
