"""The lightning indexer of compressed sparse attention: its own overlapping compressor at ``index_head_dim`` keeps index
keys K [E, di]; a query's score of entry e is ``sum_h w_h * relu(q_h . K_e) / sqrt(di)`` with q = ``wq_b``(the
attention's low-rank query) RoPE'd at the query's position (compress frequencies) and w = ``weights_proj``(x) /
sqrt(index_n_heads); entries the query cannot see yet score -inf. Each query keeps its ``index_topk`` best visible
entries. Scores run in the work dtype (float32; float64 for float64 models)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.deepseek_v4.compressor import Compressor, CompressorState, visible_entries
from engram.model.deepseek_v4.config import V4Config
from engram.model.deepseek_v4.mhc import work_dtype
from engram.model.deepseek_v4.rope import Rope


class Indexer(nn.Module):
    """``wq_b`` [nh*di, q_lora_rank], ``weights_proj`` [nh, H], ``compressor`` (overlapping, at di)."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.csa_ratio
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps)

    def queries(self, x: torch.Tensor, q_low: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], q_low [T, q_lora_rank], compress cos/sin [T, rd/2] -> (q [T, nh, di], head weights [T, nh]) in
        the work dtype, for every packed token at once."""
        wd = work_dtype(x.dtype)
        q = rope.apply(self.wq_b(q_low).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        w = self.weights_proj(x).to(wd) * self.n_heads ** -0.5
        return q.to(wd), w

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One sequence's queries q [t, nh, di], w [t, nh] against its index keys [E, di] -> bool [t, E]: the entries
        each query keeps (at most ``index_topk``, visible ones only). Batched decode: one query per sequence and keys
        [t, E_max, di] per query, entries past a query's visible count masked before the top-k."""
        scores = self.scores(q, w, keys, positions)  # [t, E]
        keep = torch.zeros_like(scores, dtype=torch.bool)
        k = min(self.topk, keys.shape[-2])
        if k:
            top = scores.topk(k, dim=-1).indices  # [t, k]
            keep.scatter_(1, top, True)
        return keep & torch.isfinite(scores)  # a top-k pick past the visible entries is no pick

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[t, E] index scores, -inf where the entry is not visible to the query yet (keys [E, di], or [t, E, di])."""
        eq = "thd,ted->the" if keys.dim() == 3 else "thd,ed->the"
        dots = F.relu(torch.einsum(eq, q, keys.to(q.dtype))) * self.head_dim ** -0.5  # [t, nh, E]
        scores = (dots * w.unsqueeze(-1)).sum(dim=1)  # [t, E]
        seen = torch.arange(keys.shape[-2], device=q.device) < visible_entries(positions, self.ratio).unsqueeze(-1)
        return scores.masked_fill(~seen, float("-inf"))

    def step(self, x: torch.Tensor, state: CompressorState, rope: Rope) -> CompressorState:
        """The index keys after a sequence's next tokens x [t, H]."""
        return self.compressor.step(x, state, rope)
