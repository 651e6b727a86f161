"""The KV compressor of V4's compressed layers: every ``ratio`` tokens of a sequence become one entry. A token projects
to ``kv`` and ``gate`` (``wkv``, ``wgate``); a closed window's entry is ``norm(sum_j softmax_j(gate_j + ape_j) * kv_j)``
(softmax over the window, per channel, in the work dtype), RoPE'd (compress frequencies) at the window's first
position. With ``overlap`` (compressed sparse attention and its indexer) each token projects twice the width: its
second half joins its own window, its first half the next window's, so entry w pools 2 * ratio slots (window w-1's
first halves, window w's second halves); entry 0 has no previous window (weight 0).

Per-sequence state (``CompressorState``, immutable: ``step`` returns a new one): the unclosed tokens' projections, the
first halves of the last closed window (overlap), and the entries so far."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engram.model.deepseek_v4.mhc import RMSNorm, work_dtype
from engram.model.deepseek_v4.rope import Rope


@dataclass(frozen=True)
class CompressorState:
    """One sequence's compressor state after ``position`` tokens (``entries * ratio + len(buffer) == position``)."""

    buffer_kv: torch.Tensor  # [u, c*d]: projections of the u < ratio tokens of the unclosed window
    buffer_gate: torch.Tensor  # [u, c*d] work dtype (gate + nothing yet; ape is added when the window closes)
    entries: torch.Tensor  # [E, d]: compressed entries so far, RoPE'd
    overlap_kv: torch.Tensor | None  # [ratio, d]: first halves of the last closed window (overlap only)
    overlap_gate: torch.Tensor | None  # [ratio, d] work dtype, ape included

    @property
    def num_entries(self) -> int:
        return self.entries.shape[0]

    def nbytes(self) -> int:
        ts = [self.buffer_kv, self.buffer_gate, self.entries, self.overlap_kv, self.overlap_gate]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class Compressor(nn.Module):
    """``wkv``, ``wgate`` [c*d, H] (c = 2 with overlap), ``ape`` [ratio, c*d] float32, ``norm`` [d]."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(head_dim, eps)

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> CompressorState:
        width = self.wkv.out_features
        return CompressorState(torch.zeros(0, width, dtype=dtype, device=device),
                               torch.zeros(0, width, dtype=work_dtype(dtype), device=device),
                               torch.zeros(0, self.head_dim, dtype=dtype, device=device), None, None)

    def step(self, x: torch.Tensor, state: CompressorState, rope: Rope) -> CompressorState:
        """x [t, H]: a sequence's next t tokens (their attention input) -> the state after them."""
        r, d = self.ratio, self.head_dim
        kv = torch.cat([state.buffer_kv, self.wkv(x)])  # [u + t, c*d]
        gate = torch.cat([state.buffer_gate, self.wgate(x).to(state.buffer_gate.dtype)])
        usable = kv.shape[0] // r * r
        if usable == 0:
            return CompressorState(kv, gate, state.entries, state.overlap_kv, state.overlap_gate)
        n = usable // r
        ck = kv[:usable].view(n, r, -1)  # [n, r, c*d]
        cg = gate[:usable].view(n, r, -1) + self.ape.to(gate.dtype)
        overlap_kv, overlap_gate = state.overlap_kv, state.overlap_gate
        prev_kv = prev_gate = None
        if self.overlap:
            prev_kv = ck.new_zeros(n, r, d)
            prev_gate = cg.new_full((n, r, d), float("-inf"))
            prev_kv[1:], prev_gate[1:] = ck[:-1, :, :d], cg[:-1, :, :d]
            if overlap_kv is not None:
                prev_kv[0], prev_gate[0] = overlap_kv, overlap_gate
            overlap_kv, overlap_gate = ck[-1, :, :d], cg[-1, :, :d]
        first = torch.arange(n, device=x.device) * r + state.num_entries * r  # each window's first position
        entries = torch.cat([state.entries, self.pool(ck, cg, prev_kv, prev_gate, first, rope)])
        return CompressorState(kv[usable:], gate[usable:], entries, overlap_kv, overlap_gate)

    def pool(self, ck: torch.Tensor, cg: torch.Tensor, prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None,
             first: torch.Tensor, rope: Rope) -> torch.Tensor:
        """The entries of n closed windows (shared by ``step`` and the batched decode step). ck [n, r, c*d] the
        windows' projections, cg [n, r, c*d] their gates + ape (work dtype); with overlap, prev_kv / prev_gate
        [n, r, d]: the previous windows' first halves (gate -inf where there is none: entry 0), slots [0, r) of the
        pool, the windows' own second halves slots [r, 2r); first [n] long: each window's first position (RoPE) ->
        [n, d] in ck's dtype: norm(sum softmax(gate) * kv), RoPE'd."""
        if self.overlap:
            d = self.head_dim
            ck = torch.cat([prev_kv, ck[..., d:]], dim=1)  # [n, 2r, d]
            cg = torch.cat([prev_gate, cg[..., d:]], dim=1)
        weights = cg.softmax(dim=1)  # [n, w, d] work dtype, over the window's slots
        pooled = self.norm((ck * weights.to(ck.dtype)).sum(dim=1))  # [n, d]
        cos, sin = rope.cos_sin(first, pooled.dtype)
        return rope.apply(pooled, cos, sin)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Query positions [t] -> how many entries each may read [t]: windows whose last token is at or before it."""
    return (positions + 1) // ratio
