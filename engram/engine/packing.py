"""Packing (engine side, CPU): a ScheduledBatch and its lookup plan -> the StepDescription a Worker runs (``pack``: the
new tokens back to back with their metadata; ``describe``: slots, row ids, SampleSpecs). With async scheduling a chunk
may end in one *pending* token: placeholders in its row (raw id 0, the compressed pad id), listed in ``pending`` for the
Worker to fill in on the device."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engram.engine.planner import LookupPlan
from engram.engine.scheduler import ScheduledBatch
from engram.engine.sequence import Sequence
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
    pending: list[tuple[int, Sequence, list[int]]]  # (packed row, sequence, W ids before it) per pending token


def pack(batch: ScheduledBatch, pad_id: int = 0, lookback_pad: list[int] | None = None) -> PackedBatch:
    """``pad_id``: the compressed placeholder of pending tokens and of drafts a draft model fills in (the hasher's pad
    id); ``lookback_pad``: another hasher's lookback before position 0 (``Sequence.lookback_before``)."""
    seqs = batch.seqs
    toks, comp, pos, pending = [], [], [], []
    spans = batch.draft_spans or [None] * len(seqs)
    for seq, s0, n, k, span in zip(seqs, batch.start_positions, batch.num_new_tokens, batch.drafts_of(), spans):
        m = n - k  # the sequence's own tokens; k drafts follow them
        known = seq.token_ids[s0:s0 + m]
        toks.extend(known)
        comp.extend(seq.compressed_ids[s0:s0 + m])
        if len(known) < m:  # the chunk ends in a token still on the device
            if len(known) != m - 1:
                raise RuntimeError(f"sequence {seq.request_id!r}: chunk [{s0}, {s0 + m}) holds "
                                   f"{m - len(known)} unread tokens; at most its last one may be")
            pending.append((len(toks), seq, seq.lookback_before(s0 + m - 1)))
            toks.append(0)
            comp.append(pad_id)
        if span is not None:  # n-gram drafts: a copy of the sequence's own tokens, compressed ids included
            toks.extend(seq.token_ids[span[0]:span[1]])
            comp.extend(seq.compressed_ids[span[0]:span[1]])
        elif k:  # a draft model's: placeholders the Worker patches on the device
            toks.extend([0] * k)
            comp.extend([pad_id] * k)
        pos.extend(range(s0, s0 + n))
    lens = _ints(batch.num_new_tokens)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=cu[1:])
    lookbacks = [s.lookback_before(s0, lookback_pad) for s, s0 in zip(seqs, batch.start_positions)]
    return PackedBatch(
        token_ids=_ints(toks),
        compressed_ids=_ints(comp),
        positions=_ints(pos),
        cu_seqlens=cu,
        context_lens=_ints(batch.start_positions) + lens,
        lookback=_ints(itertools.chain.from_iterable(lookbacks)).reshape(len(seqs), len(lookbacks[0])),  # [S, W]
        block_tables=_padded([s.block_table for s in seqs]),  # [S, width]
        sample_rows=batch.sample_indices(),
        pending=pending,
    )


# Step tensors are built through numpy: torch.tensor of a Python list costs several times the host time.
def _ints(values, count: int = -1) -> torch.Tensor:
    """int64 [N] CPU tensor of an iterable of ints (``count`` when known)."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=count))


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """int64 [len(rows), longest] CPU tensor of ragged rows, -1 after each row's end."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), int(lens.max(initial=0))), -1, dtype=np.int64)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                                               count=int(lens.sum()))
    return torch.from_numpy(out)


def slot_mapping(cu_seqlens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[T] flat KV slot of each new token (numpy: a torch CPU op this small costs more in dispatch than work)."""
    lens = np.diff(cu_seqlens.numpy())
    seq_of_tok = np.repeat(np.arange(lens.size), lens)  # [T]
    pos = positions.numpy()
    blocks = block_tables.numpy()[seq_of_tok, pos // block_size]  # [T]
    return torch.from_numpy(blocks * block_size + pos % block_size)


def describe(step_id: int, batch: ScheduledBatch, packed: PackedBatch, plan: LookupPlan, block_size: int,
             eos_token_id: int | None, has_dead_tokens: bool, finished_seq_ids: list[int]) -> StepDescription:
    drafts = [batch.drafts_of()[i] for i in packed.sample_rows]  # [N]
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
        engram_dedup=plan.dedup,
        sample_rows=packed.sample_rows,
        # the token sampled now is output number num_output_tokens + num_pending (tokens in flight come first); a
        # sequence with k drafts samples outputs j .. j + k at its last k + 1 rows
        samples=[SampleSpec.from_params(seq.params, seq.num_output_tokens + seq.num_pending + j, eos_token_id)
                 for seq, k in zip((batch.seqs[i] for i in packed.sample_rows), drafts) for j in range(k + 1)],
        num_drafts=drafts if any(drafts) else [],
        finished_seq_ids=finished_seq_ids,
        cached_starts=[i for i, (seq, s0) in enumerate(zip(batch.seqs, batch.start_positions))
                       if s0 > 0 and s0 == seq.num_cached_tokens],
        prompt_logprobs=[spec for s, (seq, s0, n) in enumerate(zip(batch.seqs, batch.start_positions,
                                                                   batch.num_new_tokens))
                         if (spec := prompt_logprobs_spec(s, seq, s0, n)) is not None],
    )


def prompt_logprobs_spec(s: int, seq, s0: int, n: int) -> PromptLogprobsSpec | None:
    """Rows of ``seq``'s chunk [s0, s0 + n) still to score (row j predicts prompt token s0 + j + 1), none twice."""
    k = seq.params.prompt_logprobs
    if k is None:
        return None
    first = max(0, len(seq.prompt_logprobs) - 1 - s0)  # prompt_logprobs[t] is token t's; [0] is None
    end = min(n, seq.num_prompt_tokens - 1 - s0)
    if first >= end:
        return None
    return PromptLogprobsSpec(s, first, tuple(seq.token_ids[s0 + first + 1:s0 + end + 1]), k)
