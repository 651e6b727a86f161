"""LLMEngine (CPU side): the requests and what a step commits. Everything on a device lives in the Workers. The engine
owns the scheduler, the sequences, lookup planning (row ids hashed on the CPU), the detokenizers and the outputs.
``step()`` runs the step pipeline it holds (engine/stepping.py); here are ``add_request``, ``abort_request``, ``stats()``
(the one snapshot metrics read) and ``_postprocess`` (a collected step's tokens, stop checks and RequestOutputs)."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from engram.engine.block_manager import BlockManager
from engram.engine.cache_groups import GroupBlockManager
from engram.engine.config import EngineConfig
from engram.engine.detokenizer import IncrementalDetokenizer, detokenize_step
from engram.engine.executor import Executor, UniProcExecutor
from engram.engine.microbatches import MicrobatchPipeline
from engram.engine.outputs import CompletionOutput, RequestOutput
from engram.engine.planner import LookupPlanner
from engram.engine.prefetch_plan import PromptPrefetcher
from engram.engine.prefix_cache import content_key
from engram.engine.request_check import check_request
from engram.engine.row_trace import RowTraceWriter
from engram.engine.sampling_params import SamplingParams
from engram.engine.scheduler import Scheduler
from engram.engine.sequence import Sequence
from engram.engine.spec.speculator import Speculator
from engram.engine.step import StepResult
from engram.engine.step_trace import StepRecord
from engram.engine.stepping import Launched, StepError, StepPipeline
from engram.engine.worker import Worker
from engram.hashing import NgramHasher
from engram.model.deepseek_v4.cache_layout import cache_layout
from engram.model.deepseek_v4.config import ARCHITECTURES as SEQUENCE_CACHE_ARCHITECTURES

_log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "StepError"]  # StepError lives with the step pipeline; callers import it from here


class LLMEngine:
    def __init__(self, loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 executor: Executor | None = None):
        mcfg, ecfg = loaded.model_config, loaded.engram_config
        self.config, self.ecfg = config, ecfg
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"engine.max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.tokenizer, self.ctok = loaded.tokenizer, loaded.compressed_tokenizer
        self.eos_token_id = loaded.eos_token_id
        # A model without Engram layers (a plain checkpoint) runs with empty plans.
        self.hasher = NgramHasher.from_tokenizer(ecfg, self.ctok) if ecfg else None
        self._dead_ids = ecfg.dead_token_ids if ecfg else ()
        # prompt rows staged ahead of their prefill (engine/prefetch_plan.py), when asked for and there are tables;
        # a budget too small for one range fails here, before the Workers start
        self.prefetcher = (PromptPrefetcher(self.hasher, ecfg.n_cols, len(ecfg.layer_ids), ecfg.row_bytes,
                                            config.prefetch_staging_bytes)
                           if config.prompt_prefetch and self.hasher is not None else None)
        spec = config.speculative_config
        self.speculator = (Speculator.for_engine(spec, self.max_model_len, loaded, executor, dtype, device,
                                                  config.block_size)
                           if spec is not None else None)
        self.executor = executor or UniProcExecutor(Worker(loaded, config, self.max_model_len, device, dtype,
                                                           draft=self.speculator.draft if self.speculator else None))
        self.scheduler = Scheduler(config, _block_manager(loaded, config, dtype, self.executor.num_kv_blocks),
                                   self.speculator)
        # the Workers' capabilities, read once: whether their prefill reads deduplicated ids and staged prompt rows
        worker = self.executor.stats()
        self.planner = LookupPlanner(self.hasher, dedup=config.dedup_rows and worker.get("eager_prefill", True))
        if self.prefetcher is not None and not worker.get("prefetch", {}).get("active", True):
            _log.info("prompt prefetch is off: the Workers' prefill does not read staged rows (mixed-step CUDA graphs "
                      "or tensor-parallel column shards)")
            self.prefetcher = None
        self._seqs: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self.device = torch.device(device)
        # the collected steps' row ids (engine/row_trace.py), with the Workers' table files for its replay
        self.row_trace = (RowTraceWriter(config.row_trace, self.hasher, self._compress,
                                         {"table_files": {str(k): v for k, v in worker.get("table_files", {}).items()},
                                          "engine": {"dedup_rows": self.planner.dedup,
                                                     "max_num_batched_tokens": config.max_num_batched_tokens,
                                                     "max_num_seqs": config.max_num_seqs}})
                          if config.row_trace is not None else None)
        args = (config, self.device, self.scheduler, self.executor, self.planner, self.hasher.pad_id if self.hasher
                else 0, self.eos_token_id, bool(self._dead_ids), self.max_model_len, self._postprocess, self.speculator)
        # pipeline stages: one microbatch in flight per stage (engine/microbatches.py)
        pipes = dict(prefetcher=self.prefetcher, row_trace=self.row_trace)
        self.pipeline = (MicrobatchPipeline(*args, depth=config.pipeline_parallel_size, **pipes)
                         if config.pipeline_parallel_size > 1 else StepPipeline(*args, **pipes))

    def step(self) -> list[RequestOutput]:
        """Run one step -> the outputs of the step that completed (with async scheduling, the one launched before)."""
        return self.pipeline.step()

    def close(self) -> None:
        """Finish what outlives the steps: the row trace's file, and an executor of other processes (its ranks told
        to stop, its process group left now rather than at interpreter exit). Both also happen at exit."""
        if self.row_trace is not None:
            self.row_trace.close()
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    @property
    def num_steps(self) -> int:
        return self.pipeline.num_steps

    @property
    def num_preemptions(self) -> int:
        return self.pipeline.num_preemptions

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids, params = check_request(request_id, prompt, params, self.tokenizer, self.max_model_len)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_list, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        seq = Sequence(next(self._seq_ids), request_id, text, ids, self._compress(ids), params, detok,
                       self._initial_lookback())
        self._seqs[request_id] = seq
        if self.prefetcher is not None:
            self.prefetcher.admit(seq)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request (its blocks are freed at once); False if it is unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish("abort")
        self._retire(seq)
        return True

    def has_unfinished(self) -> bool:
        self.pipeline.drop_orphaned()
        return self.scheduler.has_unfinished() or self.pipeline.in_flight is not None

    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished()

    def stats(self) -> dict[str, Any]:
        """One snapshot for metrics: queues, KV usage, preemptions, steps, ``tables`` (layer id -> counters), the step
        trace's totals (``lookup_exposed_s``: the collected steps' waits for their rows, step_trace.py), and with
        speculative decoding ``speculative`` (drafts, accepted, acceptance length: engine/spec/speculator.py);
        ``verify_graph``: the verify graphs' replays, pool bytes, verify rows, padding rows and padded sequences;
        DeepSeek-V4 with decode graphs ``v4_graph``: replays by context span, padding rows, replays where a compressor
        window closed for some sequences and not others, the batched caches' bytes (runners/v4_graphs.py)."""
        blocks = self.scheduler.blocks
        total = self.executor.num_kv_blocks
        worker = self.executor.stats()
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_total": total, "kv_blocks_free": blocks.num_free_blocks,
                "kv_usage": 1.0 - blocks.num_free_blocks / total if total else 0.0,
                "preemptions": self.num_preemptions, "steps": self.num_steps, "tables": worker["tables"],
                "kv_bytes": worker["kv_bytes"], "graph_replays": worker["graph_replays"],
                "mixed_graph_replays": worker.get("mixed_graph_replays", 0),
                "verify_graph": {k.removeprefix("verify_graph_"): v for k, v in worker.items()
                                 if k.startswith("verify_graph_")},
                "prefix_cache": blocks.stats.snapshot(blocks.num_cached_blocks),
                "cache_groups": blocks.group_stats(), "prefetch": worker.get("prefetch", {}),
                "hot_cache": hot_cache(worker["tables"], worker.get("hot_cache_bytes", 0)),
                **self.pipeline.trace.totals(),
                **({"speculative": self.speculator.stats()} if self.speculator is not None else {}),
                **({"v4_graph": worker["v4_graph"]} if "v4_graph" in worker else {})}

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (benchmarks start cold with it; vLLM's name) -> how many were dropped. Blocks
        running sequences hold stay theirs; nothing computed before the reset is found again."""
        return self.scheduler.blocks.reset()

    def step_trace(self, since: int = -1) -> list[StepRecord]:
        """The records of the collected steps after step id ``since`` that are still kept (step_trace.py)."""
        return self.pipeline.trace.since(since)

    # ----------------------------------------------------------------- helpers
    def _compress(self, ids: list[int]) -> list[int]:
        return self.ctok.compress(ids, self._dead_ids)

    def _initial_lookback(self) -> torch.Tensor:
        return self.hasher.initial_lookback(1)[0] if self.hasher else torch.empty(0, dtype=torch.long)  # [W]

    def _retire(self, seq: Sequence) -> None:
        if self.prefetcher is not None:
            self.prefetcher.forget(seq.seq_id)
        self.scheduler.finish(seq)
        self.pipeline.retire(seq.seq_id)

    def _postprocess(self, launched: "Launched", result: StepResult) -> list[RequestOutput]:
        """Commit a read step: prompt logprobs, then each sampling sequence's token, stop checks and output; sequences
        that finished while the step was in flight drop their token."""
        batch = launched.batch
        now = time.monotonic()
        for i, scored in result.prompt_logprobs.items():
            if not batch.seqs[i].is_finished:
                batch.seqs[i].prompt_logprobs.extend(scored)
        counts = result.num_emitted or [1] * len(launched.sampled)  # speculation: accepted drafts + 1 each
        logprobs = result.logprobs or [None] * len(result.token_ids)
        live, at = [], 0
        for i, n in zip(launched.sampled, counts):
            seq = batch.seqs[i]
            seq.num_pending -= 1
            if not seq.is_finished:
                live.append((seq, result.token_ids[at:at + n], logprobs[at:at + n]))
            at += n
        outputs = []
        emitted: dict[int, list[int]] = {}
        for r in range(max((len(toks) for _, toks, _ in live), default=0)):
            # round r: every sequence's r-th token of this step, unless a token before it stopped the sequence
            now_live = [(seq, toks[r], lps[r]) for seq, toks, lps in live if r < len(toks) and not seq.is_finished]
            toks = [tok for _, tok, _ in now_live]
            texts = [(seq.detokenizer, tok) for seq, tok, _ in now_live if seq.params.detokenize]  # others: caller's
            detokenize_step(self.tokenizer, [d for d, _ in texts], [t for _, t in texts])
            for (seq, tok, lp), ctok in zip(now_live, self._compress(toks)):
                seq.append_token(tok, ctok)
                if lp is not None:
                    seq.logprobs.append(lp)
                seq.metrics.first_token_time = seq.metrics.first_token_time or now
                self._check_stop(seq, tok)
                emitted.setdefault(seq.seq_id, []).append(tok)
        for seq, _, _ in live:
            if seq.is_finished or seq.params.output_kind != "final_only":
                outputs.append(self._output(seq, emitted[seq.seq_id]))
            if seq.is_finished:
                del self._seqs[seq.request_id]
                self._retire(seq)
        return outputs

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if tok == self.eos_token_id and not p.ignore_eos and seq.num_output_tokens > p.min_tokens:
            seq.finish("stop")
        elif tok in p.stop_token_ids and seq.num_output_tokens > p.min_tokens:
            seq.finish("stop", tok)
        elif seq.detokenizer.stopped_by is not None:
            seq.finish("stop", seq.detokenizer.stopped_by)
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or \
                seq.num_tokens >= self.max_model_len:
            seq.finish("length")

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        """The request's output after a step: cumulative, or (``output_kind`` "delta") what the step added."""
        done = seq.is_finished
        delta = seq.detokenizer.take_delta(done)
        wants_logprobs = seq.params.logprobs is not None
        if seq.params.output_kind == "delta":
            text, token_ids = delta, list(new_tokens)
            logprobs = seq.logprobs[len(seq.logprobs) - len(new_tokens):] if wants_logprobs else None
        else:
            text, token_ids = seq.detokenizer.visible_text(done), seq.output_token_ids
            logprobs = list(seq.logprobs) if wants_logprobs else None
        completion = CompletionOutput(index=0, text=text, token_ids=token_ids, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason, delta_text=delta, delta_token_ids=new_tokens,
                                      logprobs=logprobs)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
                             finished=done, metrics=seq.metrics, prompt_logprobs=seq.prompt_logprobs)


def hot_cache(tables: dict, nbytes: int) -> dict:
    """The hot-row caches over every table since start: their bytes, hits, misses and hit rate (None without
    lookups through a cache)."""
    hits = sum(t.get("hits", 0) for t in tables.values())
    misses = sum(t.get("misses", 0) for t in tables.values())
    return {"bytes": nbytes, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None}


def _block_manager(loaded, config: EngineConfig, dtype: torch.dtype, num_blocks: int):
    """DeepSeek-V4: its cache groups' pages (engine/cache_groups.py, the Worker's layout); else paged KV blocks."""
    root = _prefix_cache_root(loaded, config)
    if getattr(loaded.model_config, "architecture", None) in SEQUENCE_CACHE_ARCHITECTURES:
        return GroupBlockManager(num_blocks, cache_layout(loaded.model_config, dtype, config.block_size))
    return BlockManager(num_blocks, config.block_size, root)


def _prefix_cache_root(loaded, config: EngineConfig) -> bytes | None:
    """The content key prefix-cache chains start from, or None when prefix caching is off or the model cannot take
    it: a per-sequence cache with sliding-window and compressed entries (DeepSeek-V4) is not a list of token blocks."""
    if not config.enable_prefix_caching:
        return None
    arch = getattr(loaded.model_config, "architecture", None)
    if arch in SEQUENCE_CACHE_ARCHITECTURES:
        _log.info("prefix caching is off: %s keeps sliding-window, compressed and compressor-state cache groups, "
                  "not token blocks a prefix could share", arch)
        return None
    return content_key(loaded)
