"""A DeepSeek-V4 decode batch straight between the Worker's pool of cache-group pages (group_pool.py) and the batched,
static-shape decode step (model/deepseek_v4/batched_decode.py), without per-sequence ``SequenceCache`` objects:
``fill`` gathers a ``BatchedCache`` (batched_state.py) from the pages, ``decode_step`` updates it in place, and
``write_back`` scatters exactly what the step changed into the pages.

One step, B sequences each decoding one token at its position p (the tokens it has seen), with the step's
``group_tables`` (group -> [B, width] pages, -1 where none is held, as the engine's ``GroupBlockManager`` hands them):

    host   index(positions, tables)  -> PageIndex: int64 / bool index tensors, every shape fixed by (B, W, ratio,
                                        E_max); checks the state pages hold p and every row it reads or writes is held
    device fill(cache, idx)          -> cache (a ``empty(B)`` BatchedCache, fixed addresses) = gathers from the pages,
                                        every slot past the valid counts zeroed
    device decode_step(model, ...)   -> hidden [B, H]; cache updated in place
    device write_back(cache, idx)    -> the pages: the new key, the buffer slot written, and where a window closed
                                        its entry, index key and overlap slices
    host   commit(idx)               -> the pool's record of the position each sequence's state pages hold (p + 1)

``step`` does the five in order. A CUDA graph of V4 decode would capture ``fill``, ``decode_step`` and ``write_back``
(index gathers, masked ``where``, ``index_put_`` of [B]-row values: no host read, no data-dependent shape) over static
copies of the ``PageIndex`` tensors; outside it per step run ``index`` (host arithmetic on the block tables and the
host positions, then one copy of each index tensor into the graph's buffers: ``engram.transfer.to_device`` here) and
``commit``. The capture, a bucket's padding rows and the Worker's runner selection: runners/v4_graphs.py.

Where things live (block_size ``bs`` tokens a sliding page, R = ``rows_per_page`` entries a csa / hca page):

- window ring slot j (of W-1) holds position q = p - (W-1) + ((j - p) mod (W-1)), valid iff q >= 0: gathered from
  sliding page ``table[q // bs]``, row ``q % bs`` (invalid slots read page 0 and are zeroed). The step's new key
  (ring slot p % (W-1)) is written to page ``table[p // bs]``, row ``p % bs`` (``key_location``): the page the
  manager took for it at scheduling.
- entry e < p // ratio: page ``table[e // R]``, row ``e % R`` (rows ``[count, E_max)`` read page 0, zeroed). A window
  closing on this token (``closes``) writes its entry (the batched row p // ratio) at page ``table[c // R]``, row
  ``c % R`` with c = p // ratio; the CSA index keys likewise, at the same (page, row) of the ``index`` field.
- compressor buffers: the pool's field has ratio - 1 rows (a closed window leaves none), the batched one ratio slots;
  slots ``[0, p % ratio)`` gathered from the sequence's state page of that field, the rest zeroed. The step's slot
  p % ratio is written back where the window stays open; overlap slices (valid iff p // ratio >= 1) are gathered
  whole and written back where it closed.

Masked writes keep the shapes static: every ``index_put_`` writes one row per sequence, the new value where it
changed and, elsewhere, the bytes it read from the same place just before (so nothing changes there). A sequence whose
window stays open points its entry write at row 0 of its own first state page (viewed as that entry field) and a
closing one its buffer write at slot 0 of its buffer field: places no other sequence's write of that op touches, so the
[B] target rows are distinct and no two writes of one op overlap. Pages of other groups aliasing a field are written
only with the bytes read from them. Slots past the valid counts are zeroed in ``fill`` (a page's stale bytes may not
even be finite numbers in this dtype), and masked in the step as before.

Capacity: ``index`` raises ValueError, by layer and sequence, when a compressed layer's entries after the step,
(p + 1) // ratio, exceed its E_max (decode that batch eagerly or raise E_max)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engram.engine.runners.group_pool import GroupPool
from engram.model.deepseek_v4.batched_decode import decode_step, window_valid
from engram.model.deepseek_v4.batched_state import BatchedCache, layer_caps, layer_compressors
from engram.model.deepseek_v4.cache_layout import CSA_GROUP, HCA_GROUP, SLIDING_GROUP, STATE_GROUP
from engram.transfer import to_device


def closes(position: int, ratio: int) -> bool:
    """Whether the token at ``position`` closes its compressor window (host side, for the write-back targets)."""
    return (position + 1) % ratio == 0


def key_location(table: list[int], position: int, block_size: int) -> tuple[int, int]:
    """(page, row) of the key of ``position`` through one sequence's sliding table (the step's new key's target)."""
    return table[position // block_size], position % block_size


@dataclass
class GroupIndex:
    """One compressed group's (csa or hca) index tensors for a step, on the device ([B] unless said)."""

    ratio: int
    pages: torch.Tensor  # [B, E]: entry e's page (0 where e >= count)
    rows: torch.Tensor  # [B, E]: its row in the page
    count: torch.Tensor  # entries before the token, p // ratio: the batched row a closing window's entry takes
    closing: torch.Tensor  # bool: the window closes on this token
    new_page: torch.Tensor  # where the closed entry goes (open: the sequence's first state page, row 0)
    new_row: torch.Tensor
    slot: torch.Tensor  # the batched buffer slot the step wrote, p % ratio
    buf_row: torch.Tensor  # its row in the pool's buffer field (closing: 0, written with its own bytes)


@dataclass
class PageIndex:
    """What ``index`` builds on the host for one step (device tensors, shapes fixed by B, W, ratio, E_max)."""

    positions: list[int]  # host: each sequence's position p before the step
    first_state: list[int | None]  # host: each sequence's first state page (the pool's position record)
    pos: torch.Tensor  # [B] int64, p
    arange: torch.Tensor  # [B] int64, 0..B-1
    win_pages: torch.Tensor  # [B, W-1]: page of ring slot j's position (0 where invalid)
    win_rows: torch.Tensor  # [B, W-1]
    key_page: torch.Tensor  # [B]: the new key's page and row
    key_row: torch.Tensor
    key_slot: torch.Tensor  # [B]: its ring slot, p % (W-1)
    state_pages: torch.Tensor | None  # [B, state pages a sequence holds]: the state table
    groups: dict[str, GroupIndex]


class BatchedPages:
    """Moves a decode batch of a DeepseekV4Model between ``pool`` and a ``BatchedCache`` of entry capacity ``e_max``
    (one int, or one per decoder layer; sliding layers ignore theirs). The pool's layout must cover every layer."""

    def __init__(self, model, pool: GroupPool, e_max: int | Sequence[int]):
        cfg = model.config
        self.model, self.pool, self.layout = model, pool, pool.layout
        self.caps = layer_caps(model, e_max)
        sliding = self.layout.group(SLIDING_GROUP)
        if sliding is None or sliding.layers != tuple(range(cfg.num_layers)):
            raise ValueError("BatchedPages needs a pool whose layout covers every decoder layer")
        self.entry_group = {x: g for g in self.layout.groups if g.name in (CSA_GROUP, HCA_GROUP) for x in g.layers}
        self.group_cap = {g.name: max(self.caps[x] for x in g.layers) for g in self.layout.groups
                          if g.name in (CSA_GROUP, HCA_GROUP)}
        self.state = self.layout.group(STATE_GROUP)

    # ----------------------------------------------------------------- host: per step
    def index(self, positions: Sequence[int], tables: dict[str, torch.Tensor],
              seq_ids: Sequence | None = None, device: torch.device | str | None = None) -> PageIndex:
        """The step's index tensors from the host positions and group tables (module docstring), on ``device`` (None:
        the pool's; "cpu": host tensors a graph runner copies into its static index once). Raises RuntimeError where a
        sequence's state pages hold another position or a row it reads or writes has no page, ValueError where its
        entries after the step exceed a layer's E_max."""
        lay, dev = self.layout, torch.device(self.pool.device if device is None else device)
        names = list(seq_ids) if seq_ids is not None else list(range(len(positions)))
        b, bs, ring = len(positions), lay.block_size, lay.kept
        pos = torch.tensor(list(positions), dtype=torch.long)
        sliding = tables[SLIDING_GROUP].to(torch.long)
        state = tables[STATE_GROUP].to(torch.long) if self.state is not None else None
        first_state = [int(state[i, 0]) if state is not None else None for i in range(b)]
        for i, p in enumerate(positions):
            held = self.pool.held_position(first_state[i]) if first_state[i] is not None else None
            if p and state is not None and held != p:
                raise RuntimeError(f"sequence {names[i]}: the batched decode continues it at position {p} but its "
                                   f"state pages hold position {held}")
        q = pos[:, None] - ring + (torch.arange(ring)[None] - pos[:, None]) % max(ring, 1)  # [B, W-1]
        win_pages = self._lookup(sliding, q // bs, q >= 0, names, "window keys")
        keys = [key_location(sliding[i].tolist(), p, bs) for i, p in enumerate(positions)]
        if ring and any(page < 0 for page, _ in keys):
            raise RuntimeError(f"sequences {[n for n, k in zip(names, keys) if k[0] < 0]}: the new key has no "
                               f"sliding page")
        groups = {}
        for g in lay.groups:
            if g.name not in (CSA_GROUP, HCA_GROUP):
                continue
            r, per, cap = g.tokens_per_row, g.rows_per_page, self.group_cap[g.name]
            for x in g.layers:
                over = [i for i, p in enumerate(positions) if (p + 1) // r > self.caps[x]]
                if over:
                    i = over[0]
                    raise ValueError(f"layer {x}: sequence {names[i]} has {(positions[i] + 1) // r} compressed "
                                     f"entries after this step (position {positions[i]}, ratio {r}) but "
                                     f"E_max={self.caps[x]}; raise E_max or decode it eagerly")
            e = torch.arange(cap)[None].expand(b, cap)
            count = pos // r
            pages = self._lookup(tables[g.name].to(torch.long), e // per, e < count[:, None], names, g.name)
            shut = [closes(p, r) for p in positions]
            new = []
            for i, p in enumerate(positions):
                c = p // r
                if shut[i]:
                    table = tables[g.name][i].tolist()
                    page = table[c // per] if c // per < len(table) else -1
                    if page < 0:
                        raise RuntimeError(f"sequence {names[i]}: {g.name} entry {c} has no page")
                    new.append((page, c % per))
                else:
                    new.append((first_state[i] if first_state[i] is not None else 0, 0))
            slot = pos % r
            closing = torch.tensor(shut, dtype=torch.bool)
            groups[g.name] = GroupIndex(
                r, to_device(pages, dev), to_device(e % per, dev), to_device(count, dev), to_device(closing, dev),
                to_device([n[0] for n in new], dev), to_device([n[1] for n in new], dev), to_device(slot, dev),
                to_device(torch.where(closing, 0, slot), dev))
        return PageIndex(list(positions), first_state, to_device(pos, dev), to_device(torch.arange(b), dev),
                         to_device(win_pages, dev), to_device(q.clamp(min=0) % bs, dev),
                         to_device([k[0] for k in keys], dev), to_device([k[1] for k in keys], dev),
                         to_device(pos % max(ring, 1), dev), to_device(state, dev) if state is not None else None,
                         groups)

    @staticmethod
    def _lookup(table: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor, names, what: str) -> torch.Tensor:
        """Pages of ``logical`` blocks [B, N] through ``table`` [B, width] where ``valid``, 0 elsewhere; a valid block
        without a page raises."""
        width = table.shape[1]
        inside = logical.clamp(0, max(width - 1, 0))
        pages = table.gather(1, inside) if width else torch.full_like(logical, -1)
        missing = valid & ((logical >= width) | (pages < 0))
        if bool(missing.any()):
            i = int(missing.any(1).nonzero()[0])
            raise RuntimeError(f"sequence {names[i]}: its {what} reach a cache-group page it does not hold")
        return torch.where(valid, pages, 0)

    def commit(self, idx: PageIndex, count: int | None = None) -> None:
        """Host: every sequence's (the first ``count``'s: a graph bucket's real ones) state pages now hold position
        p + 1 (call after ``write_back``)."""
        for first, p in list(zip(idx.first_state, idx.positions))[:count]:
            if first is not None:
                self.pool.hold(first, p + 1)

    # ----------------------------------------------------------------- device: static shapes
    def empty(self, batch: int, device: torch.device | str | None = None) -> BatchedCache:
        """A zero ``BatchedCache`` of ``batch`` sequences (the buffers a graph would keep at fixed addresses), on the
        model's device unless given ("meta": sizes without memory)."""
        dev = self.model.model.embed.weight.device if device is None else device
        return BatchedCache.zeros(self.model, batch, self.caps, self.pool.dtype, dev)

    def _parts(self, layer: int):
        """(compressor module, its name: the BatchedLayerState attribute and state field prefix, its entry field) of
        each compressor of a layer."""
        attn = self.model.model.layers[layer].attn
        return zip(layer_compressors(attn), ("compressor", "indexer"), ("entries", "index"))

    def fill(self, cache: BatchedCache, idx: PageIndex) -> None:
        """``cache`` (an ``empty(B)``) = the pages' state of the batch at ``idx.pos`` (device only, in place)."""
        views, ring = self.pool.views, self.layout.kept
        cache.positions.copy_(idx.pos)
        for i, st in enumerate(cache.layers):
            if ring:
                keys = views[(SLIDING_GROUP, i, "keys")][idx.win_pages, idx.win_rows]  # [B, W-1, d]
                st.window.copy_(torch.where(window_valid(idx.pos, ring).unsqueeze(-1), keys, 0))
            for comp, name, part in self._parts(i):
                g, cst = self.entry_group[i], getattr(st, name)
                gi, e = self._group(idx, g.name), cst.e_max
                count = gi.count.unsqueeze(-1)
                rows = views[(g.name, i, part)][gi.pages[:, :e], gi.rows[:, :e]]  # [B, E, d]
                cst.entries.copy_(torch.where((torch.arange(e, device=rows.device) < count).unsqueeze(-1), rows, 0))
                r = comp.ratio
                cst.buffer_kv.zero_()
                cst.buffer_gate.zero_()
                if r > 1:
                    held = (torch.arange(r - 1, device=rows.device) < gi.slot.unsqueeze(-1)).unsqueeze(-1)
                    for f in ("buffer_kv", "buffer_gate"):
                        got = views[(STATE_GROUP, i, f"{name}.{f}")][self._state_col(idx, i, f"{name}.{f}")]
                        getattr(cst, f)[:, :r - 1].copy_(torch.where(held, got, 0))
                if comp.overlap:
                    has = (gi.count >= 1).view(-1, 1, 1)
                    for f in ("overlap_kv", "overlap_gate"):
                        got = views[(STATE_GROUP, i, f"{name}.{f}")][self._state_col(idx, i, f"{name}.{f}")]
                        getattr(cst, f).copy_(torch.where(has, got, 0))

    def write_back(self, cache: BatchedCache, idx: PageIndex) -> None:
        """Into the pages what ``decode_step`` changed in ``cache`` (module docstring; device only)."""
        views, ring, ar = self.pool.views, self.layout.kept, idx.arange
        for i, st in enumerate(cache.layers):
            if ring:
                _put(views[(SLIDING_GROUP, i, "keys")], (idx.key_page, idx.key_row), st.window[ar, idx.key_slot], None)
            for comp, name, part in self._parts(i):
                g, cst = self.entry_group[i], getattr(st, name)
                gi = self._group(idx, g.name)
                entry = cst.entries[ar, gi.count.clamp(max=cst.e_max - 1)]
                _put(views[(g.name, i, part)], (gi.new_page, gi.new_row), entry, gi.closing)
                if comp.ratio > 1:
                    for f in ("buffer_kv", "buffer_gate"):
                        target = (self._state_col(idx, i, f"{name}.{f}"), gi.buf_row)
                        _put(views[(STATE_GROUP, i, f"{name}.{f}")], target, getattr(cst, f)[ar, gi.slot], ~gi.closing)
                if comp.overlap:
                    for f in ("overlap_kv", "overlap_gate"):
                        target = (self._state_col(idx, i, f"{name}.{f}"),)
                        _put(views[(STATE_GROUP, i, f"{name}.{f}")], target, getattr(cst, f), gi.closing)

    def _state_col(self, idx: PageIndex, layer: int, part: str) -> torch.Tensor:
        return idx.state_pages[:, self.state.field(layer, part).page]

    @staticmethod
    def _group(idx: PageIndex, name: str) -> GroupIndex:
        return idx.groups[name]

    # ----------------------------------------------------------------- the whole step
    def step(self, token_ids: torch.Tensor, positions: Sequence[int], tables: dict[str, torch.Tensor],
             engram_rows=None, dead_mask: torch.Tensor | None = None, ropes=None,
             cache: BatchedCache | None = None) -> torch.Tensor:
        """One decode token per sequence, pages to pages: ``index``, ``fill``, ``decode_step``, ``write_back``,
        ``commit``; returns the final-normed hidden [B, H]. On an exception before ``write_back`` the pages are
        unchanged (``fill`` only reads them)."""
        idx = self.index(positions, tables)
        cache = cache if cache is not None else self.empty(len(positions))
        self.fill(cache, idx)
        hidden = decode_step(self.model, token_ids, cache, engram_rows, dead_mask, ropes)
        self.write_back(cache, idx)
        self.commit(idx)
        return hidden


def _put(view: torch.Tensor, target: tuple, value: torch.Tensor, where: torch.Tensor | None) -> None:
    """``view[target] = value`` (one row per sequence) where ``where`` [B] (None: all), else the bytes read there."""
    if where is not None:
        old = view[target]
        value = torch.where(where.view(-1, *[1] * (old.dim() - 1)), value.to(old.dtype), old)
    view.index_put_(target, value.to(view.dtype))
