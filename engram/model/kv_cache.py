"""Paged KV cache: per KV-source layer, K and V [num_blocks, block_size, n_kv_heads, head_dim]; a token lives at flat
slot ``block * block_size + offset``. Only KV-source layers get tensors (``kv_source_layer_ids``); a sharing layer reads
its source's. Plain torch, any dtype and device."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, layers, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"kv_cache.{name}={v!r}: must be >= 1")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.layers = tuple(int(l) for l in layers)
        self.n_kv_heads, self.head_dim = int(n_kv_heads), int(head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        shape = (self.num_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        self.k = {l: torch.zeros(shape, dtype=dtype, device=self.device) for l in self.layers}
        self.v = {l: torch.zeros(shape, dtype=dtype, device=self.device) for l in self.layers}

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", layers=None) -> "KVCache":
        """A cache for every KV-source layer of a ModelConfig, or for ``layers`` only (a pipeline stage's)."""
        return cls(num_blocks, block_size, cfg.kv_layers if layers is None else layers, cfg.num_kv_heads,
                   cfg.head_dim, dtype, device)

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all cache-owning layers (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * self.n_kv_heads * self.head_dim * itemsize

    def _check(self, layer_id: int) -> None:
        if layer_id not in self.k:
            raise KeyError(f"layer {layer_id} owns no KV cache (cache layers: {self.layers})")

    def write(self, layer_id: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              keep: torch.Tensor | None = None) -> None:
        """Store k, v [T, n_kv, hd] at flat slots [T]; ``keep`` (token rows) restricts it, None: all rows (all valid).
        """
        self._check(layer_id)
        if keep is not None:
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        flat = (-1, self.n_kv_heads, self.head_dim)
        self.k[layer_id].view(flat).index_copy_(0, slot_mapping, k.to(self.dtype))  # [NB*BS, n_kv, hd]
        self.v[layer_id].view(flat).index_copy_(0, slot_mapping, v.to(self.dtype))

    def flat(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer as [num_blocks * block_size, n_kv, hd] views: row = flat slot."""
        self._check(layer_id)
        flat = (-1, self.n_kv_heads, self.head_dim)
        return self.k[layer_id].view(flat), self.v[layer_id].view(flat)

    def read(self, layer_id: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one sequence's first ``length`` tokens: block_table [max_blocks] -> two [length, n_kv, hd]."""
        self._check(layer_id)
        n_blocks = -(-length // self.block_size)
        blocks = block_table[:n_blocks]  # the engine guarantees these are allocated (no -1)
        k = self.k[layer_id].index_select(0, blocks).flatten(0, 1)[:length]  # [n_blocks*BS, n_kv, hd] -> [L, ...]
        v = self.v[layer_id].index_select(0, blocks).flatten(0, 1)[:length]
        return k, v
