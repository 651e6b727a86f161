"""Where a DeepSeek-V4 sequence's caches live in one pool of equal pages: the cache groups of a set of layers (all of
them on one device, a pipeline stage's own on that stage; ``parallel/pp.py`` reads the same groups), each page's field
offsets, and how many pages a sequence holds at a position. Pure arithmetic on the config: the engine's block manager
allocates by it (engine/cache_groups.py) and the Worker's pool reads and writes by it (engine/runners/group_pool.py).

Groups (a group is a set of layers sharing one block table; a page is ``page_bytes`` whatever the group):

* ``sliding``: every layer's window keys, ``block_size`` tokens a page (page_bytes = block_size x layers x head_dim x
  element size: the split rule starts here); a page is freed once all its tokens left the window.
* ``csa``: compressed sparse layers' entries and index keys (one entry per ``csa_ratio`` tokens), as many entries a page
  as fit; kept while the sequence runs (a top-k may pick any entry).
* ``hca``: heavily compressed layers' entries (one per ``hca_ratio`` tokens), as many as fit; kept while it runs.
* ``state``: a fixed run of pages per sequence: each compressor's unclosed kv / gate buffer (ratio - 1 rows) and,
  with overlap, the last closed window's first halves (ratio rows). A field never straddles two pages."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engram.model.deepseek_v4.config import CSA, HCA, V4Config
from engram.model.deepseek_v4.mhc import work_dtype

SLIDING_GROUP, CSA_GROUP, HCA_GROUP, STATE_GROUP = "sliding", "csa", "hca", "state"
ALIGN = 8  # field offsets are multiples of the widest element (float64)


@dataclass(frozen=True)
class Field:
    """One tensor of a page (row groups: ``shape[0]`` rows a page) or of a sequence's state pages."""

    layer: int  # decoder layer
    part: str  # "keys" | "entries" | "index" | "<comp>.buffer_kv" | ... (comp: "compressor" or "indexer")
    page: int  # which of the sequence's state pages holds it (row groups: 0, every page has every field)
    offset: int  # byte offset inside the page, a multiple of ALIGN
    shape: tuple[int, ...]  # rows first
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class CacheGroup:
    name: str  # one of SLIDING_GROUP, CSA_GROUP, HCA_GROUP, STATE_GROUP
    layers: tuple[int, ...]  # the decoder layers whose caches it holds
    rows_per_page: int  # tokens (sliding) or entries (csa, hca) a page holds; 0 for state
    tokens_per_row: int  # 1 (sliding), the compress ratio (csa, hca), 0 (state)
    pages_per_sequence: int  # state: pages every running sequence holds; 0 for the row groups
    fields: tuple[Field, ...]

    def field(self, layer: int, part: str) -> Field:
        for f in self.fields:
            if f.layer == layer and f.part == part:
                return f
        raise KeyError(f"cache group {self.name!r} has no field {part!r} of layer {layer}")


@dataclass(frozen=True)
class CacheLayout:
    page_bytes: int  # every group's page
    block_size: int  # tokens per sliding page (EngineConfig.block_size)
    window: int  # sliding_window: a query sees itself and the window - 1 keys before it
    groups: tuple[CacheGroup, ...]  # the groups of these layers, in the order above; groups without layers omitted

    def group(self, name: str) -> CacheGroup | None:
        return next((g for g in self.groups if g.name == name), None)

    @property
    def kept(self) -> int:
        """Window keys a sequence keeps after its last token: window - 1."""
        return self.window - 1

    def window_range(self, position: int) -> tuple[int, int]:
        """Positions [lo, hi) whose keys a sequence at ``position`` keeps (what its next token reads)."""
        return max(0, position - self.kept), position

    def rows_for(self, group: CacheGroup, position: int) -> int:
        """Rows (entries) of a csa / hca group a sequence holds after ``position`` tokens."""
        return position // group.tokens_per_row

    def max_blocks_per_sequence(self, max_model_len: int) -> int:
        """An upper bound of the pages one sequence of ``max_model_len`` tokens holds at once: the state pages, the
        entry pages of its last position, and the sliding pages of three windows (async scheduling keeps the window
        of the step in flight, of the step being scheduled and of the collected one)."""
        n = 0
        for g in self.groups:
            if g.name == STATE_GROUP:
                n += g.pages_per_sequence
            elif g.name == SLIDING_GROUP:
                n += 3 * (-(-self.kept // self.block_size) + 1)
            else:
                n += -(-self.rows_for(g, max_model_len) // g.rows_per_page)
        return n


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _row_group(name: str, layers: list[int], parts: list[tuple[str, int]], dtype: torch.dtype, ratio: int,
               page_bytes: int, what: str, rows: int | None = None) -> CacheGroup:
    """A group whose pages hold ``rows`` rows (default: as many as fit) of every (layer, part) of width ``parts``,
    field after field, each field's start aligned."""
    def size(n: int) -> int:
        return sum(_align(n * w * _elt(dtype)) for _ in layers for _, w in parts)

    if rows is None:
        rows = page_bytes // sum(w * _elt(dtype) for _ in layers for _, w in parts)
        while rows > 0 and size(rows) > page_bytes:
            rows -= 1
    if rows < 1:
        raise ValueError(f"engine.block_size is too small for DeepSeek-V4's {what}: a page of {page_bytes} bytes holds "
                         f"no entry of {size(1)} bytes; raise block_size")
    fields, at = [], 0
    for layer in layers:
        for part, width in parts:
            f = Field(layer, part, 0, at, (rows, width), dtype)
            fields.append(f)
            at = _align(at + f.nbytes)
    return CacheGroup(name, tuple(layers), rows, ratio, 0, tuple(fields))


def _state_group(cfg: V4Config, layers: list[int], dtype: torch.dtype, page_bytes: int) -> CacheGroup:
    """First-fit of every compressor's buffers into pages (a field never straddles two)."""
    wd = work_dtype(dtype)
    wanted = []
    for layer in layers:
        r = cfg.ratio(layer)
        comps = [("compressor", cfg.head_dim, cfg.layer_types[layer] == CSA)]
        if cfg.layer_types[layer] == CSA:
            comps.append(("indexer", cfg.index_head_dim, True))
        for comp, d, overlap in comps:
            width = (2 if overlap else 1) * d
            if r > 1:
                wanted += [(layer, f"{comp}.buffer_kv", (r - 1, width), dtype),
                           (layer, f"{comp}.buffer_gate", (r - 1, width), wd)]
            if overlap:
                wanted += [(layer, f"{comp}.overlap_kv", (r, d), dtype), (layer, f"{comp}.overlap_gate", (r, d), wd)]
    fields, used = [], []  # bytes used of each state page
    for layer, part, shape, dt in wanted:
        f = Field(layer, part, 0, 0, shape, dt)
        if f.nbytes > page_bytes:
            raise ValueError(f"engine.block_size is too small for DeepSeek-V4's compressor state: layer {layer}'s "
                             f"{part} takes {f.nbytes} bytes but a page holds {page_bytes}; raise block_size")
        page = next((i for i, u in enumerate(used) if _align(u) + f.nbytes <= page_bytes), None)
        if page is None:
            used.append(0)
            page = len(used) - 1
        at = _align(used[page])
        fields.append(Field(layer, part, page, at, shape, dt))
        used[page] = at + f.nbytes
    return CacheGroup(STATE_GROUP, tuple(layers), 0, 0, len(used), tuple(fields))


def cache_layout(cfg: V4Config, dtype: torch.dtype, block_size: int,
                 layers: Sequence[int] | None = None) -> CacheLayout:
    """The cache groups of ``layers`` (default: every layer) for caches of ``dtype`` and sliding pages of
    ``block_size`` tokens. ValueError when a page cannot hold one entry or one state field."""
    layers = sorted(range(cfg.num_layers) if layers is None else set(layers))
    bad = [x for x in layers if not 0 <= x < cfg.num_layers]
    if bad or not layers:
        raise ValueError(f"layers={list(layers)}: need decoder layers in [0, {cfg.num_layers})")
    if block_size < 1:
        raise ValueError(f"engine.block_size={block_size}: must be >= 1")
    d, di = cfg.head_dim, cfg.index_head_dim
    page_bytes = len(layers) * _align(block_size * d * _elt(dtype))  # the split rule: one sliding page
    groups = [_row_group(SLIDING_GROUP, layers, [("keys", d)], dtype, 1, page_bytes, "sliding window", block_size)]
    csa = [x for x in layers if cfg.layer_types[x] == CSA]
    hca = [x for x in layers if cfg.layer_types[x] == HCA]
    if csa:
        groups.append(_row_group(CSA_GROUP, csa, [("entries", d), ("index", di)], dtype, cfg.csa_ratio, page_bytes,
                                 "compressed sparse entries"))
    if hca:
        groups.append(_row_group(HCA_GROUP, hca, [("entries", d)], dtype, cfg.hca_ratio, page_bytes,
                                 "heavily compressed entries"))
    state = _state_group(cfg, sorted(csa + hca), dtype, page_bytes)
    if state.fields:  # none without compressed layers (or with ratio-1, non-overlapping ones only)
        groups.append(state)
    return CacheLayout(page_bytes, block_size, cfg.sliding_window, tuple(groups))
