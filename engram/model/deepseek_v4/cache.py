"""The per-sequence cache of a DeepSeek-V4 model: for every layer, the sliding window of keys, the compressor's
unclosed tokens, overlap slice and entries, and the indexer's keys (``attention.LayerState``). The Worker owns one per
running sequence (engine/runners/deepseek_v4.py); the model reads it and returns a new one, so a failed step commits
nothing. Unpaged: paging these is the next step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.model.deepseek_v4.attention import LayerState


@dataclass(frozen=True)
class SequenceCache:
    position: int  # tokens this cache has seen (the next token's position)
    layers: tuple[LayerState, ...]  # one per decoder layer

    @classmethod
    def empty(cls, model, dtype: torch.dtype, device: torch.device | str) -> "SequenceCache":
        """A fresh cache (position 0) for every layer of ``model`` (a DeepseekV4Model)."""
        device = torch.device(device)
        return cls(0, tuple(layer.attn.empty_state(dtype, device) for layer in model.model.layers))

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)


def bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """An upper bound of the bytes a sequence's cache grows by per token (what a KV budget counts): a window key per
    layer until the window is full, plus each compressed layer's entries (and index keys) of 1 / ratio tokens."""
    per = 0.0
    for layer in range(cfg.num_layers):
        r = cfg.ratio(layer)
        per += cfg.head_dim + (cfg.head_dim / r if r else 0) + (cfg.index_head_dim / r if r == cfg.csa_ratio else 0)
    return max(1, int(per * torch.empty((), dtype=dtype).element_size() + 0.5))
