"""The paper variant's ShortConv inputs kept with each KV block, so a sequence that starts at a prefix-cache hit gets
the conv state it would have had (Worker side). The state at a block boundary b is the L = (kernel-1)*dilation
post-norm conv inputs of positions b-L .. b-1; they are not a function of the tokens alone (v' = g*v, g from the
hidden state), so they are stored as they are computed, beside the K/V of the same positions:

    KV block j (block_size B tokens)   [ p0  p1  ...  p(B-K) ... p(B-1) ]
    conv pool rows j*K .. j*K+K-1                     [ c(B-K) ... c(B-1) ]   K = min(L, B), per Engram layer

Every step writes the inputs of its tokens that fall in the last K slots of their block (``tail``); a cached start at
b reads them back from the blocks before b (``history``; positions before 0 are zeros, as in a fresh state). Blocks are
only ever read back after a collected step computed them (block_manager.commit), so every row read was written."""
from __future__ import annotations

import numpy as np
import torch

from engram.config import EngramConfig
from engram.short_conv import ShortConvState, history_len
from engram.transfer import to_device


def bytes_per_block(ecfg: EngramConfig, block_size: int, dtype: torch.dtype, layers=None) -> int:
    """Conv-pool bytes one KV block adds (every Engram layer's, or ``layers``', K rows of hc_mult*H values)."""
    k = min(history_len(ecfg), block_size)
    return len(ecfg.layer_ids if layers is None else layers) * k * ecfg.hc_mult * ecfg.hidden_size * torch.finfo(dtype).bits // 8


class ConvBlockStore:
    """Per Engram layer a pool [num_blocks * K, hc_mult*H] of conv inputs, K = min(L, block_size) rows a block."""

    def __init__(self, ecfg: EngramConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, layers=None):
        self.ecfg, self.block_size, self.device = ecfg, block_size, torch.device(device)
        self.history_len = history_len(ecfg)
        self.rows_per_block = min(self.history_len, block_size)
        channels = ecfg.hc_mult * ecfg.hidden_size
        self.pool = {lid: torch.zeros(num_blocks * self.rows_per_block, channels, dtype=dtype, device=self.device)
                     for lid in (ecfg.layer_ids if layers is None else layers)}  # [num_blocks * K, C]

    def tail(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_mapping [T] (CPU) -> (packed rows of the step's tokens in the last K slots of their block [R], their
        pool rows [R]), both on the device."""
        slots = slot_mapping.numpy()
        offset = slots % self.block_size
        first_kept = self.block_size - self.rows_per_block
        rows = np.flatnonzero(offset >= first_kept)
        dest = (slots[rows] // self.block_size) * self.rows_per_block + offset[rows] - first_kept
        return to_device(torch.from_numpy(rows), self.device), to_device(torch.from_numpy(dest), self.device)

    def write(self, layer_id: int, inputs: torch.Tensor, dest: torch.Tensor) -> None:
        """inputs [R, C]: the conv inputs of the ``tail`` rows, into their pool rows ``dest`` [R]."""
        self.pool[layer_id].index_copy_(0, dest, inputs.to(self.pool[layer_id].dtype))

    def history(self, block_table: torch.Tensor, start: int) -> dict[int, ShortConvState]:
        """Each Engram layer's conv state [1, L, C] of a sequence about to compute from ``start`` (a block boundary
        its cached blocks end at); block_table [max_blocks] (CPU, -1 padded)."""
        if start <= 0 or start % self.block_size:
            raise RuntimeError(f"a cached start at position {start} is not a block boundary > 0 "
                               f"(block_size={self.block_size})")
        table = block_table.numpy()
        q = np.arange(start - self.history_len, start)  # [L] positions whose inputs the state holds
        valid = q >= 0
        qv = q[valid]
        blocks = table[qv // self.block_size]
        if (blocks < 0).any():
            raise RuntimeError(f"a cached start at position {start} lacks the blocks of positions {qv.tolist()}")
        src = blocks * self.rows_per_block + qv % self.block_size - (self.block_size - self.rows_per_block)
        src_t = to_device(torch.from_numpy(src), self.device)
        at = to_device(torch.from_numpy(np.flatnonzero(valid)), self.device)
        out = {}
        for lid, pool in self.pool.items():
            conv = pool.new_zeros(1, self.history_len, pool.shape[1])  # [1, L, C]; before position 0: zeros
            conv[0].index_copy_(0, at, pool.index_select(0, src_t))
            out[lid] = ShortConvState(conv)
        return out
