"""What a draft model runs in a step (engine side, CPU): ``DraftPlanner.plan`` turns a scheduled step into a
``DraftPlan`` of plain step descriptions, so the Worker's draft model runs them with the eager runner like any step.

* Pass 1: every sequence of the step, from the draft model's progress (``Sequence.num_draft_computed``: the target's
  start, or one token before after a step that accepted every draft) to its last known token; the speculating
  sequences sample their first draft at their last row. Its Engram rows are planned here, with the draft's hasher.
* Pass j = 2 .. k: one token a speculating sequence that still drafts — draft j - 1, at its position — with
  placeholder ids and rows that the Worker fills in on the device from the drafts (``Drafter``).

So the draft model runs K rows for a speculating sequence per step (the decode reservation, engine/spec/config.py),
and the KV of its accepted drafts is already in its cache when the next step starts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engram.engine.packing import describe, pack, slot_mapping
from engram.engine.planner import LookupPlanner
from engram.engine.scheduler import ScheduledBatch
from engram.engine.step import SampleSpec, StepDescription
from engram.hashing import NgramHasher

GREEDY = SampleSpec(0.0, 1.0, 0, None, 0, (), -1, -1)  # drafts are the draft model's argmax (a one-hot proposal)


@dataclass
class DraftPlan:
    """A step's draft-model work, for the Q sequences that speculate (in the step's sampling order)."""

    passes: list[StepDescription]  # pass 1 (every sequence; samples the Q), then passes 2 .. max k (placeholders)
    active: list[list[int]]  # [passes - 1] which of the Q feed a draft in pass j (j >= 2)
    num_drafts: list[int]  # [Q] drafts of each speculating sequence
    draft_lookback: torch.Tensor | None  # [Q, W_draft] int64 draft-hasher ids before each one's first draft
    target_lookback: torch.Tensor | None  # [Q, W] int64 target-hasher ids before each one's first draft


class DraftPlanner:
    def __init__(self, draft_hasher: NgramHasher | None, target_has_engram: bool, block_size: int,
                 has_dead_tokens: bool):
        self.hasher, self.planner = draft_hasher, LookupPlanner(draft_hasher)
        self.pad = (draft_hasher.initial_lookback(1)[0].tolist() if draft_hasher is not None else [])  # [W_draft]
        self.target_has_engram = target_has_engram
        self.block_size, self.has_dead = block_size, has_dead_tokens

    def plan(self, batch: ScheduledBatch, step: StepDescription) -> DraftPlan:
        drafts = batch.drafts_of()
        known_end = [s0 + n - k for s0, n, k in zip(batch.start_positions, batch.num_new_tokens, drafts)]
        starts = []
        for seq, s0 in zip(batch.seqs, batch.start_positions):
            if not s0 - 1 <= seq.num_draft_computed <= s0:
                raise RuntimeError(f"sequence {seq.request_id!r}: the draft model has {seq.num_draft_computed} "
                                   f"tokens, the target {s0}; it may trail by one token at most")
            starts.append(seq.num_draft_computed)
        first = ScheduledBatch(list(batch.seqs), [e - d for e, d in zip(known_end, starts)], starts)
        packed = pack(first, self.hasher.pad_id if self.hasher else 0, self.pad if self.hasher else None)
        plan = self.planner.plan(packed.compressed_ids, packed.cu_seqlens, packed.lookback)
        pass1 = describe(step.step_id, first, packed, plan, self.block_size, None, self.has_dead and bool(self.hasher),
                         [])
        spec = [i for i, k in enumerate(drafts) if k]
        ks = [drafts[i] for i in spec]
        pass1.sample_rows, pass1.samples = spec, [GREEDY] * len(spec)
        pass1.prompt_logprobs, pass1.cached_starts = [], []
        passes, active = [pass1], []
        for j in range(2, max(ks, default=0) + 1):
            act = [q for q, k in enumerate(ks) if k >= j]
            active.append(act)
            passes.append(self._one_token(step.step_id, [batch.seqs[spec[q]] for q in act],
                                          [known_end[spec[q]] + j - 2 for q in act]))
        seqs = [batch.seqs[i] for i in spec]
        ends = [known_end[i] for i in spec]
        return DraftPlan(
            passes, active, ks,
            _ids([s.lookback_before(e, self.pad) for s, e in zip(seqs, ends)]) if self.hasher and seqs else None,
            _ids([s.lookback_before(e) for s, e in zip(seqs, ends)]) if self.target_has_engram and seqs else None)

    def _one_token(self, step_id: int, seqs, positions: list[int]) -> StepDescription:
        """A pass feeding one placeholder token to each of ``seqs`` at ``positions`` (ids patched on the device)."""
        p = len(seqs)
        pos = torch.tensor(positions, dtype=torch.long)
        cu = torch.arange(p + 1, dtype=torch.long)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs], dtype=torch.long)
        n_cols = self.hasher.cfg.n_cols if self.hasher else 0
        return StepDescription(
            step_id=step_id, seq_ids=[s.seq_id for s in seqs], start_positions=list(positions),
            num_new_tokens=[1] * p, token_ids=torch.zeros(p, dtype=torch.long), positions=pos, cu_seqlens=cu,
            context_lens=pos + 1, block_tables=tables, slot_mapping=slot_mapping(cu, pos, tables, self.block_size),
            dead_mask=torch.zeros(p, dtype=torch.bool) if self.has_dead and self.hasher else None,
            engram_row_ids={lid: torch.zeros(p, n_cols, dtype=torch.long) for lid in self.hasher.cfg.layer_ids}
            if self.hasher else {},
            sample_rows=list(range(p)), samples=[GREEDY] * p)


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(rows, dtype=np.int64).reshape(len(rows), -1))
