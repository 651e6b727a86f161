"""The engine's step pipeline (``StepPipeline``, held by ``LLMEngine``): schedule, launch (pack → plan lookups →
describe → ``executor.launch``), collect (→ the engine's ``postprocess``), and recover when a step fails.

Launching commits the scheduler-visible state; a failed step is rolled back and re-run in halves so the other requests
go on (``StepError``). Async scheduling launches step N+1 before reading step N (its decode tokens are N's sampled ids,
still on the device); outputs equal synchronous scheduling's, but a stopping sequence computes one dropped token and
admission comes one step later. The pipeline owns the step in flight, the step counters and the ids of sequences
retired since the last launch (``retire``: told to the Workers with the next step); everything else comes through
its constructor."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
import itertools
from typing import Any, Callable

import torch

from engram.engine.config import EngineConfig
from engram.engine.executor import Executor
from engram.engine.outputs import RequestOutput
from engram.engine.packing import describe, pack
from engram.engine.planner import LookupPlanner
from engram.engine.prefetch_plan import PromptPrefetcher
from engram.engine.row_trace import RowTraceWriter, StepRows
from engram.engine.scheduler import ScheduledBatch, Scheduler
from engram.engine.sequence import Sequence
from engram.engine.spec.speculator import Speculator
from engram.engine.step import StepResult
from engram.engine.step_trace import StepRecord, StepTrace

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """Some requests of a step failed; the rest ran. ``request_ids``: the failed ones (still queued, nothing committed:
    abort or retry); ``outputs``: the others' RequestOutputs; ``__cause__``: the first failure."""

    def __init__(self, error: BaseException, request_ids: list[str], outputs: list[RequestOutput]):
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids = request_ids
        self.outputs = outputs


class StepPipeline:
    """Scheduling, launching, collecting and failure isolation of ``LLMEngine`` (see the module docstring).
    ``postprocess(launched, result) -> outputs`` commits a collected step (the engine's)."""

    def __init__(self, config: EngineConfig, device: torch.device, scheduler: Scheduler, executor: Executor,
                 planner: LookupPlanner, pad_id: int, eos_token_id: int | None, has_dead_tokens: bool,
                 max_model_len: int, postprocess: Callable[["Launched", StepResult], list[RequestOutput]],
                 speculator: Speculator | None = None, prefetcher: PromptPrefetcher | None = None,
                 row_trace: RowTraceWriter | None = None):
        self.config, self.device, self.scheduler, self.executor, self.planner = (config, torch.device(device),
                                                                                 scheduler, executor, planner)
        self.pad_id, self.eos_token_id, self.has_dead_tokens = pad_id, eos_token_id, has_dead_tokens
        self.max_model_len, self._postprocess = max_model_len, postprocess
        self.prefetcher = prefetcher  # prompt rows staged ahead (prefetch_plan.py), or None
        self.row_trace = row_trace  # the collected steps' row ids go there (row_trace.py), or None
        self._step_ids = itertools.count()
        self._finished_seq_ids: list[int] = []  # retired since the last launch: told to the Workers with the next
        self.num_preemptions = 0  # sequences preempted by recompute since start
        self.num_steps = 0
        self.trace = StepTrace()  # the collected steps (step_trace.py)
        self._inflight: Launched | None = None  # async scheduling: the launched step not read yet
        self.speculator = speculator  # speculative decoding (engine/spec/): drafts were scheduled, accepts commit here
        self._read_at: float | None = None  # monotonic time the last step's tokens were read (the host gap's start)

    def retire(self, seq_id: int) -> None:
        """A sequence finished or was aborted: the Workers drop its state with the next step."""
        self._finished_seq_ids.append(seq_id)

    @property
    def in_flight(self) -> "Launched | None":
        return self._inflight

    def drop_orphaned(self) -> None:
        """Read the step in flight when every request in it is gone (aborted), so no device work outlives them;
        its tokens are dropped."""
        if self._inflight is not None and all(seq.is_finished for seq in self._inflight.batch.seqs):
            gone, self._inflight = self._inflight, None
            try:
                self._collect(gone)
            except Exception as e:
                log.warning("a step whose requests were all aborted failed: %s: %s", type(e).__name__, e)

    def step(self) -> list[RequestOutput]:
        """Run one step -> the outputs of the step that completed (with async scheduling, the one launched before)."""
        if self.async_scheduling():
            return self._step_async()
        if self._inflight is not None:  # async scheduling was just turned off (the executor stopped taking them)
            prev, self._inflight = self._inflight, None
            return self._collect(prev)
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        return self._run_isolated(batch)

    def async_scheduling(self) -> bool:
        """Async scheduling: asked for, or (auto) on CUDA wherever the Workers take steps with tokens on the device."""
        c = self.config.async_scheduling
        if self.speculator is not None:  # a step's inputs depend on the accepted count of the one before
            return False
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
            # Workers that cannot take tokens still on the device (the multi-process executor): read prev
            # first, then launch; steps without such tokens (prefill chunks) still run ahead.
            outputs = self._collect_or_rerun(prev)
            return outputs + self._launch_ahead(pick(batch, [i for i, seq in enumerate(batch.seqs)
                                                              if not seq.is_finished]), None, outputs)
        try:
            self._inflight = self._launch(batch, prev)
        except Exception as e:  # nothing of it was committed: read prev, then run that batch synchronously
            log.warning("launching step %d ahead failed (%s: %s): reading the step before, then running it "
                        "synchronously", self.num_steps, type(e).__name__, e)
            outputs = self._collect_or_rerun(prev)
            return outputs + self._run_or_fold(pick(batch, [i for i, seq in enumerate(batch.seqs)
                                                             if not seq.is_finished]), outputs)
        return self._collect_or_rerun(prev)

    def _launch_ahead(self, batch: ScheduledBatch, prev: "Launched | None",
                      outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Launch ``batch`` and leave it in flight; if the launch fails, run it synchronously instead."""
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
        """Whether ``seq``'s token in flight is certainly its last (length limits): then it sits the next step out."""
        if not seq.num_pending:
            return False
        total = seq.num_scheduled_tokens
        p = seq.params
        return total >= self.max_model_len or (p.max_tokens is not None
                                               and total - seq.num_prompt_tokens >= p.max_tokens)

    def _collect_or_rerun(self, launched: "Launched") -> list[RequestOutput]:
        """Read a launched step; on failure drop the step launched after it, re-run this batch isolating failures."""
        try:
            return self._collect(launched)
        except Exception as e:
            log.warning("step %d failed (%s: %s): its sequences run again, isolated", launched.step_id,
                        type(e).__name__, e)
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
            return self._run_isolated(pick(launched.batch, live))

    def _run_isolated(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launch and read ``batch`` now; on failure find who fails and run the others."""
        if batch.is_empty:
            return []
        try:
            return self._run(batch)
        except Exception as e:  # nothing was committed: find who fails, run the others
            log.warning("a step of %d sequences failed (%s: %s): they run again, isolated", len(batch.seqs),
                        type(e).__name__, e)
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

    def _launch(self, batch: ScheduledBatch, prev: "Launched | None") -> "Launched":
        """Describe ``batch``, start it, and only then advance the scheduler-visible state. ``prev``: the step in flight
        whose sampled tokens some of this step's inputs are."""
        packed = pack(batch, self.pad_id)
        sources = []
        for _, seq, _ in packed.pending:
            if prev is None or seq.seq_id not in prev.sample_index:
                raise RuntimeError(f"sequence {seq.request_id!r} has a token in flight that is not the last step's")
            sources.append(prev.sample_index[seq.seq_id])
        uses = self.prefetcher.uses(batch, packed.cu_seqlens) if self.prefetcher is not None else []
        plan = self.planner.plan(packed.compressed_ids, packed.cu_seqlens, packed.lookback,
                                 [before for _, _, before in packed.pending], [row for row, _, _ in packed.pending],
                                 [u.row + i for u in uses for i in range(u.count)])  # row ids per layer (+ distinct)
        step = describe(next(self._step_ids), batch, packed, plan, self.config.block_size, self.eos_token_id,
                        self.has_dead_tokens, self._finished_seq_ids)
        if self.prefetcher is not None:  # the next prompt ranges, FCFS, while this step computes
            order = self.prefetcher.advance(batch, self.scheduler.running + list(self.scheduler.waiting))
            step.prefetch, step.prefetch_drop, step.staged_uses = order.ranges, order.drop, uses
        step.group_tables = self.scheduler.blocks.group_tables(batch.seqs)  # cache groups (DeepSeek-V4), else {}
        if self.speculator is not None and self.speculator.draft_planner is not None:
            step.draft = self.speculator.draft_planner.plan(batch, step)  # the draft model's passes
        if packed.pending:
            step.pending_rows = [row for row, _, _ in packed.pending]
            step.pending_sources, step.pending_step_id = sources, prev.step_id
            step.pending_partials = plan.pending_partials
        launched_at = time.monotonic()
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
        ids, unique = plan.dedup_counts()
        # the host gap: since the last step was read, unless this one was launched while another was in flight
        gap = 0.0 if prev is not None or self._read_at is None else max(0.0, launched_at - self._read_at)
        rows = (StepRows(plan.row_ids, plan.pending_partials, step.pending_rows, step.pending_sources,
                         step.pending_step_id) if self.row_trace is not None and plan.row_ids else None)
        return Launched(batch, handle, step.step_id, {batch.seqs[i].seq_id: j for j, i in enumerate(sampled)},
                         [seq.metrics.num_preemptions for seq in batch.seqs], sampled,
                         step.context_lens.tolist(), dict(host_gap_s=gap, ids=ids, unique_ids=unique), rows)

    def _collect(self, launched: "Launched") -> list[RequestOutput]:
        try:
            result = self.executor.collect(launched.handle)
        except Exception:
            self._rollback(launched)
            raise
        if self.speculator is not None:
            self._commit_drafts(launched, result.num_emitted)
        self._read_at = time.monotonic()
        self._commit_blocks(launched)
        record = StepRecord.from_shape(launched.step_id, result.route, launched.batch.num_new_tokens,
                                       launched.context_lens, _head_rows(launched), result.gpu_s, result.idle_s,
                                       lookup_exposed_s=result.lookup_exposed_s, gather_s=result.gather_s,
                                       **launched.lookups)
        self.trace.append(record)
        if self.row_trace is not None:
            self.row_trace.record(record.step_id, record.kind, record.num_tokens, launched.rows, result.token_ids)
        return self._postprocess(launched, result)

    def _commit_drafts(self, launched: "Launched", num_emitted: list[int]) -> None:
        """Speculative decoding: each sampling sequence kept its accepted drafts (``num_emitted - 1``; empty when none
        drafted); the rejected ones' positions are given back (their KV slots are written again) before any block is
        registered, and every sequence's draft-model progress advances."""
        batch = launched.batch
        accepted = dict(zip(launched.sampled, [n - 1 for n in num_emitted] or [0] * len(launched.sampled)))
        for i, (seq, k) in enumerate(zip(batch.seqs, batch.drafts_of())):
            a = accepted.get(i, 0)
            launched.context_lens[i] -= k - a
            if not seq.is_finished and seq.metrics.num_preemptions == launched.epochs[i]:
                self.speculator.commit(seq, batch.start_positions[i], batch.num_new_tokens[i], k, a)

    def _commit_blocks(self, launched: "Launched") -> None:
        """Offer the prefix cache the full blocks this collected step computed, before its finished sequences give
        their blocks back; sequences aborted or preempted since its launch hold no blocks of it any more."""
        for seq, epoch, end in zip(launched.batch.seqs, launched.epochs, launched.context_lens):
            if not seq.is_finished and seq.metrics.num_preemptions == epoch:
                self.scheduler.blocks.commit(seq, end)

    def _rollback(self, launched: "Launched") -> None:
        """Undo what ``_launch`` advanced (a step that failed, or was dropped, computed nothing)."""
        for seq, n, epoch in zip(launched.batch.seqs, launched.batch.num_new_tokens, launched.epochs):
            if seq.metrics.num_preemptions == epoch:  # a sequence preempted since restarts from 0 anyway
                seq.num_computed_tokens -= n
        for i in launched.sampled:
            launched.batch.seqs[i].num_pending -= 1

    def _run_isolating(self, batch: ScheduledBatch, failed: list[str]) -> list[RequestOutput]:
        """Re-run a failed batch in halves; a sequence failing alone stays uncommitted, its id in ``failed``."""
        if len(batch.seqs) == 1:
            try:
                return self._run(batch)
            except Exception:
                failed.append(batch.seqs[0].request_id)
                return []
        half = len(batch.seqs) // 2
        return (self._run_isolating(pick(batch, range(half)), failed)
                + self._run_isolating(pick(batch, range(half, len(batch.seqs))), failed))


@dataclass
class Launched:
    """A step handed to the executor and not read yet."""

    batch: ScheduledBatch
    handle: Any  # the executor's
    step_id: int
    sample_index: dict[int, int]  # seq id -> index of its token among the step's sampled tokens
    epochs: list[int]  # each sequence's preemption count at launch (a later preemption voids its advance)
    sampled: list[int]  # indices into batch.seqs of the sequences that sample, in token order
    context_lens: list[int]  # each sequence's KV length after the step (its shape, for the step trace)
    lookups: dict  # for its StepRecord: host_gap_s, and the Engram ids planned / distinct per layer
    rows: StepRows | None = None  # its plan's row ids for the row trace (None: no trace, or no Engram layers)


def _head_rows(launched: Launched) -> int:
    """The step's LM-head rows: one a sampling sequence, plus its drafts (a verify step samples at each of them)."""
    drafts = launched.batch.num_drafts
    return len(launched.sampled) + (sum(drafts[i] for i in launched.sampled) if drafts else 0)


def pick(batch: ScheduledBatch, indices) -> ScheduledBatch:
    """Some sequences of a scheduled batch as a batch of their own (their KV blocks are already allocated)."""
    idx = list(indices)
    return ScheduledBatch([batch.seqs[i] for i in idx], [batch.num_new_tokens[i] for i in idx],
                          [batch.start_positions[i] for i in idx],
                          num_drafts=[batch.num_drafts[i] for i in idx] if batch.num_drafts else [],
                          draft_spans=[batch.draft_spans[i] for i in idx] if batch.draft_spans else [])
