"""The Worker's pool of cache-group pages (DeepSeek-V4): one uint8 tensor [num_blocks, page_bytes] on the device, with a
typed view per field of ``CacheLayout`` (cache_layout.py), and the two moves of a step. ``gather`` builds each packed
sequence's ``SequenceCache`` at its start position from the step's group tables (window keys, entries and index keys,
compressor buffers and overlaps); ``write`` stores what the step added (the window keys it keeps, new entries, the new
buffers). The pool remembers on the host the position each run of state pages holds (no device read) and a read checks
it, so a page of another sequence, or a state a failed step did not commit, raises instead of being read.

    pool [num_blocks, page_bytes] uint8 ──view──► sliding keys[l] [num_blocks, block_size, d]
                                                  csa entries[l] [num_blocks, R, d], index[l] [num_blocks, R, di]
                                                  hca entries[l] [num_blocks, R', d]
                                                  state fields  [num_blocks, *shape]
    token p of a sequence: page table[p // block_size], row p % block_size; entry e: page e // R, row e % R;
    a state field: the sequence's k-th state page"""
from __future__ import annotations

import torch

from engram.engine.step import StepDescription
from engram.model.deepseek_v4.attention import LayerState
from engram.model.deepseek_v4.cache import SequenceCache
from engram.model.deepseek_v4.cache_layout import (CSA_GROUP, HCA_GROUP, SLIDING_GROUP, STATE_GROUP, CacheGroup,
                                                     CacheLayout, Field)
from engram.model.deepseek_v4.compressor import CompressorState
from engram.model.deepseek_v4.config import CSA, SLIDING, V4Config
from engram.model.deepseek_v4.mhc import work_dtype


class GroupPool:
    def __init__(self, cfg: V4Config, layout: CacheLayout, num_blocks: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, torch.device(device)
        self.pages = torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8, device=self.device)
        self.views = {(g.name, f.layer, f.part): self._view(f) for g in layout.groups for f in g.fields}
        self._entry_group = {x: g for g in layout.groups if g.name in (CSA_GROUP, HCA_GROUP) for x in g.layers}
        self._held: dict[int, int] = {}  # first state page -> the position its run of state pages holds

    def _view(self, f: Field) -> torch.Tensor:
        """[num_blocks, *f.shape] of f.dtype over the pool's bytes (writes through)."""
        return self.pages[:, f.offset:f.offset + f.nbytes].view(f.dtype).view(-1, *f.shape)

    @property
    def nbytes(self) -> int:
        return self.pages.numel()

    def held_position(self, first_state_page: int) -> int | None:
        """The position the run of state pages starting at ``first_state_page`` holds (None: never written)."""
        return self._held.get(first_state_page)

    def hold(self, first_state_page: int, position: int) -> None:
        """Record that a committed step left that run of state pages at ``position`` (what ``write`` does on the host;
        for writers other than ``write``, e.g. the batched decode's, runners/v4_batched_pages.py)."""
        self._held[first_state_page] = position

    # ----------------------------------------------------------------- reading
    def gather(self, step: StepDescription, empty) -> list[SequenceCache]:
        """Each packed sequence's cache at its start position (``empty()``: a fresh one, for position 0)."""
        tables = step.group_tables
        out = []
        for i, start in enumerate(step.start_positions):
            if start == 0:
                out.append(empty())
                continue
            self._check_position(tables, i, start, step)
            layers = []
            win = self._rows(tables[SLIDING_GROUP][i], *self.layout.window_range(start), self.layout.block_size,
                             f"step {step.step_id} sequence {step.seq_ids[i]}")
            for layer in range(self.cfg.num_layers):
                window = self.views[(SLIDING_GROUP, layer, "keys")][win]  # [w, d]
                comp = index = None
                if self.cfg.layer_types[layer] != SLIDING:
                    g = self._entry_group[layer]
                    rows = self._rows(tables[g.name][i], 0, self.layout.rows_for(g, start), g.rows_per_page,
                                      f"step {step.step_id} sequence {step.seq_ids[i]} layer {layer}")
                    state = tables[STATE_GROUP][i] if STATE_GROUP in tables else None
                    comp = self._compressor(g, layer, "compressor", "entries", rows, state, start)
                    if self.cfg.layer_types[layer] == CSA:
                        index = self._compressor(g, layer, "indexer", "index", rows, state, start)
                layers.append(LayerState(window, comp, index))
            out.append(SequenceCache(start, tuple(layers)))
        return out

    def _rows(self, table: torch.Tensor, lo: int, hi: int, per_page: int,
              who: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, rows) of logical rows [lo, hi) through one sequence's table; a missing page raises."""
        idx = torch.arange(lo, hi)
        logical = idx // per_page
        if hi > lo and (int(logical[-1]) >= table.shape[0] or bool((table[logical] < 0).any())):
            raise RuntimeError(f"{who}: rows [{lo}, {hi}) reach a cache-group page it does not hold")
        return table[logical].to(self.device), (idx % per_page).to(self.device)

    def _check_position(self, tables: dict, i: int, start: int, step: StepDescription) -> None:
        if STATE_GROUP not in tables:
            return
        held = self._held.get(int(tables[STATE_GROUP][i, 0]))
        if held != start:
            raise RuntimeError(f"sequence {step.seq_ids[i]}: step {step.step_id} continues it at position {start} but "
                               f"its state pages hold position {held}")

    def _state(self, state_table: torch.Tensor, layer: int, part: str) -> torch.Tensor:
        f = self.layout.group(STATE_GROUP).field(layer, part)
        return self.views[(STATE_GROUP, layer, part)][int(state_table[f.page])]

    def _compressor(self, g: CacheGroup, layer: int, comp: str, part: str, rows, state_table: torch.Tensor,
                    start: int) -> CompressorState:
        r = g.tokens_per_row
        u = start % r
        entries = self.views[(g.name, layer, part)][rows]  # [E, d]
        if r > 1:
            buffer_kv = self._state(state_table, layer, f"{comp}.buffer_kv")[:u]
            buffer_gate = self._state(state_table, layer, f"{comp}.buffer_gate")[:u]
        else:  # ratio 1: every token closes its window, nothing is ever buffered
            d = self.cfg.head_dim if comp == "compressor" else self.cfg.index_head_dim
            width = (2 if g.name == CSA_GROUP else 1) * d
            buffer_kv = entries.new_zeros(0, width)
            buffer_gate = torch.zeros(0, width, dtype=work_dtype(self.dtype), device=self.device)
        overlap_kv = overlap_gate = None
        if g.name == CSA_GROUP and start >= r:  # overlap: the first halves of the last closed window
            overlap_kv = self._state(state_table, layer, f"{comp}.overlap_kv").clone()
            overlap_gate = self._state(state_table, layer, f"{comp}.overlap_gate").clone()
        return CompressorState(buffer_kv.clone(), buffer_gate.clone(), entries, overlap_kv, overlap_gate)

    # ----------------------------------------------------------------- writing
    def write(self, step: StepDescription, after: list[SequenceCache]) -> None:
        """Store what the step added to each sequence (call only after its forward succeeded)."""
        tables = step.group_tables
        for i, (start, n, cache) in enumerate(zip(step.start_positions, step.num_new_tokens, after)):
            end = start + n
            lo = max(start, self.layout.window_range(end)[0])  # the new keys it keeps
            who = f"step {step.step_id} sequence {step.seq_ids[i]}"
            win = self._rows(tables[SLIDING_GROUP][i], lo, end, self.layout.block_size, who)
            for layer, st in enumerate(cache.layers):
                self.views[(SLIDING_GROUP, layer, "keys")][win] = st.window[st.window.shape[0] - (end - lo):]
                if st.compressor is None:
                    continue
                g = self._entry_group[layer]
                e0, e1 = self.layout.rows_for(g, start), self.layout.rows_for(g, end)
                rows = self._rows(tables[g.name][i], e0, e1, g.rows_per_page, f"{who} layer {layer}")
                state = tables[STATE_GROUP][i] if STATE_GROUP in tables else None
                self._write_compressor(g, layer, "compressor", "entries", rows, e0, e1, st.compressor, state)
                if st.indexer is not None:
                    self._write_compressor(g, layer, "indexer", "index", rows, e0, e1, st.indexer, state)
            if STATE_GROUP in tables:
                self._held[int(tables[STATE_GROUP][i, 0])] = end

    def _write_compressor(self, g: CacheGroup, layer: int, comp: str, part: str, rows, e0: int, e1: int,
                          cs: CompressorState, state_table: torch.Tensor) -> None:
        self.views[(g.name, layer, part)][rows] = cs.entries[e0:e1]
        u = cs.buffer_kv.shape[0]
        if g.tokens_per_row > 1 and u:
            self._state(state_table, layer, f"{comp}.buffer_kv")[:u] = cs.buffer_kv
            self._state(state_table, layer, f"{comp}.buffer_gate")[:u] = cs.buffer_gate
        if cs.overlap_kv is not None:
            self._state(state_table, layer, f"{comp}.overlap_kv")[:] = cs.overlap_kv
            self._state(state_table, layer, f"{comp}.overlap_gate")[:] = cs.overlap_gate
