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
        if self.overlap:
            # slots [0, r): the previous window's first halves; [r, 2r): this window's second halves
            prev_kv = ck.new_zeros(n, r, d)
            prev_gate = cg.new_full((n, r, d), float("-inf"))
            prev_kv[1:], prev_gate[1:] = ck[:-1, :, :d], cg[:-1, :, :d]
            if overlap_kv is not None:
                prev_kv[0], prev_gate[0] = overlap_kv, overlap_gate
            overlap_kv, overlap_gate = ck[-1, :, :d], cg[-1, :, :d]
            ck = torch.cat([prev_kv, ck[..., d:]], dim=1)  # [n, 2r, d]
            cg = torch.cat([prev_gate, cg[..., d:]], dim=1)
        weights = cg.softmax(dim=1)  # [n, w, d] work dtype, over the window's slots
        pooled = self.norm((ck * weights.to(ck.dtype)).sum(dim=1))  # [n, d]
        first = state.num_entries * r
        pos = torch.arange(n, device=x.device) * r + first  # each window's first position
        cos, sin = rope.cos_sin(pos, pooled.dtype)
        entries = torch.cat([state.entries, rope.apply(pooled, cos, sin)])
        return CompressorState(kv[usable:], gate[usable:], entries, overlap_kv, overlap_gate)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Query positions [t] -> how many entries each may read [t]: windows whose last token is at or before it."""
    return (positions + 1) // ratio
