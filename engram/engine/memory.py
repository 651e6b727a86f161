"""KV memory planning: how many paged KV blocks fit the engine's byte budget, decided once at start.

The budget (``EngineConfig.kv_cache_memory``) pays first for the Engram staging buffers of a full step
and the tables' hot-row caches; what is left becomes KV blocks. Too little for one ``max_model_len``
sequence is a ValueError at start that prints every term, never a failure mid-run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.config import EngineConfig


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int  # KV blocks to allocate
    bytes_per_block: int  # K and V of block_size tokens over every KV-source layer
    staging_bytes: int  # Engram rows of one full step (all layers)
    cache_bytes: int  # hot-row caches of the tables
    budget_bytes: int | None  # the configured budget (None: sized to fit max_num_seqs full sequences)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_memory(cfg: EngineConfig, max_model_len: int, bytes_per_block: int, staging_bytes: int,
                cache_bytes: int, device: torch.device) -> MemoryPlan:
    per_seq = -(-max_model_len // cfg.block_size)  # blocks one full-length sequence needs
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
        what = f"engine.num_kv_blocks={num_blocks}"
    elif cfg.kv_cache_memory is not None:
        left = cfg.kv_cache_memory - staging_bytes - cache_bytes
        num_blocks = max(0, left // bytes_per_block)
        what = (f"engine.kv_cache_memory={cfg.kv_cache_memory} bytes minus Engram staging {staging_bytes} and "
                f"hot-row cache {cache_bytes} leaves {max(left, 0)} bytes = {num_blocks} KV blocks of "
                f"{bytes_per_block} bytes")
    else:
        num_blocks = cfg.max_num_seqs * per_seq
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            fit = (int(free * 0.9) - staging_bytes - cache_bytes) // bytes_per_block
            num_blocks = min(num_blocks, max(0, fit))
        what = f"the device has room for {num_blocks} KV blocks of {bytes_per_block} bytes"
    if num_blocks < per_seq:
        raise ValueError(f"KV memory too small: {what}, but one sequence of max_model_len={max_model_len} "
                         f"needs {per_seq} blocks of block_size={cfg.block_size} tokens; raise the budget or "
                         f"lower max_model_len")
    return MemoryPlan(num_blocks=int(num_blocks), bytes_per_block=bytes_per_block, staging_bytes=staging_bytes,
                      cache_bytes=cache_bytes, budget_bytes=cfg.kv_cache_memory)
