"""Static hyper-connections (Zhu et al., 2024): ``hc_mult`` residual streams ``h [T, hc_mult, H]`` around each block.
``collapse``: x = sum_k in_weight[k] * h[:, k]; ``expand``: h'[:, k] = sum_j res_weight[k, j] * h[:, j] +
out_weight[k] * y. Initialised to a plain residual on one stream; with ``hc_mult == 1`` the decoder skips this module
(exactly h + y)."""
from __future__ import annotations

import torch
from torch import nn


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, layer_id: int):
        super().__init__()
        self.hc_mult = hc_mult
        self.in_weight = nn.Parameter(torch.eye(hc_mult)[layer_id % hc_mult].clone())  # [hc] one-hot
        self.res_weight = nn.Parameter(torch.eye(hc_mult))  # [hc, hc]: row k = what stream k keeps of each stream
        self.out_weight = nn.Parameter(torch.ones(hc_mult))  # [hc]

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hc, H] -> block input [T, H]."""
        return (h * self.in_weight.unsqueeze(-1)).sum(dim=1)

    def expand(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """h [T, hc, H], block output y [T, H] -> new streams [T, hc, H]."""
        mixed = torch.einsum("kj,tjd->tkd", self.res_weight, h)  # [T, hc, H]
        return mixed + self.out_weight.view(1, -1, 1) * y.unsqueeze(1)
