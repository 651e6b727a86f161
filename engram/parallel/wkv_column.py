"""Column-parallel WKV (``engram_config {"wkv_tp": "column"}``, v41 only): rank r keeps hidden slice [r*H/N, (r+1)*H/N)
of each of the hc_mult + 1 output blocks of ``wkv.weight`` and of ``q_weight`` / ``k_weight``, so it projects its
slice of every key and of the value from the (replicated, all-gathered) rows. The gate's two reductions over H become
one all-reduce of partial sums, and the value one all-gather::

    wkv.weight rows  | k_0 [H] | k_1 [H] | ... | v [H] |    rank r keeps [r*H/N, (r+1)*H/N) of each block
    partials [T, 2*hc]: sum_slice(x * q_w * k_w * k_i) | sum_slice(k_i^2)  -> all-reduce (float32, float64 models: 64)
    d_i = dot_i * rms(x) * rsqrt(k2_i / H + eps) / sqrt(H)  (x is replicated: rms(x) needs no collective)
    v slices [T, H/N] -> all-gather -> v [T, H];  out = x + g * v

Equal to the replicated layout up to the order of the sums (float64 tests: within 1e-9)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from engram.module import Engram, Projected, gate_from_logit
from engram.parallel.tp import REDUCE_DTYPES, all_reduce


class ColumnParallelEngram(nn.Module):
    """Stands in for a v41 ``Engram`` on one rank (same ``forward`` / ``project`` signatures, ``residual_output``)."""

    residual_output = False  # v41: forward returns the new hidden

    def __init__(self, engram: Engram, rank: int, world: int, group):
        super().__init__()
        if engram.variant != "v41":
            raise ValueError(f"engram_config.wkv_tp='column': Engram layer {engram.layer_id} is the "
                             f"{engram.variant!r} variant; column-parallel WKV exists for 'v41' only")
        hidden, hc = engram.hidden_size, engram.hc_mult
        if hidden % world:
            raise ValueError(f"engram_config.wkv_tp='column': engram.hidden_size={hidden} does not divide over "
                             f"tensor_parallel_size={world}")
        self.layer_id, self.variant, self.hc_mult, self.hidden_size = engram.layer_id, "v41", hc, hidden
        self.n_cols, self.head_dim, self.eps = engram.n_cols, engram.head_dim, engram.eps
        self.world, self.group = world, group
        self.slice = slice(rank * hidden // world, (rank + 1) * hidden // world)
        w = engram.wkv.weight.detach()  # [(hc+1)*H, n_cols*D]
        local = w.view(hc + 1, hidden, -1)[:, self.slice].reshape((hc + 1) * (hidden // world), -1)
        self.wkv = nn.Linear(local.shape[1], local.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.wkv.weight = nn.Parameter(local.contiguous(), requires_grad=False)  # [(hc+1)*H/N, n_cols*D]
        self.q_weight = nn.Parameter(engram.q_weight.detach()[:, self.slice].contiguous(), requires_grad=False)
        self.k_weight = nn.Parameter(engram.k_weight.detach()[:, self.slice].contiguous(), requires_grad=False)

    def project(self, rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> Projected:
        """rows [T, n_cols, head_dim] -> this rank's slices [T, (hc+1)*H/N] (keys, then the value)."""
        emb = rows.to(dtype).flatten(1)  # [T, n_cols*D]
        return Projected(rows.shape[0], (torch.mm(emb, self.wkv.weight.to(dtype).t(), out=out),))

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor | Projected, dead_mask: torch.Tensor | None = None,
                state=None) -> torch.Tensor:
        """hidden [T, hc, H] (replicated), rows [T, n_cols, D] (all-gathered) or their projection -> [T, hc, H]."""
        if state is not None:
            raise ValueError(f"Engram layer {self.layer_id} (v41) keeps no conv state; pass state=None")
        kv = (rows if isinstance(rows, Projected) else self.project(rows, hidden.dtype)).tensors[0]
        num_tokens, hc, full = hidden.shape
        width = full // self.world
        cd = torch.promote_types(hidden.dtype, torch.float32)
        k = kv[:, : hc * width].view(num_tokens, hc, width).to(cd)  # [T, hc, H/N] key slices
        v = kv[:, hc * width:].to(cd)  # [T, H/N] value slice
        xf = hidden.to(cd)
        rms_x = torch.rsqrt(xf.square().mean(-1) + self.eps)  # [T, hc], the whole (replicated) x
        qk_w = self.q_weight.to(cd) * self.k_weight.to(cd)  # [hc, H/N]
        partial = torch.cat([(xf[..., self.slice] * qk_w * k).sum(-1), k.square().sum(-1)], dim=1)  # [T, 2*hc]
        dot, k2 = all_reduce(partial, self.group).split(hc, dim=1)  # sums over all of H
        d = dot * rms_x * torch.rsqrt(k2 / full + self.eps) / math.sqrt(full)  # [T, hc]
        g = gate_from_logit(d, dead_mask)  # [T, hc]
        return (xf + g.unsqueeze(-1) * _all_gather_cols(v, self.world, self.group).unsqueeze(1)).to(hidden.dtype)


def _all_gather_cols(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[T, H/N] slices of every rank, in rank order -> [T, H] (in float32 unless float64 or float32 already)."""
    wide = (x if x.dtype in REDUCE_DTYPES else x.float()).contiguous()
    parts = [torch.empty_like(wide) for _ in range(world)]
    dist.all_gather(parts, wide, group=group)
    return torch.cat(parts, dim=1).to(x.dtype)


def shard_wkv_columns(model, rank: int, world: int, group) -> None:
    """Replace every Engram layer of ``model`` with its ``ColumnParallelEngram`` for rank ``rank``."""
    for layer in model.model.layers:
        if layer.engram is not None:
            layer.engram = ColumnParallelEngram(layer.engram, rank, world, group)
