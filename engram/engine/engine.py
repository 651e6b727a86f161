"""LLMEngine (CPU side): the step loop and the request API. Everything on a device lives in the Workers.

``step`` = schedule → pack + plan lookups → ``executor.execute(StepDescription)`` → postprocess. The
engine owns the scheduler, the sequences, lookup planning (row ids are hashed here, on the CPU, where the
ids already are), the detokenizers and the outputs; the executor's Workers own model, KV cache, tables,
lookups and sampler (engine/worker.py). ``add_request`` tokenizes and queues; ``abort_request`` drops a
request; ``stats()`` is the one snapshot that metrics read. A failed step commits nothing; when it held
several requests the engine re-runs it in halves to find the request(s) that fail, so the others go on
(``StepError`` then carries the outputs of the rest and the failing request ids).
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from engram.engine.block_manager import BlockManager
from engram.engine.config import EngineConfig
from engram.engine.detokenizer import IncrementalDetokenizer, detokenize_step
from engram.engine.executor import Executor, UniProcExecutor
from engram.engine.outputs import CompletionOutput, RequestOutput
from engram.engine.packing import describe, pack
from engram.engine.planner import LookupPlan, LookupPlanner
from engram.engine.sampling_params import SamplingParams
from engram.engine.scheduler import ScheduledBatch, Scheduler
from engram.engine.sequence import Sequence
from engram.engine.step import StepResult
from engram.engine.worker import Worker
from engram.hashing import NgramHasher


class StepError(RuntimeError):
    """Some requests of a step failed; the rest of the step ran. ``request_ids``: the failed requests
    (still queued, nothing of the failed step committed: abort them, or step again to retry);
    ``outputs``: the RequestOutputs of the requests that advanced; ``__cause__``: the first failure."""

    def __init__(self, error: BaseException, request_ids: list[str], outputs: list[RequestOutput]):
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids = request_ids
        self.outputs = outputs


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
        self.executor = executor or UniProcExecutor(Worker(loaded, config, self.max_model_len, device, dtype))
        self.scheduler = Scheduler(config, BlockManager(self.executor.num_kv_blocks, config.block_size))
        self.planner = LookupPlanner(self.hasher)
        self._seqs: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._finished_seq_ids: list[int] = []  # told to the Workers with the next step (they free state)
        self.num_preemptions = 0  # sequences preempted by recompute since start
        self.num_steps = 0

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        try:
            return self._run(batch)
        except Exception as e:  # nothing was committed: find who fails, run the others
            if len(batch.seqs) == 1:
                e.request_ids = [batch.seqs[0].request_id]  # the caller fails (or retries) only this one
                raise
            failed: list[str] = []
            outputs = self._run_isolating(batch, failed)
            if failed:
                raise StepError(e, failed, outputs) from e
            return outputs  # the failure did not repeat: every request advanced

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        packed = pack(batch)
        plan = self.planner.plan(packed.compressed_ids, packed.cu_seqlens, packed.lookback)  # row ids per layer
        step = describe(next(self._step_ids), batch, packed, plan, self.config.block_size, self.eos_token_id,
                        bool(self._dead_ids), self._finished_seq_ids)
        result = self.executor.execute(step)
        self._finished_seq_ids = []
        self.num_steps += 1
        return self._postprocess(batch, plan, result)

    def _run_isolating(self, batch: ScheduledBatch, failed: list[str]) -> list[RequestOutput]:
        """Re-run a failed batch in halves (each a step of its own); a single sequence that still fails is
        left uncommitted and its request id goes to ``failed``."""
        if len(batch.seqs) == 1:
            try:
                return self._run(batch)
            except Exception:
                failed.append(batch.seqs[0].request_id)
                return []
        half = len(batch.seqs) // 2
        return (self._run_isolating(_sub_batch(batch, 0, half), failed)
                + self._run_isolating(_sub_batch(batch, half, len(batch.seqs)), failed))

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"request {request_id!r}: SamplingParams.n={params.n}: the engine runs one sequence per "
                             f"request; LLM.generate and the server fan n > 1 out into n requests")
        text, ids = (prompt, self.tokenizer.encode(prompt).ids) if isinstance(prompt, str) else (None, list(prompt))
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.tokenizer.get_vocab_size()
        for name, toks in (("token id", ids), ("forced_token_ids", params.forced_token_ids or [])):
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {request_id!r}: {name} {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room to generate "
                             f"under max_model_len={self.max_model_len}")
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_list, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        seq = Sequence(next(self._seq_ids), request_id, text, ids, self._compress(ids), params, detok,
                       self._initial_lookback())
        self._seqs[request_id] = seq
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
        return self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished()

    def stats(self) -> dict[str, Any]:
        """One snapshot for metrics and benchmarks: queue sizes, KV usage, preemptions, steps, and the
        Workers' counters (``tables``: Engram layer id -> table counters)."""
        blocks = self.scheduler.blocks
        total = self.executor.num_kv_blocks
        worker = self.executor.stats()
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_total": total, "kv_blocks_free": blocks.num_free_blocks,
                "kv_usage": 1.0 - blocks.num_free_blocks / total if total else 0.0,
                "preemptions": self.num_preemptions, "steps": self.num_steps, "tables": worker["tables"],
                "kv_bytes": worker["kv_bytes"], "graph_replays": worker["graph_replays"]}

    # ----------------------------------------------------------------- helpers
    def _compress(self, ids: list[int]) -> list[int]:
        return self.ctok.compress(ids, self._dead_ids)

    def _initial_lookback(self) -> torch.Tensor:
        return self.hasher.initial_lookback(1)[0] if self.hasher else torch.empty(0, dtype=torch.long)  # [W]

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def _postprocess(self, batch: ScheduledBatch, plan: LookupPlan, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        for i, scored in result.prompt_logprobs.items():
            batch.seqs[i].prompt_logprobs.extend(scored)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            seq.num_computed_tokens += n
            seq.lookback = plan.next_lookback[i]  # [W]
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        sampled = [batch.seqs[i] for i in batch.sample_indices()]
        compressed = self._compress(result.token_ids)
        detokenize_step(self.tokenizer, [s.detokenizer for s in sampled], result.token_ids)
        outputs = []
        for seq, tok, ctok, lp in zip(sampled, result.token_ids, compressed, result.logprobs or [None] * len(sampled)):
            seq.append_token(tok, ctok)
            if lp is not None:
                seq.logprobs.append(lp)
            seq.metrics.first_token_time = seq.metrics.first_token_time or now
            self._check_stop(seq, tok)
            outputs.append(self._output(seq, [tok]))
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
        done = seq.is_finished
        completion = CompletionOutput(index=0, text=seq.detokenizer.visible_text(done),
                                      token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason, delta_text=seq.detokenizer.take_delta(done),
                                      delta_token_ids=new_tokens,
                                      logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
                             finished=done, metrics=seq.metrics, prompt_logprobs=seq.prompt_logprobs)


def _sub_batch(batch: ScheduledBatch, lo: int, hi: int) -> ScheduledBatch:
    """Sequences lo:hi of a scheduled batch as a batch of their own (their KV blocks are already allocated)."""
    return ScheduledBatch(batch.seqs[lo:hi], batch.num_new_tokens[lo:hi], batch.start_positions[lo:hi])
