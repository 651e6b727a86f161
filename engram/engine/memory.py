"""KV memory planning: how many paged KV blocks a Worker allocates, decided once at start. First that applies:
``num_kv_blocks`` (exact); ``kv_cache_memory`` (a byte budget that pays first for a full step's Engram staging, the
prompt prefetch staging and the hot-row caches); on CUDA, ``gpu_memory_utilization`` of the device minus what is in
use after loading minus the peak of a profiled warm-up step (``profile_peak_bytes``) and the prompt prefetch staging;
on the CPU, room for ``max_num_seqs`` full sequences. Too little for one ``max_model_len`` sequence is a ValueError at
start that prints every term."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.config import EngineConfig
from engram.engine.packing import slot_mapping
from engram.engine.runners.eager import EagerRunner
from engram.engine.step import SampleSpec, StepDescription
from engram.model.kv_cache import KVCache


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int  # KV blocks to allocate
    bytes_per_block: int  # K and V of block_size tokens over every KV-source layer (+ the conv inputs kept with it)
    staging_bytes: int  # Engram rows of one full step (all layers)
    cache_bytes: int  # hot-row caches of the tables
    budget_bytes: int | None  # the configured budget (None: profiled on CUDA, max_num_seqs sequences on CPU)
    step_peak_bytes: int | None = None  # profiled peak of the largest step (CUDA without a budget)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_memory(cfg: EngineConfig, max_model_len: int, bytes_per_block: int, staging_bytes: int,
                cache_bytes: int, device: torch.device, step_peak_bytes: int | None = None,
                graph_bytes: int = 0, blocks_per_sequence: int | None = None, prefetch_bytes: int = 0) -> MemoryPlan:
    """``step_peak_bytes``: the profiled warm-up step's peak (CUDA, no budget); ``graph_bytes``: what CUDA graphs hold
    beside the KV cache (the dense graphs' pool, estimated from the profiled peak, else 0; DeepSeek-V4's batched
    caches), taken out of the profiled free memory or of a ``kv_cache_memory`` budget;
    ``blocks_per_sequence``: the most blocks one full-length sequence holds (cache groups), else its paged KV's;
    ``prefetch_bytes``: the prompt prefetch staging area (engine.prefetch_staging_bytes), filled after the start."""
    per_seq = blocks_per_sequence or -(-max_model_len // cfg.block_size)  # blocks one full-length sequence needs
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
        what = f"engine.num_kv_blocks={num_blocks}"
    elif cfg.kv_cache_memory is not None:
        left = cfg.kv_cache_memory - staging_bytes - prefetch_bytes - cache_bytes - graph_bytes
        num_blocks = max(0, left // bytes_per_block)
        prefetch = f", prompt prefetch staging {prefetch_bytes} (engine.prefetch_staging_bytes)" if prefetch_bytes \
            else ""
        graphs = f", CUDA graphs' buffers {graph_bytes} (lower engine.max_model_len or max_num_seqs)" if graph_bytes \
            else ""
        what = (f"engine.kv_cache_memory={cfg.kv_cache_memory} bytes minus Engram staging {staging_bytes}{prefetch}"
                f"{graphs} and hot-row cache {cache_bytes} leaves {max(left, 0)} bytes = {num_blocks} KV blocks of "
                f"{bytes_per_block} bytes")
    elif step_peak_bytes is not None:
        free, total = torch.cuda.mem_get_info(device)
        left = (int(total * cfg.gpu_memory_utilization) - (total - free) - step_peak_bytes - graph_bytes
                - prefetch_bytes)
        num_blocks = min(cfg.max_num_seqs * per_seq, max(0, left // bytes_per_block))
        what = (f"engine.gpu_memory_utilization={cfg.gpu_memory_utilization} of {total} bytes minus {total - free} "
                f"in use after loading minus a step's profiled peak of {step_peak_bytes}, {graph_bytes} for "
                f"CUDA graphs and {prefetch_bytes} of prompt prefetch staging leaves {max(left, 0)} bytes")
    else:
        num_blocks = cfg.max_num_seqs * per_seq
        what = f"room for max_num_seqs={cfg.max_num_seqs} sequences is {num_blocks} KV blocks"
    if num_blocks < per_seq:
        raise ValueError(f"KV memory too small: {what}, but one sequence of max_model_len={max_model_len} "
                         f"needs {per_seq} blocks of block_size={cfg.block_size} tokens; raise the budget or "
                         f"lower max_model_len")
    return MemoryPlan(num_blocks=int(num_blocks), bytes_per_block=bytes_per_block, staging_bytes=staging_bytes,
                      cache_bytes=cache_bytes, budget_bytes=cfg.kv_cache_memory, step_peak_bytes=step_peak_bytes)


def warmup_step(cfg: EngineConfig, ecfg, block_size: int, layers=None) -> StepDescription:
    """The largest step: ``max_num_batched_tokens`` prompt tokens over ``max_num_seqs`` fresh sequences, all sampling
    greedily (with speculative decoding at their last K + 1 rows, as verify steps do), Engram row 0 for every
    lookup (of ``layers``: a pipeline stage's; None: every Engram layer)."""
    layers = (ecfg.layer_ids if ecfg else ()) if layers is None else layers
    t = cfg.max_num_batched_tokens
    s = min(cfg.max_num_seqs, t)
    lens = [t // s + (1 if i < t % s else 0) for i in range(s)]
    positions = torch.cat([torch.arange(n) for n in lens])  # [T]
    cu = torch.zeros(s + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lens), 0, out=cu[1:])
    per_seq = [-(-n // block_size) for n in lens]
    first = [sum(per_seq[:i]) for i in range(s)]
    width = max(per_seq)
    tables = torch.tensor([[f + j if j < n else -1 for j in range(width)] for f, n in zip(first, per_seq)])
    slots = slot_mapping(cu, positions, tables, block_size)
    greedy = SampleSpec(0.0, 1.0, 0, None, 0, (), -1, -1)
    # with speculative decoding every sequence's last K + 1 rows get logits (the sampler's reservation)
    k = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config is not None else 0
    drafts = [min(k, n - 1) for n in lens] if k else []
    return StepDescription(
        step_id=-1, seq_ids=list(range(-s, 0)), start_positions=[0] * s, num_new_tokens=lens,
        token_ids=torch.zeros(t, dtype=torch.long), positions=positions, cu_seqlens=cu,
        context_lens=torch.tensor(lens), block_tables=tables, slot_mapping=slots, dead_mask=None,
        engram_row_ids={lid: torch.zeros(t, ecfg.n_cols, dtype=torch.long) for lid in layers} if ecfg else {},
        sample_rows=list(range(s)), samples=[greedy] * (s + sum(drafts)), num_drafts=drafts if any(drafts) else [])


def profile_peak_bytes(worker, bytes_per_block: int) -> int:
    """``warmup_step``'s peak CUDA bytes beyond what existed (scratch KV cache); table counters are reset after."""
    step = warmup_step(worker.config, worker.ecfg, worker.config.block_size, tuple(worker.tables))
    blocks = int(step.block_tables.max()) + 1
    kv = KVCache.for_model(worker.model_config, blocks, worker.config.block_size, worker.dtype, worker.device,
                           worker.kv_layers)
    runner = EagerRunner(worker.model, kv, worker.lookup, worker.device, worker.dtype, worker.ecfg)
    torch.cuda.synchronize(worker.device)
    torch.cuda.reset_peak_memory_stats(worker.device)
    base = torch.cuda.memory_allocated(worker.device)
    logits = runner.launch(step, None).logits
    if logits is not None:  # None: a pipeline stage before the last samples nothing
        worker.sample(step, logits, torch.zeros(sum(step.num_drafts), dtype=torch.long, device=worker.device))
    torch.cuda.synchronize(worker.device)
    peak = torch.cuda.max_memory_allocated(worker.device) - base
    del kv, runner, logits
    for table in worker.tables.values():
        table.reset_stats()
    torch.cuda.empty_cache()
    return int(peak)
