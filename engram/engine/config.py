"""EngineConfig: the scheduler's limits and the KV memory budget, validated at construction (ValueError naming
the field). ``kv_cache_memory`` covers KV blocks, Engram staging, prompt prefetch staging and hot-row caches
(memory.py); ``max_model_len=None`` is resolved against the model at start."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from engram.engine.spec.config import SpeculativeConfig, check_reservation


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # sequences in one step, at most
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes), at most
    max_model_len: int | None = None  # prompt + output tokens per sequence; None = the model's limit
    block_size: int = 16  # tokens per paged KV block
    kv_cache_memory: int | None = None  # bytes for KV blocks + Engram staging + hot-row cache; None = enough
    num_kv_blocks: int | None = None  # exact KV block count (overrides the budget; tests use it)
    seed: int = 0  # random stream of requests without their own seed
    gpu_memory_utilization: float = 0.9  # share of the device the process may fill (KV sized from a profile)
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly (vLLM's name)
    max_graph_batch: int = 256  # largest decode batch captured as a CUDA graph; larger batches run eager
    # describe step N+1 while the device runs step N (None: on for CUDA where the tables allow it; True on
    # the CPU runs the same bookkeeping without any overlap, for tests)
    async_scheduling: bool | None = None
    # reuse the KV blocks (and Engram state) of cached prompt prefixes (vLLM's name; block_manager.py); models whose
    # caches are not paged per token (DeepSeek-V4's sliding-window and compressed caches) turn it off with a log line
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1  # Worker processes, one tensor-parallel rank each (gloo on the CPU, NCCL on GPUs; docs/parallel.md)
    # pipeline stages, each tensor_parallel_size ranks wide (P x T Worker processes), and P microbatches in flight
    pipeline_parallel_size: int = 1
    # engine replicas (processes, each TP ranks wide) behind one router, sharing one copy of the host tables per node
    data_parallel_size: int = 1
    # speculative decoding (vLLM's keys; engine/spec/config.py): a dict is turned into a SpeculativeConfig. It runs
    # with synchronous scheduling and reserves max_num_seqs x (K + 1), or x (2K + 1) with a draft model, decode rows
    speculative_config: SpeculativeConfig | None = None
    # deduplicate each step's Engram row ids on the host (engine/row_dedup.py): tables gather each distinct row once
    dedup_rows: bool = True
    # stage prompts' Engram rows ahead of their prefill chunks (engine/prefetch_plan.py, prefetch_stage.py); an
    # experiment until the H200 A/B decides, so off by default
    prompt_prefetch: bool = False
    # bytes of staged prompt rows per Worker (raw rows + index), part of the KV memory budget (memory.py)
    prefetch_staging_bytes: int = 64 << 20
    # append every collected step's distinct Engram row ids per layer and its kind to this file (engine/row_trace.py;
    # benchmarks replay it: bench/page_replay.py); None: no trace
    row_trace: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"engine.{name}={getattr(self, name)!r}: {why}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_graph_batch",
                     "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise bad(name, "must be an int >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1 (or None for the model's limit)")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise bad("kv_cache_memory", "must be a positive byte count (or None)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be >= 1 (or None to size from kv_cache_memory)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        for name in ("enable_prefix_caching", "dedup_rows", "prompt_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if not isinstance(self.prefetch_staging_bytes, int) or self.prefetch_staging_bytes < 0:
            raise bad("prefetch_staging_bytes", "must be a byte count >= 0")
        if self.row_trace is not None:
            if isinstance(self.row_trace, os.PathLike):
                self.row_trace = os.fspath(self.row_trace)
            if not isinstance(self.row_trace, str) or not self.row_trace:
                raise bad("row_trace", "must be a file path (or None for no trace)")
            if self.data_parallel_size > 1:
                raise bad("row_trace", f"one engine writes the trace; data_parallel_size={self.data_parallel_size} "
                          "runs several (trace one replica with data_parallel_size=1)")
        if self.async_scheduling not in (None, True, False):
            raise bad("async_scheduling", "must be true, false or null (auto)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise bad("max_num_batched_tokens",
                      f"must be >= max_num_seqs={self.max_num_seqs} so every running sequence can decode")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.async_scheduling:
                raise bad("async_scheduling", "speculative decoding runs with synchronous scheduling (a step's "
                          "inputs depend on how many drafts the step before accepted); leave it null (auto) or false")
            if self.speculative_config.uses_draft_model and self.tensor_parallel_size > 1:
                raise bad("tensor_parallel_size", "speculative_config method 'draft_model' runs the draft on one "
                          "in-process Worker; with tensor-parallel ranks use the n-gram proposer")
            if self.pipeline_parallel_size > 1:
                raise bad("pipeline_parallel_size", "speculative decoding is not built for pipeline stages (the "
                          "accepted counts would have to reach every stage's conv state); use pipeline_parallel_size=1")
            check_reservation(self)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "EngineConfig":
        """Build from keyword options (LLM(**engine options)); unknown keys raise, naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)
