"""LLMEngine: the step loop (schedule -> plan lookups -> run -> sample -> postprocess) and the request API.

``add_request`` tokenizes and queues; ``step`` advances every scheduled sequence by one chunk or one token
and returns a RequestOutput (with the step's delta) for each sequence that produced a token;
``abort_request`` drops a request and frees its blocks. Each stage is a separate object talking through
dataclasses (ScheduledBatch, PackedBatch, LookupPlan, StagedRows), so the lookup executor can be swapped
(``engine.executor``) without touching the runner. All per-sequence state lives on the Sequence.
"""
from __future__ import annotations

import itertools
import time

import torch

from engram.engine.block_manager import BlockManager
from engram.engine.config import EngineConfig
from engram.engine.detokenizer import IncrementalDetokenizer
from engram.engine.lookup import LookupPlan, LookupPlanner, SyncLookupExecutor, staging_bytes
from engram.engine.memory import plan_memory
from engram.engine.outputs import CompletionOutput, RequestOutput
from engram.engine.runner import ModelRunner, pack
from engram.engine.sampler import SampleRequest, Sampler
from engram.engine.sampling_params import SamplingParams
from engram.engine.scheduler import ScheduledBatch, Scheduler
from engram.engine.sequence import Sequence
from engram.hashing import NgramHasher
from engram.model.kv_cache import KVCache
from engram.short_conv import ShortConvState


def hot_cache_bytes(tables: dict) -> int:
    """Bytes of the hot-row caches the tables opened with (they count against the KV budget)."""
    return sum(t.cache.nbytes for t in tables.values() if getattr(t, "cache", None) is not None)


class LLMEngine:
    def __init__(self, loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        mcfg, ecfg = loaded.model_config, loaded.engram_config
        self.config, self.device, self.dtype, self.ecfg = config, torch.device(device), dtype, ecfg
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"engine.max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.tokenizer, self.ctok = loaded.tokenizer, loaded.compressed_tokenizer
        self.eos_token_id = loaded.eos_token_id
        # A model without Engram layers (a plain checkpoint) runs with empty plans.
        self.hasher = NgramHasher(ecfg, pad_id=int(self.ctok.compress([ecfg.pad_token_id])[0])) if ecfg else None
        self._dead_ids = ecfg.dead_token_ids if ecfg else ()
        bs = config.block_size
        bytes_per_block = KVCache.for_model(mcfg, 1, bs, dtype, "meta").bytes_per_block()
        self.memory = plan_memory(config, self.max_model_len, bytes_per_block,
                                  staging_bytes(ecfg, config.max_num_batched_tokens, dtype) if ecfg else 0,
                                  hot_cache_bytes(loaded.tables),
                                  self.device)
        self.kv = KVCache.for_model(mcfg, self.memory.num_blocks, bs, dtype, self.device)
        self.scheduler = Scheduler(config, BlockManager(self.memory.num_blocks, bs))
        self.planner = LookupPlanner(ecfg, self.hasher)
        self.executor = SyncLookupExecutor(loaded.tables, ecfg, dtype, self.device)
        self.runner = ModelRunner(loaded.model, self.kv, bs, self.device, bool(self._dead_ids))
        self.sampler = Sampler(self.eos_token_id, seed=config.seed)
        self._conv_layers = list(ecfg.layer_ids) if ecfg and ecfg.variant == "paper" else []
        self._seqs: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self.num_preemptions = 0  # sequences preempted by recompute since start

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        try:
            packed = pack(batch)
            plan = self.planner.plan(packed.seq_ids, packed.compressed_ids, packed.cu_seqlens, packed.positions,
                                     packed.lookback)  # row ids of every Engram layer, deduped
            staged = self.executor.submit(plan)
            logits = self.runner.run(packed, plan, staged, batch.seqs)  # [N, vocab] float32
            sampled = [batch.seqs[i] for i in packed.sample_rows]
            tokens = self.sampler(logits, [SampleRequest(s.params, s.num_output_tokens, self._generator(s))
                                           for s in sampled])
        except Exception as e:  # nothing was committed: the step can be retried or its requests aborted
            e.request_ids = [s.request_id for s in batch.seqs]  # the server fails only these requests
            raise
        return self._postprocess(batch, plan, sampled, tokens.tolist())

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params or SamplingParams()
        text, ids = (prompt, self.tokenizer.encode(prompt).ids) if isinstance(prompt, str) else (None, list(prompt))
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.tokenizer.get_vocab_size()
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room to generate "
                             f"under max_model_len={self.max_model_len}")
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_list, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        conv = ({lid: ShortConvState.zeros(1, self.ecfg, self.dtype, self.device) for lid in self._conv_layers}
                or None)
        seq = Sequence(next(self._seq_ids), request_id, text, ids, self._compress(ids), params, detok,
                       self._initial_lookback(), conv)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request (its blocks are freed at once); False if it is unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish("abort")
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished()

    # ----------------------------------------------------------------- helpers
    def _compress(self, ids: list[int]) -> list[int]:
        return self.ctok.compress(ids, self._dead_ids)

    def _initial_lookback(self) -> torch.Tensor:
        return self.hasher.initial_lookback(1)[0] if self.hasher else torch.empty(0, dtype=torch.long)  # [W]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    def _postprocess(self, batch: ScheduledBatch, plan: LookupPlan, sampled: list[Sequence],
                     tokens: list[int]) -> list[RequestOutput]:
        now = time.monotonic()
        self.num_preemptions += len(batch.preempted)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            seq.num_computed_tokens += n
            seq.lookback = plan.next_lookback[i]  # [W]
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        compressed = self._compress(tokens)
        outputs = []
        for seq, tok, ctok in zip(sampled, tokens, compressed):
            seq.append_token(tok, ctok)
            seq.detokenizer.add_token(tok)
            seq.metrics.first_token_time = seq.metrics.first_token_time or now
            self._check_stop(seq, tok)
            outputs.append(self._output(seq, [tok]))
            if seq.is_finished:
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
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
        done = seq.is_finished
        completion = CompletionOutput(index=0, text=seq.detokenizer.visible_text(done),
                                      token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason, delta_text=seq.detokenizer.take_delta(done),
                                      delta_token_ids=new_tokens)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
                             finished=done, metrics=seq.metrics)
