"""LLMEngine (CPU side): the step loop and the request API. Everything on a device lives in the Workers.

``step`` = schedule → pack + plan lookups → ``executor.execute(StepDescription)`` → postprocess. The
engine owns the scheduler, the sequences, lookup planning (row ids are hashed here, on the CPU, where the
ids already are), the detokenizers and the outputs; the executor's Workers own model, KV cache, tables,
lookups and sampler (engine/worker.py). ``add_request`` tokenizes and queues; ``abort_request`` drops a
request; ``stats()`` is the one snapshot that metrics read. A failed step commits nothing; when it held
several requests the engine re-runs it in halves to find the request(s) that fail, so the others go on
(``StepError`` then carries the outputs of the rest and the failing request ids).

Async scheduling (``EngineConfig.async_scheduling``; on by default on CUDA where the tables can gather ids
the device produced; asked for with other tables, a step whose inputs include tokens still on the device
waits for them, so only steps without such tokens — prefill chunks — run ahead): ``step`` launches step
N+1 before it reads step N, so the host's scheduling,
packing, hashing, detokenizing and output building overlap the device's work. N+1's decode tokens are N's
sampled ids, still on the device (``Sequence.num_pending``; packing.py, engine/pending.py). Greedy and
seeded outputs are those of synchronous scheduling; what changes is timing: a sequence that stops (EOS, a
stop string) computes one more token, which is dropped, and a request is admitted one step later. A
sequence whose token in flight is certain to be its last (max_tokens, max_model_len) sits the next step out.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engram.engine.block_manager import BlockManager
from engram.engine.config import EngineConfig
from engram.engine.detokenizer import IncrementalDetokenizer, detokenize_step
from engram.engine.executor import Executor, UniProcExecutor
from engram.engine.outputs import CompletionOutput, RequestOutput
from engram.engine.packing import describe, pack
from engram.engine.planner import LookupPlanner
from engram.engine.sampling_params import SamplingParams
from engram.engine.scheduler import ScheduledBatch, Scheduler
from engram.engine.sequence import Sequence
from engram.engine.step import StepResult
from engram.engine.worker import Worker
from engram.hashing import NgramHasher

log = logging.getLogger(__name__)


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
        self.device = torch.device(device)
        self._inflight: _Launched | None = None  # async scheduling: the launched step not read yet

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs of the step that completed. With async scheduling the step
        launched here is read by the next call (its outputs come then), so the device always has the next
        step queued while the host postprocesses; otherwise a step is launched and read in the same call."""
        if self._async():
            return self._step_async()
        if self._inflight is not None:  # async scheduling was just turned off (a replaced lookup executor)
            prev, self._inflight = self._inflight, None
            return self._collect(prev)
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        return self._run_isolated(batch)

    def _async(self) -> bool:
        """Async scheduling: asked for, or (auto) on CUDA where the Workers take tokens left on the device."""
        c = self.config.async_scheduling
        if c is not None:
            return c
        return self.device.type == "cuda" and self.executor.takes_pending_tokens()

    def _step_async(self) -> list[RequestOutput]:
        if self._inflight is None:
            outputs = self._launch_ahead(self._schedule_next(), None, [])  # outputs only if it ran synchronously
            if self._inflight is None:
                return outputs
        prev, self._inflight = self._inflight, None
        batch = self._schedule_next()
        if batch.is_empty:
            return self._collect_or_rerun(prev)
        if not self.executor.takes_pending_tokens() and any(seq.num_pending for seq in batch.seqs):
            # Tables that need host ids (hot-row caches, the disk tier) cannot take tokens still on the device:
            # read prev first, then launch; steps without such tokens (prefill chunks) still run ahead.
            outputs = self._collect_or_rerun(prev)
            return outputs + self._launch_ahead(_pick(batch, [i for i, seq in enumerate(batch.seqs)
                                                              if not seq.is_finished]), None, outputs)
        try:
            self._inflight = self._launch(batch, prev)
        except Exception as e:  # nothing of it was committed: read prev, then run that batch synchronously
            log.warning("launching step %d ahead failed (%s: %s): reading the step before, then running it "
                        "synchronously", self.num_steps, type(e).__name__, e)
            outputs = self._collect_or_rerun(prev)
            return outputs + self._run_or_fold(_pick(batch, [i for i, seq in enumerate(batch.seqs)
                                                             if not seq.is_finished]), outputs)
        return self._collect_or_rerun(prev)

    def _launch_ahead(self, batch: ScheduledBatch, prev: "_Launched | None",
                      outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Launch ``batch`` and leave it in flight; if the launch fails, run it synchronously instead (its
        outputs, or a StepError carrying ``outputs`` too)."""
        if batch.is_empty:
            return []
        try:
            self._inflight = self._launch(batch, prev)
            return []
        except Exception as e:
            log.warning("launching step %d failed (%s: %s): running it synchronously", self.num_steps,
                        type(e).__name__, e)
            return self._run_or_fold(batch, outputs)

    def _run_or_fold(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``_run_isolated(batch)``; a StepError also carries the ``outputs`` already collected this call."""
        try:
            return self._run_isolated(batch)
        except StepError as e:
            e.outputs = outputs + e.outputs
            raise

    def _schedule_next(self) -> ScheduledBatch:
        """The next step, scheduled while a step may still be in flight."""
        batch = self.scheduler.schedule(hold=self._last_token_in_flight)
        self.num_preemptions += len(batch.preempted)
        return batch

    def _last_token_in_flight(self, seq: Sequence) -> bool:
        """Whether a token of ``seq`` still in flight is certain to be its last (length limits): then it sits
        the next step out instead of computing a token nobody reads."""
        if not seq.num_pending:
            return False
        total = seq.num_scheduled_tokens
        p = seq.params
        return total >= self.max_model_len or (p.max_tokens is not None and total - seq.num_prompt_tokens >= p.max_tokens)

    def _collect_or_rerun(self, launched: "_Launched") -> list[RequestOutput]:
        """Read a launched step; if that fails, drop the step launched after it (its inputs were this one's
        tokens) and re-run this one's batch synchronously, isolating the failing requests."""
        try:
            return self._collect(launched)
        except Exception:
            dropped, self._inflight = self._inflight, None
            if dropped is not None:
                try:
                    self.executor.collect(dropped.handle)
                except Exception:
                    pass  # it read tokens of a failed step: whatever it did is discarded
                self._rollback(dropped)
            # re-run who is still there: not finished, and not preempted since (the step launched after it may
            # have taken their blocks; they recompute from the queue)
            live = [i for i, (seq, epoch) in enumerate(zip(launched.batch.seqs, launched.epochs))
                    if not seq.is_finished and seq.metrics.num_preemptions == epoch]
            return self._run_isolated(_pick(launched.batch, live))

    def _run_isolated(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launch and read ``batch`` now; on failure find who fails and run the others."""
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
        return self._collect(self._launch(batch, None))

    def _launch(self, batch: ScheduledBatch, prev: "_Launched | None") -> "_Launched":
        """Describe ``batch`` and start it on the executor; then (only then) advance the scheduler-visible
        state: tokens computed, tokens in flight. ``prev``: the step still in flight whose sampled tokens
        some of this step's inputs are."""
        packed = pack(batch, self.hasher.pad_id if self.hasher else 0)
        sources = []
        for _, seq, _ in packed.pending:
            if prev is None or seq.seq_id not in prev.sample_index:
                raise RuntimeError(f"sequence {seq.request_id!r} has a token in flight that is not the last step's")
            sources.append(prev.sample_index[seq.seq_id])
        plan = self.planner.plan(packed.compressed_ids, packed.cu_seqlens, packed.lookback,
                                 [before for _, _, before in packed.pending])  # row ids per layer
        step = describe(next(self._step_ids), batch, packed, plan, self.config.block_size, self.eos_token_id,
                        bool(self._dead_ids), self._finished_seq_ids)
        if packed.pending:
            step.pending_rows = [row for row, _, _ in packed.pending]
            step.pending_sources, step.pending_step_id = sources, prev.step_id
            step.pending_partials = plan.pending_partials
        handle = self.executor.launch(step)
        self._finished_seq_ids = []
        self.num_steps += 1
        now = time.monotonic()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        sampled = packed.sample_rows  # the sequences that sample, as packing found them
        for i in sampled:
            batch.seqs[i].num_pending += 1
        return _Launched(batch, handle, step.step_id, {batch.seqs[i].seq_id: j for j, i in enumerate(sampled)},
                         [seq.metrics.num_preemptions for seq in batch.seqs], sampled)

    def _collect(self, launched: "_Launched") -> list[RequestOutput]:
        try:
            result = self.executor.collect(launched.handle)
        except Exception:
            self._rollback(launched)
            raise
        return self._postprocess(launched, result)

    def _rollback(self, launched: "_Launched") -> None:
        """Undo what ``_launch`` advanced (a step that failed, or was dropped, computed nothing)."""
        for seq, n, epoch in zip(launched.batch.seqs, launched.batch.num_new_tokens, launched.epochs):
            if seq.metrics.num_preemptions == epoch:  # a sequence preempted since restarts from 0 anyway
                seq.num_computed_tokens -= n
        for i in launched.sampled:
            launched.batch.seqs[i].num_pending -= 1

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
        return (self._run_isolating(_pick(batch, range(half)), failed)
                + self._run_isolating(_pick(batch, range(half, len(batch.seqs))), failed))

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
        if self._inflight is not None and all(seq.is_finished for seq in self._inflight.batch.seqs):
            gone, self._inflight = self._inflight, None  # every request of the step in flight is gone (aborted)
            try:
                self._collect(gone)  # read it so that no device work outlives them; its tokens are dropped
            except Exception as e:
                log.warning("a step whose requests were all aborted failed: %s: %s", type(e).__name__, e)
        return self.scheduler.has_unfinished() or self._inflight is not None

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
                "kv_bytes": worker["kv_bytes"], "graph_replays": worker["graph_replays"],
                "lookup_exposed_s": worker.get("lookup_exposed_s", 0.0)}

    # ----------------------------------------------------------------- helpers
    def _compress(self, ids: list[int]) -> list[int]:
        return self.ctok.compress(ids, self._dead_ids)

    def _initial_lookback(self) -> torch.Tensor:
        return self.hasher.initial_lookback(1)[0] if self.hasher else torch.empty(0, dtype=torch.long)  # [W]

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def _postprocess(self, launched: "_Launched", result: StepResult) -> list[RequestOutput]:
        """Commit a read step: prompt logprobs, then each sampling sequence's token, stop checks and output.
        Sequences that finished (or were aborted) while the step was in flight drop their token."""
        batch = launched.batch
        now = time.monotonic()
        for i, scored in result.prompt_logprobs.items():
            if not batch.seqs[i].is_finished:
                batch.seqs[i].prompt_logprobs.extend(scored)
        live = []
        for i, tok, lp in zip(launched.sampled, result.token_ids, result.logprobs or [None] * len(launched.sampled)):
            seq = batch.seqs[i]
            seq.num_pending -= 1
            if not seq.is_finished:
                live.append((seq, tok, lp))
        if not live:
            return []
        toks = [tok for _, tok, _ in live]
        compressed = self._compress(toks)
        detokenize_step(self.tokenizer, [seq.detokenizer for seq, _, _ in live], toks)
        outputs = []
        for (seq, tok, lp), ctok in zip(live, compressed):
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


@dataclass
class _Launched:
    """A step handed to the executor and not read yet."""

    batch: ScheduledBatch
    handle: Any  # the executor's
    step_id: int
    sample_index: dict[int, int]  # seq id -> index of its token among the step's sampled tokens
    epochs: list[int]  # each sequence's preemption count at launch (a later preemption voids its advance)
    sampled: list[int]  # indices into batch.seqs of the sequences that sample, in token order


def _pick(batch: ScheduledBatch, indices) -> ScheduledBatch:
    """Some sequences of a scheduled batch as a batch of their own (their KV blocks are already allocated)."""
    idx = list(indices)
    return ScheduledBatch([batch.seqs[i] for i in idx], [batch.num_new_tokens[i] for i in idx],
                          [batch.start_positions[i] for i in idx])
