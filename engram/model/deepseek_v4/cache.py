"""The per-sequence cache of a DeepSeek-V4 model: for every layer, the sliding window of keys, the compressor's
unclosed tokens, overlap slice and entries, and the indexer's keys (``attention.LayerState``): the form one step reads
and returns (the model never changes the one passed in, so a failed step commits nothing). Between steps these live in
the Worker's pool of cache-group pages (cache_layout.py, engine/runners/group_pool.py)."""
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

