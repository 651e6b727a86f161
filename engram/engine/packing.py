"""Packing (engine side, CPU): a ScheduledBatch and its lookup plan -> the StepDescription a Worker runs.

``pack`` lays the step's new tokens of every scheduled sequence back to back (raw and compressed ids,
positions, offsets, KV lengths, block tables, lookbacks) as CPU tensors built from the scheduler's own
numbers; ``describe`` adds the slot mapping, the plan's row ids and each sampling sequence's SampleSpec.
Nothing here touches a device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.planner import LookupPlan
from engram.engine.scheduler import ScheduledBatch
from engram.engine.step import PromptLogprobsSpec, SampleSpec, StepDescription


@dataclass
class PackedBatch:
    token_ids: torch.Tensor  # [T] int64 raw ids of the step's new tokens, sequence after sequence
    compressed_ids: torch.Tensor  # [T] int64 compressed ids (DEAD = -1)
    positions: torch.Tensor  # [T] int64 position of each token in its sequence
    cu_seqlens: torch.Tensor  # [S+1] int64 token offsets
    context_lens: torch.Tensor  # [S] int64 KV length of each sequence after the step
    lookback: torch.Tensor  # [S, max_ngram-1] int64 each sequence's lookback before the step
    block_tables: torch.Tensor  # [S, max_blocks] int64, -1 padded
    sample_rows: list[int]  # indices (into the S sequences) that sample a token this step


def pack(batch: ScheduledBatch) -> PackedBatch:
    seqs = batch.seqs
    toks, comp, pos = [], [], []
    for seq, s0, n in zip(seqs, batch.start_positions, batch.num_new_tokens):
        toks.extend(seq.token_ids[s0:s0 + n])
        comp.extend(seq.compressed_ids[s0:s0 + n])
        pos.extend(range(s0, s0 + n))
    lens = torch.tensor(batch.num_new_tokens, dtype=torch.long)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=cu[1:])
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]  # one tensor build, not S
    return PackedBatch(
        token_ids=torch.tensor(toks, dtype=torch.long),
        compressed_ids=torch.tensor(comp, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        cu_seqlens=cu,
        context_lens=torch.tensor(batch.start_positions, dtype=torch.long) + lens,
        lookback=torch.stack([s.lookback for s in seqs]),  # [S, W]
        block_tables=torch.tensor(tables, dtype=torch.long),  # [S, width]
        sample_rows=batch.sample_indices(),
    )


def slot_mapping(cu_seqlens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[T] flat KV slot of each new token: its block's id * block_size + offset in the block."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_of_tok = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # [T]
    blocks = block_tables[seq_of_tok, positions // block_size]  # [T]
    return blocks * block_size + positions % block_size


def describe(step_id: int, batch: ScheduledBatch, packed: PackedBatch, plan: LookupPlan, block_size: int,
             eos_token_id: int | None, has_dead_tokens: bool, finished_seq_ids: list[int]) -> StepDescription:
    return StepDescription(
        step_id=step_id,
        seq_ids=[s.seq_id for s in batch.seqs],
        start_positions=list(batch.start_positions),
        num_new_tokens=list(batch.num_new_tokens),
        token_ids=packed.token_ids,
        positions=packed.positions,
        cu_seqlens=packed.cu_seqlens,
        context_lens=packed.context_lens,
        block_tables=packed.block_tables,
        slot_mapping=slot_mapping(packed.cu_seqlens, packed.positions, packed.block_tables, block_size),
        dead_mask=(packed.compressed_ids < 0) if has_dead_tokens else None,
        engram_row_ids=plan.row_ids,
        sample_rows=packed.sample_rows,
        samples=[SampleSpec.from_params(batch.seqs[i].params, batch.seqs[i].num_output_tokens, eos_token_id)
                 for i in packed.sample_rows],
        finished_seq_ids=finished_seq_ids,
        prompt_logprobs=[spec for s, (seq, s0, n) in enumerate(zip(batch.seqs, batch.start_positions,
                                                                   batch.num_new_tokens))
                         if (spec := prompt_logprobs_spec(s, seq, s0, n)) is not None],
    )


def prompt_logprobs_spec(s: int, seq, s0: int, n: int) -> PromptLogprobsSpec | None:
    """Rows of sequence ``seq``'s chunk [s0, s0 + n) still to score for its prompt logprobs: row j predicts
    prompt token s0 + j + 1; tokens already scored (before a preemption) are not scored again."""
    k = seq.params.prompt_logprobs
    if k is None:
        return None
    first = max(0, len(seq.prompt_logprobs) - 1 - s0)  # prompt_logprobs[t] is token t's; [0] is None
    end = min(n, seq.num_prompt_tokens - 1 - s0)
    if first >= end:
        return None
    return PromptLogprobsSpec(s, first, tuple(seq.token_ids[s0 + first + 1:s0 + end + 1]), k)
