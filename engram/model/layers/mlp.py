"""SwiGLU MLP with Llama/Qwen tensor names: down(silu(gate(x)) * up(x)), no biases."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.layers import split_linear
from engram.model.layers.fused import silu_mul
from engram.model.layers.packed_linear import pack_linears
from engram.model.layers.split_linear import Partials


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # packed weight, once packed
        self.intermediate_size = intermediate_size

    def pack(self) -> None:
        """Run gate and up as one GEMM from now on (packed_linear.py)."""
        if self.gate_up is None:
            self.gate_up = pack_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor | Partials:
        """x [T, H] -> [T, H]; ``partials``: the down projection may return split_linear.Partials."""
        if self.gate_up is not None:
            g, u = F.linear(x, *self.gate_up).split(self.intermediate_size, dim=-1)  # views of one [T, 2I]
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        if partials:
            return split_linear.linear(silu_mul(g, u), self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(silu_mul(g, u))  # [T, H]
