"""DeepSeek-V4 attention, one layer. Query: low-rank ``wq_a`` -> ``q_norm`` -> ``wq_b`` -> unweighted RMS per head
-> RoPE; one shared key = value head: ``wkv`` -> ``norm`` -> RoPE (RoPE on the trailing ``rope_dim`` channels). A query
sees the last ``sliding_window`` tokens (itself included) and, in compressed layers, the compressed entries its position
has closed — all of them (heavily compressed) or the indexer's top-k (compressed sparse). Softmax with a learnable
per-head sink logit ``attn_sink`` (a column that takes weight but adds no value); the output's rope channels are rotated
back by the query's angle, then the grouped low-rank projection ``wo_a`` (block-diagonal over ``o_groups``) and
``wo_b``. Sliding-window layers use the main RoPE, compressed layers the compress RoPE.

Token-wise projections run over all packed tokens at once; attention, compressor and indexer run one sequence at a
time on that sequence's ``LayerState``, and return the new state (the caller commits it). The batched static-shape
decode step (batched_decode.py) reuses ``project``, ``sink_probs`` and ``project_out``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engram.model.deepseek_v4.compressor import Compressor, CompressorState, visible_entries
from engram.model.deepseek_v4.config import CSA, HCA, V4Config
from engram.model.deepseek_v4.indexer import Indexer
from engram.model.deepseek_v4.mhc import RMSNorm, rms_norm, work_dtype
from engram.model.deepseek_v4.rope import Rope


@dataclass(frozen=True)
class LayerState:
    """One sequence's attention state in one layer after ``position`` tokens."""

    window: torch.Tensor  # [min(position, W-1), d]: the last keys (= values), RoPE'd, oldest first
    compressor: CompressorState | None  # compressed layers: the KV compressor
    indexer: CompressorState | None  # compressed sparse layers: the index keys

    def nbytes(self) -> int:
        return (self.window.numel() * self.window.element_size()
                + sum(s.nbytes() for s in (self.compressor, self.indexer) if s is not None))


@dataclass
class SeqSlice:
    """Where one sequence sits in a packed step: rows ``lo:hi``."""

    lo: int
    hi: int


class Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int):
        super().__init__()
        self.kind = cfg.layer_types[layer_id]
        self.n_heads, self.head_dim, self.window = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        self.groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        self.ratio = cfg.ratio(layer_id)
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        group_in = cfg.num_heads * cfg.head_dim // cfg.o_groups
        self.wo_a = nn.Linear(group_in, cfg.o_groups * cfg.o_lora_rank, bias=False)  # [g*r, in/g]: block-diagonal
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(cfg.num_heads))
        if self.kind in (CSA, HCA):
            self.compressor = Compressor(cfg.hidden_size, cfg.head_dim, self.ratio, self.kind == CSA,
                                         cfg.rms_norm_eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg)

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> LayerState:
        comp = self.compressor.empty_state(dtype, device) if self.kind in (CSA, HCA) else None
        index = self.indexer.compressor.empty_state(dtype, device) if self.kind == CSA else None
        return LayerState(torch.zeros(0, self.head_dim, dtype=dtype, device=device), comp, index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, seqs: list[SeqSlice],
                states: list[LayerState]) -> tuple[torch.Tensor, list[LayerState]]:
        """x [T, H] (normed block input of every packed token) -> (output [T, H], each sequence's new state)."""
        cos, sin, q, kv, iq = self.project(x, positions, rope)
        out = torch.empty_like(q)
        new_states = []
        for s, st in zip(seqs, states):
            sl = slice(s.lo, s.hi)
            state = self._advance(x[sl], kv[sl], st, rope)
            extra, keep = None, None
            if self.kind in (CSA, HCA):
                extra = state.compressor.entries  # [E, d]
                if self.kind == CSA:
                    keep = self.indexer.select(iq[0][sl], iq[1][sl], state.indexer.entries, positions[sl])
                else:
                    keep = (torch.arange(extra.shape[0], device=x.device)
                            < visible_entries(positions[sl], self.ratio).unsqueeze(-1))
            out[sl] = self._attend(q[sl], st.window, kv[sl], extra, keep)
            new_states.append(state)
        return self.project_out(out, cos, sin, rope), new_states

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope):
        """The token-wise projections of x [T, H] at positions [T] -> (cos, sin [T, rd/2], queries [T, nh, d] and
        keys [T, d] RoPE'd, the indexer's (queries, head weights) in CSA layers else None)."""
        t = x.shape[0]
        cos, sin = rope.cos_sin(positions, x.dtype)  # [T, rd/2]
        q_low = self.q_norm(self.wq_a(x))  # [T, q_lora_rank]
        q = rms_norm(self.wq_b(q_low).view(t, self.n_heads, self.head_dim), None, self.eps)
        q = rope.apply(q, cos, sin)  # [T, nh, d]
        kv = rope.apply(self.norm(self.wkv(x)), cos, sin)  # [T, d]
        iq = self.indexer.queries(x, q_low, cos, sin, rope) if self.kind == CSA else None
        return cos, sin, q, kv, iq

    def project_out(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Attention output [T, nh, d] -> [T, H]: inverse RoPE at the query's angle, grouped ``wo_a``, ``wo_b``."""
        out = rope.apply(out, cos, sin, inverse=True)  # undo the values' rotation at the query's angle
        grouped = out.reshape(out.shape[0], self.groups, -1)  # [T, g, nh*d/g]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [g, r, nh*d/g]
        low = torch.einsum("tgi,gri->tgr", grouped, w).flatten(1)  # [T, g*r]
        return self.wo_b(low)

    def _advance(self, x: torch.Tensor, kv: torch.Tensor, st: LayerState, rope: Rope) -> LayerState:
        """A sequence's state after its new tokens: window, compressed entries, index keys."""
        keys = torch.cat([st.window, kv])
        comp = self.compressor.step(x, st.compressor, rope) if st.compressor is not None else None
        index = self.indexer.step(x, st.indexer, rope) if st.indexer is not None else None
        return LayerState(keys[max(0, keys.shape[0] - (self.window - 1)):], comp, index)

    def _attend(self, q: torch.Tensor, window: torch.Tensor, kv: torch.Tensor, extra: torch.Tensor | None,
                keep: torch.Tensor | None) -> torch.Tensor:
        """One sequence: q [t, nh, d], cached window [w, d], new keys [t, d], entries [E, d] with keep [t, E] ->
        [t, nh, d]. Keys = values (shared KV)."""
        t, w = q.shape[0], window.shape[0]
        keys = torch.cat([window, kv])  # positions start-w .. start+t-1
        qpos = torch.arange(t, device=q.device).unsqueeze(1) + w  # [t, 1] in key index space
        kpos = torch.arange(w + t, device=q.device).unsqueeze(0)
        allowed = (kpos <= qpos) & (kpos > qpos - self.window)  # [t, w+t]: causal sliding window
        if extra is not None:
            keys = torch.cat([keys, extra.to(keys.dtype)])
            allowed = torch.cat([allowed, keep], dim=1)
        logits = torch.einsum("thd,kd->htk", q, keys).to(work_dtype(q.dtype)) * self.head_dim ** -0.5  # [nh, t, K]
        return torch.einsum("htk,kd->thd", self.sink_probs(logits, allowed).to(keys.dtype), keys)

    def sink_probs(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Scaled logits [nh, t, K] (work dtype), allowed bool [t, K] -> probabilities [nh, t, K]: masked to -inf where
        not allowed, softmax with the per-head sink column (which takes weight but adds no value)."""
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = self.attn_sink.to(logits.dtype).view(-1, 1, 1).expand(-1, logits.shape[1], 1)  # [nh, t, 1]
        full = torch.cat([logits, sink], dim=-1)
        return torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
