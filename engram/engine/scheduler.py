"""Continuous batching: which sequences run this step and how many of their tokens. A step spends at most
``max_num_batched_tokens`` over at most ``max_num_seqs`` sequences: running sequences first, oldest first, then waiting
ones in arrival order, each starting after its longest cached block prefix (block_manager.py), prompts chunked to the
budget left. When KV blocks run out the newest running sequence is preempted by recompute and nothing is admitted that
step; lookup timing never matters."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from engram.engine.block_manager import BlockManager
from engram.engine.config import EngineConfig
from engram.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engram.engine.spec.speculator import Speculator


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # sequences computed this step, in packing order
    num_new_tokens: list[int] = field(default_factory=list)  # tokens of each computed this step (>= 1)
    start_positions: list[int] = field(default_factory=list)  # each sequence's num_computed_tokens before the step
    # speculative decoding: drafts after each sequence's known tokens (counted in num_new_tokens), and the span of
    # the sequence's own tokens they copy (n-gram), or None (a draft model's come from the Worker)
    num_drafts: list[int] = field(default_factory=list)
    draft_spans: list[tuple[int, int] | None] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sequences that lost their blocks this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples(self) -> list[bool]:
        """Whether each sequence reaches its last token this step (so a new token is sampled for it)."""
        return [s0 + n - k == seq.num_scheduled_tokens
                for seq, s0, n, k in zip(self.seqs, self.start_positions, self.num_new_tokens, self.drafts_of())]

    def drafts_of(self) -> list[int]:
        """[S] drafts of each sequence (zeros without speculation)."""
        return self.num_drafts or [0] * len(self.seqs)

    def sample_indices(self) -> list[int]:
        """Indices (into ``seqs``) of the sequences that sample a token this step."""
        return [i for i, sample in enumerate(self.samples()) if sample]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, speculator: "Speculator | None" = None):
        self.config = config
        self.blocks = block_manager
        self.speculator = speculator  # speculative decoding: drafts for decoding sequences (engine/spec/)
        self.waiting: deque[Sequence] = deque()  # arrival order; preempted sequences go back to the front
        self.running: list[Sequence] = []  # admission order (oldest first)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, hold: Callable[[Sequence], bool] | None = None, max_seqs: int | None = None) -> ScheduledBatch:
        """The next step; running sequences ``hold`` is true for sit it out (a token in flight certainly their last).
        ``max_seqs``: at most this many sequences in the step (a microbatch's share; None: max_num_seqs)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_num_seqs if max_seqs is None else max_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(batch.seqs) < cap:
            seq = self.running[i]
            if hold is not None and hold(seq):
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = self._drafts(seq, n, budget)
            if drafts[0] and not self.blocks.can_allocate(seq, n + drafts[0]):
                drafts = (0, None)  # no block for the drafts: decode without them rather than preempt anyone
            while not self.blocks.can_allocate(seq, n + drafts[0]):
                victim = self.running.pop()  # newest first; never one already scheduled (those sit before i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._take(batch, seq, n, drafts)
                budget -= n + (self.speculator.cost(seq, drafts[0]) if drafts[0] else 0)
                i += 1
        while (self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.config.max_num_seqs
               and len(batch.seqs) < cap):
            seq = self.waiting[0]
            hits = self.blocks.lookup(seq)  # its longest cached block prefix (prefix caching)
            n = min(seq.num_uncomputed_tokens - len(hits) * self.blocks.block_size, budget)
            if not self.blocks.can_admit(seq, hits, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.blocks.admit(seq, hits, n)
            seq.num_draft_computed = seq.num_computed_tokens  # a draft model's K/V of cached blocks was kept too
            self._append(batch, seq, n)
            budget -= n
        if self.speculator is None:
            batch.num_drafts, batch.draft_spans = [], []
        return batch

    def _drafts(self, seq: Sequence, n: int, budget: int) -> tuple[int, tuple[int, int] | None]:
        """(drafts, span) for ``seq`` when it decodes (its one new token samples): the n-gram proposer's span of the
        sequence's tokens, or a draft model's count (span None: the Worker fills them in)."""
        if self.speculator is None or n != 1 or seq.num_uncomputed_tokens != 1:
            return 0, None
        got = self.speculator.drafts(seq, budget - 1, len(self.running))
        return (got[1] - got[0], got) if isinstance(got, tuple) else (got, None)

    def _take(self, batch: ScheduledBatch, seq: Sequence, n: int, drafts=(0, None)) -> None:
        self.blocks.allocate(seq, n + drafts[0])
        self._append(batch, seq, n, drafts)

    def _append(self, batch: ScheduledBatch, seq: Sequence, n: int, drafts=(0, None)) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n + drafts[0])
        batch.start_positions.append(seq.num_computed_tokens)
        batch.num_drafts.append(drafts[0])
        batch.draft_spans.append(drafts[1])

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
