"""Model runner: packs a scheduled batch into StepInputs, runs the model on its KV cache, returns logits.

``pack`` turns a ScheduledBatch into a ``PackedBatch`` (CPU tensors: raw and compressed ids, positions,
per-sequence offsets, lookbacks) that both the lookup planner and ``run`` read. ``run`` moves it to the
device, hands the model an ``engram_rows`` callable that serves the step's staged rows (checking they
were staged for this plan), gathers and scatters the paper variant's per-sequence conv state, and
returns float32 logits of the sequences that sample this step. It knows nothing about scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.lookup import LookupPlan, StagedRows
from engram.engine.scheduler import ScheduledBatch
from engram.model.inputs import StepInputs
from engram.short_conv import ShortConvState


@dataclass
class PackedBatch:
    seq_ids: list[int]  # engine sequence id of each packed sequence
    token_ids: torch.Tensor  # [T] int64 raw ids of the step's new tokens, sequence after sequence
    compressed_ids: torch.Tensor  # [T] int64 compressed ids (DEAD = -1)
    positions: torch.Tensor  # [T] int64 position of each token in its sequence
    cu_seqlens: torch.Tensor  # [S+1] int64 token offsets
    context_lens: torch.Tensor  # [S] int64 KV length of each sequence after the step
    lookback: torch.Tensor  # [S, max_ngram-1] int64 each sequence's lookback before the step
    block_tables: torch.Tensor  # [S, max_blocks] int64, -1 padded
    sample_rows: list[int]  # indices (into the S sequences) that sample a token this step

    @property
    def logits_indices(self) -> torch.Tensor:
        """[N] token row of each sampling sequence's last new token."""
        return (self.cu_seqlens[1:] - 1)[self.sample_rows]


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
        seq_ids=[s.seq_id for s in seqs],
        token_ids=torch.tensor(toks, dtype=torch.long),
        compressed_ids=torch.tensor(comp, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        cu_seqlens=cu,
        context_lens=torch.tensor(batch.start_positions, dtype=torch.long) + lens,
        lookback=torch.stack([s.lookback for s in seqs]),  # [S, W]
        block_tables=torch.tensor(tables, dtype=torch.long),  # [S, width]
        sample_rows=[i for i, sample in enumerate(batch.samples()) if sample],
    )


class ModelRunner:
    def __init__(self, model, kv_cache, block_size: int, device: torch.device, has_dead_tokens: bool):
        self.model = model
        self.kv = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)
        self.has_dead_tokens = has_dead_tokens  # dead_mask is passed only when the config names DEAD ids

    def slot_mapping(self, packed: PackedBatch) -> torch.Tensor:
        """[T] flat KV slot of each new token: its block's id * block_size + offset in the block."""
        lens = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
        seq_of_tok = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # [T]
        blocks = packed.block_tables[seq_of_tok, packed.positions // self.block_size]  # [T]
        return blocks * self.block_size + packed.positions % self.block_size

    @torch.inference_mode()
    def run(self, packed: PackedBatch, plan: LookupPlan, staged: StagedRows, seqs) -> torch.Tensor:
        """One forward over the packed step -> float32 logits [len(packed.sample_rows), vocab]."""
        dev = self.device
        cu_seqlens = packed.cu_seqlens.to(dev)  # [S+1], shared by attention and the conv states
        conv = self._gather_conv_state(seqs, cu_seqlens)
        inputs = StepInputs(
            token_ids=packed.token_ids.to(dev),
            positions=packed.positions.to(dev),
            cu_seqlens=cu_seqlens,
            context_lens=packed.context_lens.to(dev),
            block_tables=packed.block_tables.to(dev),
            slot_mapping=self.slot_mapping(packed).to(dev),
            engram_rows=lambda layer_id: staged.rows(layer_id, plan.plan_id),
            dead_mask=(packed.compressed_ids < 0).to(dev) if self.has_dead_tokens else None,
            conv_state=conv,
            logits_indices=packed.logits_indices.to(dev),
        )
        hidden = self.model.forward(inputs, self.kv)  # [N, H]
        logits = self.model.compute_logits(hidden)  # [N, vocab] float32
        if conv is not None:
            self._scatter_conv_state(seqs, conv)
        return logits

    def _gather_conv_state(self, seqs, cu_seqlens: torch.Tensor) -> dict[int, ShortConvState] | None:
        """Paper variant: each Engram layer's per-sequence conv states stacked in packing order."""
        if seqs[0].conv_state is None:
            return None
        return {lid: ShortConvState.stack([s.conv_state[lid] for s in seqs], cu_seqlens)
                for lid in seqs[0].conv_state}

    @staticmethod
    def _scatter_conv_state(seqs, conv: dict[int, ShortConvState]) -> None:
        per_layer = {lid: state.split() for lid, state in conv.items()}
        for i, seq in enumerate(seqs):
            seq.conv_state = {lid: parts[i] for lid, parts in per_layer.items()}
