"""DeepSeek-V4's MoE block (every layer): a router scores the routed experts (``sqrtsoftplus`` = sqrt(softplus(z)),
or sigmoid / softmax), picks ``num_experts_per_tok`` of them — by top-k of score + ``gate.bias`` (``moe``), or by the
frozen ``gate.tid2eid[token id]`` table (``hash_moe``) — and weighs them by their scores normalised to sum 1, times
``routed_scaling_factor``; a shared expert is added. Experts are SwiGLU with ``swiglu_limit`` clamps, names as in the
checkpoints: ``ffn.experts.E.w{1,2,3}``, ``ffn.shared_experts.w{1,2,3}``, ``ffn.gate.{weight,bias,tid2eid}``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.deepseek_v4.config import V4Config


class Expert(nn.Module):
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))."""

    def __init__(self, hidden: int, inner: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    """Router: ``weight`` [E, H]; ``bias`` [E] float32 (top-k layers) or ``tid2eid`` [vocab, k] (hash layers)."""

    def __init__(self, cfg: V4Config, hashed: bool):
        super().__init__()
        self.hashed, self.top_k = hashed, cfg.num_experts_per_tok
        self.scoring, self.scale = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], token ids [T] -> (weights [T, k] in x's dtype's work type, expert ids [T, k])."""
        logits = F.linear(x, self.weight)  # [T, E]
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            ids = self.tid2eid[token_ids].long()  # [T, k]
        else:
            ids = torch.topk(scores + self.bias.to(scores.dtype), self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int):
        super().__init__()
        self.gate = Gate(cfg, cfg.mlp_layer_types[layer_id] == "hash_moe")
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: each token's routed experts (grouped by expert) plus the shared expert."""
        weights, ids = self.gate(x, token_ids)  # [T, k] each
        out = torch.zeros_like(x)
        hit = torch.unique(ids).tolist()  # one host read a layer: the eager path (fused MoE is the speed issue)
        for e in hit:
            rows, slot = torch.where(ids == e)  # tokens routed to e, and which of their k picks it is
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out + self.shared_experts(x)
