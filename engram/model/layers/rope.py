"""Rotary position embedding, HF "rotate half" layout (what Llama/Qwen checkpoints expect).

Angles are computed per token from its absolute position (packed batches carry ``positions`` [T]),
in float32, or float64 when the model runs in float64, then cast to the activation dtype; applying them
("rotate half") is fused.norm_rope, together with Qwen3's per-head q/k norm.
"""
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
