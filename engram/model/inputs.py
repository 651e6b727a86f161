"""StepInputs: everything the decoder needs for one engine step, as one plain dataclass. Tokens of all sequences are
packed along one axis T; per-sequence metadata says where each sequence's queries sit and which KV blocks it reads.
Engram rows come from the ``engram_rows`` callable, so the model never knows where tables live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # LongTensor[T]: packed raw token ids of this step, all sequences
    positions: torch.Tensor  # LongTensor[T]: absolute position of each token in its sequence (RoPE)
    cu_seqlens: torch.Tensor  # LongTensor[S+1]: query offsets; sequence s owns tokens cu[s]:cu[s+1]
    context_lens: torch.Tensor  # LongTensor[S]: KV length of each sequence after this step
    block_tables: torch.Tensor  # LongTensor[S, max_blocks]: paged-KV blocks of each sequence, -1 pad
    slot_mapping: torch.Tensor  # LongTensor[T]: flat KV slot of each new token (-1: do not store)
    engram_rows: Callable[[int], torch.Tensor] | None  # layer_id -> rows [T, n_cols, head_dim]; may block
    dead_mask: torch.Tensor | None = None  # BoolTensor[T]: DEAD tokens (Engram gate 0); None = none
    conv_state: Any = None  # engram.module.ShortConvState | None: paper variant's per-sequence conv state
    logits_indices: torch.Tensor | None = None  # LongTensor[S']: token rows to return; None = each seq's last
    host_layout: Any = None  # attention.HostLayout: offsets and KV lengths as host numbers; None = read back
    attention: Any = None  # attention.AttentionMetadata built by the caller (CUDA graphs: static buffers)

    def __post_init__(self) -> None:
        t = self.token_ids.shape[0]
        if self.logits_indices is None:
            self.logits_indices = self.cu_seqlens[1:] - 1
        for name in ("positions", "slot_mapping"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"step.{name} has shape {tuple(getattr(self, name).shape)}, expected ({t},)")
        s = self.context_lens.shape[0]
        if self.cu_seqlens.shape != (s + 1,):
            raise ValueError(f"step.cu_seqlens has shape {tuple(self.cu_seqlens.shape)}, expected ({s + 1},) "
                             f"for {s} sequences")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != s:
            raise ValueError(f"step.block_tables has shape {tuple(self.block_tables.shape)}, "
                             f"expected ({s}, max_blocks)")
        if self.dead_mask is not None and self.dead_mask.shape != (t,):
            raise ValueError(f"step.dead_mask has shape {tuple(self.dead_mask.shape)}, expected ({t},)")

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def make_step_inputs(chunks: list[list[int]], past_lens: list[int], block_tables: list[list[int]],
                     block_size: int, engram_rows: Callable[[int], torch.Tensor] | None,
                     device: torch.device | str = "cpu", **extra: Any) -> StepInputs:
    """Pack one step from lists (tests, drivers): sequence s feeds ``chunks[s]`` after ``past_lens[s]`` tokens."""
    if not len(chunks) == len(past_lens) == len(block_tables):
        raise ValueError(f"chunks ({len(chunks)}), past_lens ({len(past_lens)}) and block_tables "
                         f"({len(block_tables)}) must describe the same sequences")
    ids, pos, slots, cu = [], [], [], [0]
    for s, (chunk, past, table) in enumerate(zip(chunks, past_lens, block_tables)):
        if past + len(chunk) > len(table) * block_size:
            raise ValueError(f"sequence {s}: {past + len(chunk)} tokens do not fit {len(table)} blocks of {block_size}")
        for i, tok in enumerate(chunk):
            p = past + i
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + len(chunk))
    width = max((len(t) for t in block_tables), default=0)
    tables = [t + [-1] * (width - len(t)) for t in block_tables]

    def lt(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return StepInputs(token_ids=lt(ids), positions=lt(pos), cu_seqlens=lt(cu),
                      context_lens=lt([p + len(c) for p, c in zip(past_lens, chunks)]),
                      block_tables=lt(tables).reshape(len(chunks), width), slot_mapping=lt(slots),
                      engram_rows=engram_rows, **extra)
