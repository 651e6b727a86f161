"""Packing sibling projections (q/k/v, gate/up) into one weight so each runs as one GEMM: each ``nn.Linear.weight``
becomes a view of its row block, so names, state dicts and memory stay as they were."""
from __future__ import annotations

import torch
from torch import nn


def pack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of out_features, in_features] (+ bias) that the given layers now view; returns it."""
    if len({l.in_features for l in linears}) != 1 or len({l.bias is None for l in linears}) != 1:
        raise ValueError("pack_linears: layers must share in_features and all have, or all lack, a bias")
    weight = torch.cat([l.weight.detach() for l in linears])  # [sum out, in]
    bias = None if linears[0].bias is None else torch.cat([l.bias.detach() for l in linears])
    at = 0
    for l in linears:
        n = l.out_features
        l.weight = nn.Parameter(weight[at:at + n], requires_grad=False)
        if bias is not None:
            l.bias = nn.Parameter(bias[at:at + n], requires_grad=False)
        at += n
    return weight, bias
