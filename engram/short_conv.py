"""ShortConv of the paper variant and its explicit per-sequence decode state. ``ShortConv`` maps v' [T, hc_mult, H]
(packed sequences) to SiLU(conv(RMSNorm(v'))): a per-branch RMSNorm, then a depthwise causal Conv1d over hc_mult*H
channels (``kernel_size``, dilation ``max_ngram_size``, no bias). A ``ShortConvState`` holds each sequence's last L =
(kernel-1)*dilation post-norm inputs, so whole, chunked and token-by-token runs give the same numbers; ``tap_rows`` asks
a call for some tokens' inputs besides (the prefix cache stores those of each block's last tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engram.config import EngramConfig


def history_len(cfg: EngramConfig) -> int:
    """Conv inputs a sequence must remember: (kernel_size - 1) * dilation, dilation = max_ngram_size."""
    return (cfg.kernel_size - 1) * cfg.max_ngram_size


@dataclass
class ShortConvState:
    """Conv history of S sequences whose new tokens are packed back to back in one call: ``conv[s, i]`` is sequence s's
    conv input i steps into its window, oldest first (zeros when fresh); ``ShortConv.forward`` overwrites it in place
    with the window ending at each sequence's last new token."""

    conv: torch.Tensor  # [S, L, hc_mult*H] post-norm conv inputs, L = (kernel-1)*dilation
    cu_seqlens: torch.Tensor | None = None  # [S+1] int64 token offsets of the packed call; None: S == 1
    tap_rows: torch.Tensor | None = None  # [R] int64 packed token rows whose conv inputs the call also hands out
    tapped: torch.Tensor | None = None  # [R, hc_mult*H] set by ``ShortConv.forward``: those rows' conv inputs
    # speculative decoding: the call also keeps ``extra`` more rows before each window (``window``, [S, L + extra,
    # C]), so ``rewind`` can end a sequence's state up to ``extra`` tokens before its last one, without recompute
    extra: int = 0
    window: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.conv.dim() != 3:
            raise ValueError(f"ShortConvState.conv must be [S, L, C], got shape {tuple(self.conv.shape)}")
        if self.cu_seqlens is not None:
            if self.cu_seqlens.dim() != 1 or self.cu_seqlens.numel() != self.num_seqs + 1:
                raise ValueError(f"ShortConvState.cu_seqlens has shape {tuple(self.cu_seqlens.shape)}, "
                                 f"expected [{self.num_seqs + 1}] for {self.num_seqs} sequences")

    @classmethod
    def zeros(cls, num_seqs: int, cfg: EngramConfig, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> "ShortConvState":
        """Fresh state for ``num_seqs`` sequences that have not produced any token yet."""
        if num_seqs < 0:
            raise ValueError(f"ShortConvState.zeros: num_seqs={num_seqs} must be >= 0")
        conv = torch.zeros(num_seqs, history_len(cfg), cfg.hc_mult * cfg.hidden_size, dtype=dtype, device=device)
        return cls(conv)

    @property
    def num_seqs(self) -> int:
        return self.conv.shape[0]

    def with_cu_seqlens(self, cu_seqlens: torch.Tensor | Sequence[int]) -> "ShortConvState":
        """Same buffers (shared, so the in-place update is seen here), new packing for the next call."""
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=self.conv.device)
        return ShortConvState(self.conv, cu)

    @classmethod
    def stack(cls, states: Sequence["ShortConvState"],
              cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> "ShortConvState":
        """Concatenate states (copies) into one batch state, in order; ``split`` hands them back."""
        if not states:
            raise ValueError("ShortConvState.stack needs at least one state")
        shapes = {tuple(s.conv.shape[1:]) for s in states}
        if len(shapes) != 1:
            raise ValueError(f"ShortConvState.stack: states have different [L, C] shapes {sorted(shapes)}")
        out = cls(torch.cat([s.conv for s in states], dim=0))  # [sum S_i, L, C]
        return out if cu_seqlens is None else out.with_cu_seqlens(cu_seqlens)

    def split(self) -> list["ShortConvState"]:
        """One single-sequence state per row, viewing this state's buffer (no copy)."""
        return [ShortConvState(self.conv[s:s + 1]) for s in range(self.num_seqs)]

    def index_select(self, index: torch.Tensor | Sequence[int],
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> "ShortConvState":
        """Rows ``index`` of a slot pool as a new batch state (a copy); write back with ``scatter_``."""
        idx = torch.as_tensor(index, dtype=torch.int64, device=self.conv.device)
        out = ShortConvState(self.conv.index_select(0, idx))  # [len(idx), L, C]
        return out if cu_seqlens is None else out.with_cu_seqlens(cu_seqlens)

    def scatter_(self, index: torch.Tensor | Sequence[int], src: "ShortConvState") -> "ShortConvState":
        """Write ``src``'s rows into rows ``index`` of this state (in place); returns self."""
        idx = torch.as_tensor(index, dtype=torch.int64, device=self.conv.device)
        if idx.numel() != src.num_seqs or src.conv.shape[1:] != self.conv.shape[1:]:
            raise ValueError(f"ShortConvState.scatter_: {idx.numel()} indices for a source of shape "
                             f"{tuple(src.conv.shape)} into {tuple(self.conv.shape)}")
        self.conv.index_copy_(0, idx, src.conv.to(self.conv.dtype))
        return self

    def reset_(self, index: torch.Tensor | Sequence[int]) -> "ShortConvState":
        """Zero rows ``index`` (a slot taken by a new sequence); returns self."""
        idx = torch.as_tensor(index, dtype=torch.int64, device=self.conv.device)
        self.conv.index_fill_(0, idx, 0)
        return self

    def rewind(self, dropped: torch.Tensor) -> "ShortConvState":
        """Set each sequence's state to the window ending ``dropped[s]`` tokens before its last new one (its rejected
        drafts), from the ``window`` the last call kept: dropped [S] int64 on the state's device, each in [0, extra]
        and below the sequence's new tokens. No recompute, no host synchronisation; returns self."""
        if self.window is None:
            raise RuntimeError("ShortConvState.rewind: the last call kept no window (set extra before it)")
        hist = self.conv.shape[1]
        start = self.extra - dropped.to(self.conv.device)  # [S] first window row of the kept state
        rows = start.unsqueeze(1) + torch.arange(hist, device=self.conv.device)  # [S, L]
        index = rows.unsqueeze(2).expand(-1, -1, self.conv.shape[2])  # [S, L, C]
        self.conv.copy_(self.window.gather(1, index))
        return self

    def clone(self) -> "ShortConvState":
        return ShortConvState(self.conv.clone(), None if self.cu_seqlens is None else self.cu_seqlens.clone())


def _check_cu_seqlens(cu: torch.Tensor, num_seqs: int, num_tokens: int) -> None:
    if cu.dim() != 1 or cu.numel() != num_seqs + 1:
        raise ValueError(f"cu_seqlens has shape {tuple(cu.shape)}, expected [{num_seqs + 1}] for {num_seqs} sequences")
    if cu.device.type == "cpu":  # value checks would force a device sync on GPU
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((lengths < 0).any()):
            raise ValueError(f"cu_seqlens={cu.tolist()} must start at 0, be non-decreasing and end at "
                             f"the {num_tokens} packed tokens")


def causal_conv_packed(x: torch.Tensor, history: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor,
                       dilation: int, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over packed sequences that continue from ``history``: x [T, C], history [S, L, C],
    cu_seqlens [S+1], weight [C, k] (tap k-1 is the current token) -> (y [T, C], new history [S, L + keep, C]: the
    inputs ending at each sequence's last token; ``keep`` rows more than the state needs, for a rewind).
    y[t] = sum_j weight[:, j] * in[t - (k-1-j)*dilation], taps summed in order, so packing never changes it.
    Sequence s sits at cu[s] + s*L of ``ext = [hist_0 | tok_0 | hist_1 | tok_1 | ...]``."""
    num_tokens, channels = x.shape
    num_seqs, hist, _ = history.shape
    k = weight.shape[1]
    if hist != (k - 1) * dilation:
        raise ValueError(f"history holds {hist} steps, the conv needs (k-1)*dilation = {(k - 1) * dilation}")
    _check_cu_seqlens(cu_seqlens, num_seqs, num_tokens)
    dev = x.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    seq_ids = torch.arange(num_seqs, device=dev)
    seq_of_tok = torch.repeat_interleave(seq_ids, cu[1:] - cu[:-1], output_size=num_tokens)  # [T]
    tok_pos = torch.arange(num_tokens, device=dev) + (seq_of_tok + 1) * hist  # [T] rows of ext
    steps = torch.arange(hist, device=dev)
    hist_pos = (cu[:-1] + seq_ids * hist).unsqueeze(1) + steps  # [S, L]
    ext = x.new_empty(num_tokens + num_seqs * hist, channels)  # [T + S*L, C]
    ext[hist_pos.reshape(-1)] = history.reshape(-1, channels).to(x.dtype)
    ext[tok_pos] = x
    w = weight.to(x.dtype)
    y = w[:, 0] * ext[tok_pos - (k - 1) * dilation]  # [T, C]
    for j in range(1, k):
        y = y + w[:, j] * ext[tok_pos - (k - 1 - j) * dilation]
    # [S, L + keep]: the last L + keep rows of each sequence; rows before its own are clamped, and a rewind never
    # reaches them (it keeps at least one new token of each sequence)
    new_pos = ((cu[1:] + seq_ids * hist - keep).unsqueeze(1)
               + torch.arange(hist + keep, device=dev)).clamp(min=0)
    new_history = ext[new_pos.reshape(-1)].reshape(num_seqs, hist + keep, channels)
    return y, new_history


class ShortConv(nn.Module):
    """Per-branch RMSNorm -> depthwise causal Conv1d (no bias) -> SiLU over [T, hc_mult, H]. Parameter names follow
    DeepSeek's demo (``conv.weight`` [C, 1, k], ``norms.{i}.weight``); the weight is applied by ``causal_conv_packed``
    (one path for whole, chunked and packed inputs)."""

    def __init__(self, cfg: EngramConfig):
        super().__init__()
        self.hc_mult, self.hidden_size = cfg.hc_mult, cfg.hidden_size
        self.kernel_size, self.dilation = cfg.kernel_size, cfg.max_ngram_size
        self.history_len = history_len(cfg)  # conv inputs a sequence's state keeps
        channels = cfg.hc_mult * cfg.hidden_size
        self.conv = nn.Conv1d(channels, channels, kernel_size=cfg.kernel_size, groups=channels, bias=False,
                              dilation=cfg.max_ngram_size)
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) for _ in range(cfg.hc_mult))

    def forward(self, x: torch.Tensor, state: ShortConvState | None = None) -> torch.Tensor:
        """x [T, hc_mult, H] -> same; ``state`` None: one whole sequence, else ``state.num_seqs`` packed (updated)"""
        if x.dim() != 3 or x.shape[1:] != (self.hc_mult, self.hidden_size):
            raise ValueError(f"ShortConv input has shape {tuple(x.shape)}, "
                             f"expected [T, {self.hc_mult}, {self.hidden_size}]")
        num_tokens = x.shape[0]
        normed = torch.cat([F.rms_norm(x[:, i], (self.hidden_size,), norm.weight.to(x.dtype), norm.eps)
                            for i, norm in enumerate(self.norms)], dim=-1)  # [T, hc*H], branch-major
        if state is None:
            history = normed.new_zeros(1, self.history_len, normed.shape[1])  # [1, L, C]
            cu = torch.tensor([0, num_tokens], dtype=torch.int64, device=x.device)
        else:
            if state.conv.shape[1:] != (self.history_len, normed.shape[1]):
                raise ValueError(f"ShortConvState.conv has shape {tuple(state.conv.shape)}, expected "
                                 f"[S, {self.history_len}, {normed.shape[1]}]")
            history = state.conv
            cu = state.cu_seqlens
            if cu is None:
                if state.num_seqs != 1:
                    raise ValueError(f"ShortConvState holds {state.num_seqs} sequences but has no cu_seqlens")
                cu = torch.tensor([0, num_tokens], dtype=torch.int64, device=x.device)
        extra = state.extra if state is not None else 0
        y, new_history = causal_conv_packed(normed, history, cu, self.conv.weight[:, 0, :], self.dilation, extra)
        if state is not None:
            state.conv.copy_(new_history[:, extra:])
            if extra:
                state.window = new_history
            if state.tap_rows is not None:  # the inputs a prefix cache keeps with each KV block (engine side)
                state.tapped = normed.index_select(0, state.tap_rows)
        return F.silu(y).view(num_tokens, self.hc_mult, self.hidden_size)
