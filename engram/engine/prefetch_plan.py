"""Prompt rows ahead of their prefill (engine side, CPU). A prompt's Engram row ids are known at admission: the
engine hashes them then (``admit``), and every step description carries a ``prefetch`` field listing the next prompt
ranges, in the scheduler's FCFS order (running sequences still in their prompt, oldest first, then the waiting queue),
for the Workers to fetch into their staging area (engine/prefetch_stage.py) while the request waits and while earlier
chunks compute. A later prefill chunk then reads those positions' rows from the staging area (``StagedUse``) instead of
gathering them.

The engine and each Worker keep the same book without talking back: a range is sent once; it is released when a step
computes up to its end (or starts past it: a prefix-cache hit), and every range of a sequence is dropped when it is
preempted (``PrefetchOrder.drop``: the Workers drop theirs) or finished. The engine never sends more than
``budget_bytes`` of staged ranges at once; a Worker that could not stage a range (full, failed, or one whose lookups
cannot use it) gathers those rows as it would without prefetch, so outputs never depend on it. Scheduling never looks
at prefetch: batch composition is the same with it on and off.

Positions are cut into ranges of ``RANGE_TOKENS`` aligned to multiples of it (a range starting in the middle of one
begins at the first position not yet computed)::

    prompt of 700 tokens, 300 computed:  [0 .. 256) done | [300 .. 512) | [512 .. 700)   <- sent in this order"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engram.engine.row_dedup import DedupRows, dedupe
from engram.engine.scheduler import ScheduledBatch
from engram.engine.sequence import Sequence

RANGE_TOKENS = 256  # prompt positions per staged range (ranges are aligned to it)


@dataclass(frozen=True)
class PrefetchRange:
    """Rows to stage: prompt positions [start, end) of sequence ``seq_id``, deduplicated per Engram layer."""

    seq_id: int
    start: int  # first position
    end: int  # one past the last
    row_ids: dict[int, torch.Tensor]  # layer -> [end - start, n_cols] int64 row ids of those positions
    dedup: dict[int, DedupRows]  # layer -> its distinct ids (what a Worker fetches) and their inverse index
    nbytes: int  # staging bytes: the distinct rows' raw bytes and the inverse index, over every layer

    @property
    def key(self) -> tuple[int, int, int]:
        return self.seq_id, self.start, self.end


@dataclass(frozen=True)
class StagedUse:
    """Token rows [row, row + count) of a step take their rows from positions [offset, offset + count) of a staged
    range (its ``key``)."""

    key: tuple[int, int, int]  # (seq_id, start, end) of the range
    row: int  # first packed token row of the step
    offset: int  # its position's index inside the range
    count: int


@dataclass
class PrefetchOrder:
    """What a step asks the Workers to do with their staging areas."""

    ranges: list[PrefetchRange] = field(default_factory=list)  # new ranges to fetch, in FCFS order
    drop: list[int] = field(default_factory=list)  # sequences whose staged ranges go (preempted)


def range_bytes(dedup: dict[int, DedupRows], row_bytes: int) -> int:
    """Staging bytes of a range: per layer its distinct raw rows and the int64 inverse index."""
    return sum(d.num_unique * row_bytes + d.num_ids * 8 for d in dedup.values())


class PromptPrefetcher:
    """The engine's book of staged prompt ranges (see the module docstring). ``row_bytes``: a raw table row (264 for
    V4.1's MXFP8 rows); ``budget_bytes``: the staging bound (``EngineConfig.prefetch_staging_bytes``)."""

    def __init__(self, hasher, n_cols: int, num_layers: int, row_bytes: int, budget_bytes: int):
        worst = RANGE_TOKENS * n_cols * num_layers * (row_bytes + 8)
        if budget_bytes < worst:
            raise ValueError(f"engine.prefetch_staging_bytes={budget_bytes}: must hold at least one prompt range of "
                             f"{RANGE_TOKENS} tokens ({worst} bytes: {n_cols} columns x {num_layers} Engram layers x "
                             f"({row_bytes} B raw row + 8 B index)); raise it or turn engine.prompt_prefetch off")
        self.hasher, self.row_bytes, self.budget_bytes = hasher, row_bytes, budget_bytes
        self._rows: dict[int, dict[int, torch.Tensor]] = {}  # seq id -> layer -> [prompt, n_cols] row ids
        self._sent: dict[int, dict[int, PrefetchRange]] = {}  # seq id -> range index -> the range, staged now
        self.used_bytes = 0

    def admit(self, seq: Sequence) -> None:
        """Hash ``seq``'s prompt from position 0 (its row ids per layer, bitwise a step's: hashing.py)."""
        ids = torch.tensor(seq.compressed_ids[:seq.num_prompt_tokens], dtype=torch.long)
        cu = torch.tensor([0, len(ids)], dtype=torch.long)
        rows, _ = self.hasher.hash_step(ids, cu, self.hasher.initial_lookback(1))
        self._rows[seq.seq_id] = rows

    def forget(self, seq_id: int) -> None:
        """A finished or aborted sequence: its rows and ranges go (the Workers drop theirs with finished_seq_ids)."""
        self._rows.pop(seq_id, None)
        self._release(seq_id, None)

    def uses(self, batch: ScheduledBatch, cu_seqlens: torch.Tensor) -> list[StagedUse]:
        """The token rows of ``batch`` (packed at ``cu_seqlens``) whose rows are staged."""
        out = []
        cu = cu_seqlens.tolist()
        for i, (seq, s0, n) in enumerate(zip(batch.seqs, batch.start_positions, batch.num_new_tokens)):
            for r in sorted(self._sent.get(seq.seq_id, {}).values(), key=lambda r: r.start):
                a, b = max(r.start, s0), min(r.end, s0 + n)
                if a < b:
                    out.append(StagedUse(r.key, cu[i] + a - s0, a - r.start, b - a))
        return out

    def advance(self, batch: ScheduledBatch, order: list[Sequence]) -> PrefetchOrder:
        """After ``batch`` is described: release the ranges it reaches, drop its preempted sequences' ranges, and send
        the next ranges in ``order`` (FCFS) that fit the budget, stopping at the first that does not."""
        out = PrefetchOrder()
        reached = {}
        for seq, s0, n in zip(batch.seqs, batch.start_positions, batch.num_new_tokens):
            reached[seq.seq_id] = s0 + n
            self._release(seq.seq_id, s0 + n)
        for seq in batch.preempted:
            if self._sent.get(seq.seq_id):
                out.drop.append(seq.seq_id)
            self._release(seq.seq_id, None)
        for seq in order:
            rows = self._rows.get(seq.seq_id)
            if rows is None or seq.is_finished:
                continue
            nxt = reached.get(seq.seq_id, seq.num_computed_tokens)
            if nxt >= seq.num_prompt_tokens:  # its prompt is computed: nothing left to stage
                continue
            sent = self._sent.setdefault(seq.seq_id, {})
            for k in range(nxt // RANGE_TOKENS, -(-seq.num_prompt_tokens // RANGE_TOKENS)):
                if k in sent:
                    continue
                start, end = max(k * RANGE_TOKENS, nxt), min((k + 1) * RANGE_TOKENS, seq.num_prompt_tokens)
                ids = {lid: r[start:end] for lid, r in rows.items()}  # [end - start, n_cols] each
                dedup = {lid: dedupe(r) for lid, r in ids.items()}
                nbytes = range_bytes(dedup, self.row_bytes)
                if self.used_bytes + nbytes > self.budget_bytes:
                    return out
                sent[k] = PrefetchRange(seq.seq_id, start, end, ids, dedup, nbytes)
                self.used_bytes += nbytes
                out.ranges.append(sent[k])
        return out

    def _release(self, seq_id: int, upto: int | None) -> None:
        """Release ``seq_id``'s ranges ending at or before ``upto`` (None: all of them)."""
        sent = self._sent.get(seq_id)
        if not sent:
            return
        for k in [k for k, r in sent.items() if upto is None or r.end <= upto]:
            self.used_bytes -= sent.pop(k).nbytes
        if upto is None:
            del self._sent[seq_id]
