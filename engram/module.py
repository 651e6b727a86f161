"""Engram fusion: gate looked-up table rows against the hidden state and fuse them in.

``Engram(cfg, layer_id)(hidden [T, hc_mult, H], rows [T, n_cols, head_dim], dead_mask, state)``: ``v41``
returns x + g*v per branch; ``paper`` returns the residual contribution v' + ShortConv(v'). The module never
reads or hashes the table and keeps no per-sequence state (the paper's conv history is a caller's
``ShortConvState``). Gate per branch i, reductions over H, in float32 (float64 for float64 hidden)::

    v41:   d = sum(x * q_w[i] * k_w[i] * k_i) * rms(x) * rms(k_i) / sqrt(H),  rms(z) = rsqrt(mean(z^2) + eps)
    paper: d = sum(norm2[i](x) * norm1[i](key_proj[i](e))) / sqrt(H)          (nn.RMSNorm, eps = cfg)
    g = sigmoid(sign(d) * sqrt(max(|d|, 1e-6))); DEAD positions get g = 0"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram.config import EngramConfig
from engram.embedding import EngramEmbedding
from engram.model.layers import fused
from engram.short_conv import ShortConv, ShortConvState

__all__ = ["Engram", "EngramEmbedding", "Projected", "ShortConv", "ShortConvState", "GATE_CLAMP"]

GATE_CLAMP = 1e-6  # |d| floor before the square root, as in both published implementations


def gate_from_logit(d: torch.Tensor, dead_mask: torch.Tensor | None) -> torch.Tensor:
    """d [T, hc] -> g = sigmoid(sign(d) * sqrt(max(|d|, 1e-6))) [T, hc], 0 where ``dead_mask`` [T]."""
    g = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp_min(GATE_CLAMP)))
    if dead_mask is not None:
        g = g.masked_fill(dead_mask.unsqueeze(1), 0.0)
    return g


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Projected:
    """What a layer computes from its rows alone (v41: the ``wkv`` output [T, (hc_mult+1)*H]; paper: keys and value),
    taken by ``Engram.forward`` in place of the rows, so it can run ahead on another stream."""

    num_tokens: int
    tensors: tuple[torch.Tensor, ...]


class Engram(nn.Module):
    """One Engram layer's fusion module (float32 parameters). v41: ``wkv.weight`` [(hc_mult+1)*H, n_cols*head_dim]
    (keys, then the shared value), ``q_weight``, ``k_weight`` [hc_mult, H]; paper: the demo's names."""

    def __init__(self, cfg: EngramConfig, layer_id: int):
        super().__init__()
        if layer_id not in cfg.layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer (engram.layer_ids={cfg.layer_ids})")
        self.cfg, self.layer_id, self.variant = cfg, layer_id, cfg.variant
        self.hc_mult, self.hidden_size = cfg.hc_mult, cfg.hidden_size
        self.n_cols, self.head_dim = cfg.n_cols, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.residual_output = cfg.variant == "paper"
        in_features, hidden = cfg.n_cols * cfg.head_dim, cfg.hidden_size
        if cfg.variant == "v41":
            self.wkv = nn.Linear(in_features, hidden * (cfg.hc_mult + 1), bias=False)
            self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, hidden))
            self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, hidden))
        else:
            self.value_proj = nn.Linear(in_features, hidden)
            self.key_projs = nn.ModuleList(nn.Linear(in_features, hidden) for _ in range(cfg.hc_mult))
            self.norm1 = nn.ModuleList(nn.RMSNorm(hidden, eps=cfg.rms_norm_eps) for _ in range(cfg.hc_mult))
            self.norm2 = nn.ModuleList(nn.RMSNorm(hidden, eps=cfg.rms_norm_eps) for _ in range(cfg.hc_mult))
            self.short_conv = ShortConv(cfg)

    @property
    def has_state(self) -> bool:
        """True when the caller must keep a ``ShortConvState`` per sequence (paper variant)."""
        return self.variant == "paper"

    def new_state(self, num_seqs: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> ShortConvState:
        """Fresh conv state for ``num_seqs`` sequences (paper variant only)."""
        if not self.has_state:
            raise ValueError(f"Engram layer {self.layer_id} ({self.variant}) keeps no conv state")
        return ShortConvState.zeros(num_seqs, self.cfg, dtype=dtype, device=device)

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, variant={self.variant}, hc_mult={self.hc_mult}, "
                f"hidden={self.hidden_size}, n_cols={self.n_cols}, head_dim={self.head_dim}")

    # ----------------------------------------------------------------- forward
    def project(self, rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> Projected:
        """rows [T, n_cols, head_dim] -> their projections in ``dtype``; ``out`` (v41): the wkv buffer to write into."""
        emb = rows.to(dtype).flatten(1)  # [T, n_cols*head_dim]
        if self.variant == "v41":
            return Projected(rows.shape[0], (torch.mm(emb, self.wkv.weight.to(dtype).t(), out=out),))
        keys = tuple(F.linear(emb, p.weight.to(dtype), p.bias.to(dtype)) for p in self.key_projs)  # [T, H] each
        return Projected(rows.shape[0], keys + (F.linear(emb, self.value_proj.weight.to(dtype),
                                                         self.value_proj.bias.to(dtype)),))

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor | Projected, dead_mask: torch.Tensor | None = None,
                state: ShortConvState | None = None) -> torch.Tensor:
        """hidden [T, hc_mult, H], rows [T, n_cols, head_dim] or their ``project``-ion, dead_mask [T] bool -> [T,
        hc_mult, H] (v41: the new hidden; paper: the residual contribution)."""
        self._check_inputs(hidden, rows, dead_mask)
        if self.variant == "v41" and state is not None:
            raise ValueError(f"Engram layer {self.layer_id} (v41) keeps no conv state; pass state=None")
        proj = rows if isinstance(rows, Projected) else self.project(rows, hidden.dtype)
        if self.variant == "v41":
            return self._forward_v41(hidden, proj.tensors[0], dead_mask)
        return self._forward_paper(hidden, proj.tensors, dead_mask, state)

    def _check_inputs(self, hidden: torch.Tensor, rows: torch.Tensor, dead_mask: torch.Tensor | None) -> None:
        where = f"Engram layer {self.layer_id}"
        if hidden.dim() != 3 or hidden.shape[1:] != (self.hc_mult, self.hidden_size):
            raise ValueError(f"{where}: hidden has shape {tuple(hidden.shape)}, "
                             f"expected [T, hc_mult={self.hc_mult}, H={self.hidden_size}]")
        if not hidden.is_floating_point():
            raise ValueError(f"{where}: hidden must be a float tensor, got {hidden.dtype}")
        num_tokens = hidden.shape[0]
        if isinstance(rows, Projected):
            if rows.num_tokens != num_tokens:
                raise ValueError(f"{where}: projected rows of {rows.num_tokens} tokens for a hidden of {num_tokens}")
        elif rows.shape != (num_tokens, self.n_cols, self.head_dim):
            raise ValueError(f"{where}: rows has shape {tuple(rows.shape)}, "
                             f"expected [T={num_tokens}, n_cols={self.n_cols}, head_dim={self.head_dim}]")
        if dead_mask is not None and (dead_mask.dtype != torch.bool or dead_mask.shape != (num_tokens,)):
            raise ValueError(f"{where}: dead_mask must be bool [T={num_tokens}], "
                             f"got {dead_mask.dtype} {tuple(dead_mask.shape)}")

    def _forward_v41(self, x: torch.Tensor, kv: torch.Tensor, dead_mask: torch.Tensor | None) -> torch.Tensor:
        """kv [T, (hc+1)*H]: the projected rows; the torch reference, routed on CUDA to one fused kernel where it can"""
        if fused.engram_gate_fast(x, kv):
            from engram.model.layers import fused_triton

            return fused_triton.engram_gate_v41(x, kv, self.q_weight.contiguous(), self.k_weight.contiguous(),
                                                self.eps, dead_mask)
        num_tokens, hc, hidden = x.shape
        cd = _compute_dtype(x.dtype)
        k = kv[:, : hc * hidden].view(num_tokens, hc, hidden).to(cd)  # [T, hc, H] one key per branch
        v = kv[:, hc * hidden:].to(cd)  # [T, H] shared value
        xf = x.to(cd)
        rms_x = torch.rsqrt(xf.square().mean(-1) + self.eps)  # [T, hc]
        rms_k = torch.rsqrt(k.square().mean(-1) + self.eps)  # [T, hc]
        qk_w = (self.q_weight.to(cd) * self.k_weight.to(cd))  # [hc, H]
        d = (xf * qk_w * k).sum(-1) * rms_x * rms_k / math.sqrt(hidden)  # [T, hc]
        g = gate_from_logit(d, dead_mask)  # [T, hc]
        return (xf + g.unsqueeze(-1) * v.unsqueeze(1)).to(x.dtype)  # [T, hc, H]

    def _forward_paper(self, x: torch.Tensor, proj: tuple[torch.Tensor, ...], dead_mask: torch.Tensor | None,
                       state: ShortConvState | None) -> torch.Tensor:
        """proj: the key projections [T, H] per branch, then the value [T, H] (``project``)."""
        hidden = self.hidden_size
        cd = _compute_dtype(x.dtype)
        logits = []
        for i in range(self.hc_mult):
            key = proj[i]  # [T, H]
            nk = F.rms_norm(key.to(cd), (hidden,), self.norm1[i].weight.to(cd), self.eps)
            nq = F.rms_norm(x[:, i].to(cd), (hidden,), self.norm2[i].weight.to(cd), self.eps)
            logits.append((nk * nq).sum(-1) / math.sqrt(hidden))  # [T]
        g = gate_from_logit(torch.stack(logits, dim=1), dead_mask)  # [T, hc]
        v = proj[self.hc_mult]  # [T, H]
        gated = (g.unsqueeze(-1) * v.to(cd).unsqueeze(1)).to(x.dtype)  # [T, hc, H] v'
        return gated + self.short_conv(gated, state)
