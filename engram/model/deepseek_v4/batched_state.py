"""The DeepSeek-V4 decode state of B sequences as dense, static-shape tensors (what a CUDA graph of the decode step
reads and updates in place), and its conversion from / to the per-sequence ``SequenceCache`` of the eager path.

Every shape is fixed by (B, W, ratio, E_max): nothing grows. The per-sequence counts are not stored: they follow from
the one ``positions`` [B] tensor (the tokens each sequence has seen) exactly as the eager state's invariant
``entries * ratio + len(buffer) == position`` says:

- window: a ring ``[B, W-1, d]``: the key of position q lives in slot ``q % (W-1)``; slot j is valid iff
  ``j < min(position, W-1)`` (the last ``min(position, W-1)`` keys);
- compressor (and the indexer's): buffer fill ``position % ratio`` (slots ``[0, fill)`` hold the unclosed window's
  tokens in order), entry count ``position // ratio`` (rows ``[0, count)`` of ``entries`` are valid); the overlap
  slices are valid iff count >= 1.

Slots past the valid counts hold anything (stale values of earlier windows, zeros, garbage): every reader masks them.
``BatchedCache.from_caches`` copies (the caches passed in are not changed); ``to_caches`` returns fresh tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engram.model.deepseek_v4.attention import LayerState
from engram.model.deepseek_v4.cache import SequenceCache
from engram.model.deepseek_v4.compressor import Compressor, CompressorState
from engram.model.deepseek_v4.config import CSA, HCA
from engram.model.deepseek_v4.mhc import work_dtype


def layer_caps(model, e_max: int | Sequence[int]) -> list[int]:
    """Entry capacity per decoder layer from one int for all or one per layer (sliding layers ignore theirs)."""
    n = model.config.num_layers
    caps = [e_max] * n if isinstance(e_max, int) else list(e_max)
    if len(caps) != n:
        raise ValueError(f"e_max lists {len(caps)} layers, the model has {n}")
    return caps


def layer_compressors(attn) -> list[Compressor]:
    """A layer's compressors: CSA the attention's and its indexer's, HCA the attention's, sliding none."""
    if attn.kind == CSA:
        return [attn.compressor, attn.indexer.compressor]
    return [attn.compressor] if attn.kind == HCA else []


@dataclass
class BatchedCompressorState:
    """One compressor's state over the batch (c = 2 with overlap, else 1; d the compressor's head dim)."""

    buffer_kv: torch.Tensor  # [B, ratio, c*d] model dtype: slot j = token count*ratio + j of the unclosed window
    buffer_gate: torch.Tensor  # [B, ratio, c*d] work dtype, without ape (added when the window closes)
    entries: torch.Tensor  # [B, E_max, d] model dtype, RoPE'd; rows [0, position // ratio) valid
    overlap_kv: torch.Tensor | None  # [B, ratio, d] overlap only: first halves of the last closed window
    overlap_gate: torch.Tensor | None  # [B, ratio, d] work dtype, ape included

    @classmethod
    def zeros(cls, comp: Compressor, batch: int, e_max: int, dtype: torch.dtype,
              device: torch.device | str) -> "BatchedCompressorState":
        """The zero state of ``comp`` for ``batch`` sequences (kv and entries in ``dtype``, gates in its work dtype)."""
        r, d, width, wd = comp.ratio, comp.head_dim, comp.wkv.out_features, work_dtype(dtype)
        return cls(torch.zeros(batch, r, width, dtype=dtype, device=device),
                   torch.zeros(batch, r, width, dtype=wd, device=device),
                   torch.zeros(batch, e_max, d, dtype=dtype, device=device),
                   torch.zeros(batch, r, d, dtype=dtype, device=device) if comp.overlap else None,
                   torch.zeros(batch, r, d, dtype=wd, device=device) if comp.overlap else None)

    @property
    def e_max(self) -> int:
        return self.entries.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.buffer_kv, self.buffer_gate, self.entries, self.overlap_kv, self.overlap_gate)
                if t is not None]


@dataclass
class BatchedLayerState:
    """One layer's state over the batch: the window ring and, in compressed layers, the compressors."""

    window: torch.Tensor  # [B, W-1, d] ring: position q at slot q % (W-1)
    compressor: BatchedCompressorState | None  # CSA / HCA layers
    indexer: BatchedCompressorState | None  # CSA layers: the indexer's keys

    def tensors(self) -> list[torch.Tensor]:
        return [self.window] + [t for s in (self.compressor, self.indexer) if s is not None for t in s.tensors()]


@dataclass
class BatchedCache:
    """The decode state of B sequences: ``positions`` [B] int64 (each sequence's next token's position) and one
    ``BatchedLayerState`` per decoder layer. The batched decode step updates all of it in place."""

    positions: torch.Tensor
    layers: tuple[BatchedLayerState, ...]

    @classmethod
    def zeros(cls, model, batch: int, e_max: int | Sequence[int], dtype: torch.dtype,
              device: torch.device | str) -> "BatchedCache":
        """The zero state of ``batch`` sequences of a DeepseekV4Model (``e_max`` as ``layer_caps`` takes it): the
        buffers a decode graph keeps at fixed addresses ("meta": their sizes without memory)."""
        caps, layers = layer_caps(model, e_max), []
        for i, block in enumerate(model.model.layers):
            attn = block.attn
            window = torch.zeros(batch, attn.window - 1, attn.head_dim, dtype=dtype, device=device)
            comps = [BatchedCompressorState.zeros(c, batch, caps[i], dtype, device) for c in layer_compressors(attn)]
            comps += [None] * (2 - len(comps))
            layers.append(BatchedLayerState(window, comps[0], comps[1]))
        return cls(torch.zeros(batch, dtype=torch.long, device=device), tuple(layers))

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    def head(self, b: int) -> "BatchedCache":
        """The first ``b`` sequences' state as views (in-place updates write through): a smaller bucket of a decode
        graph over the same buffers."""
        def cut(st):
            return None if st is None else BatchedCompressorState(*(None if t is None else t[:b] for t in (
                st.buffer_kv, st.buffer_gate, st.entries, st.overlap_kv, st.overlap_gate)))
        return BatchedCache(self.positions[:b], tuple(BatchedLayerState(x.window[:b], cut(x.compressor),
                                                                        cut(x.indexer)) for x in self.layers))

    @classmethod
    def from_caches(cls, model, caches: Sequence[SequenceCache], e_max: int | Sequence[int]) -> "BatchedCache":
        """Dense copies of per-sequence caches (``model``: the DeepseekV4Model they belong to). ``e_max``: entry
        capacity per compressed layer (one int for all, or one per layer; sliding layers ignore theirs). Raises
        ValueError naming the layer and the sequence when a sequence's entries exceed its layer's E_max, or when a
        cache breaks the state's invariants. Host-side: reads every cache's shapes."""
        w = model.model.embed.weight
        dtype, device, n = w.dtype, w.device, len(caches)
        caps = layer_caps(model, e_max)
        positions = [c.position for c in caches]
        layers = []
        for i, block in enumerate(model.model.layers):
            attn, states = block.attn, [c.layers[i] for c in caches]
            ring = attn.window - 1
            window = torch.zeros(n, ring, attn.head_dim, dtype=dtype, device=device)
            for b, (st, pos) in enumerate(zip(states, positions)):
                keep = min(pos, ring)
                if st.window.shape[0] != keep:
                    raise ValueError(f"layer {i}, sequence {b}: window holds {st.window.shape[0]} keys, position {pos} "
                                     f"needs {keep}")
                if keep:
                    slots = torch.arange(pos - keep, pos, device=device) % ring
                    window[b, slots] = st.window.to(dtype)
            comp = index = None
            if attn.kind in (CSA, HCA):
                comp = _compressor_from(attn.compressor, [s.compressor for s in states], positions, caps[i], i,
                                        "compressor", dtype, device)
            if attn.kind == CSA:
                index = _compressor_from(attn.indexer.compressor, [s.indexer for s in states], positions, caps[i], i,
                                         "indexer", dtype, device)
            layers.append(BatchedLayerState(window, comp, index))
        return cls(torch.tensor(positions, dtype=torch.long, device=device), tuple(layers))

    def to_caches(self, model) -> list[SequenceCache]:
        """The per-sequence caches this state holds (fresh tensors; host-side: reads ``positions``)."""
        positions = self.positions.tolist()
        per_seq: list[list[LayerState]] = [[] for _ in positions]
        for i, (block, st) in enumerate(zip(model.model.layers, self.layers)):
            attn = block.attn
            ring = attn.window - 1
            for b, pos in enumerate(positions):
                keep = min(pos, ring)
                slots = torch.arange(pos - keep, pos, device=st.window.device) % max(ring, 1)
                window = st.window[b, slots].clone()
                comp = index = None
                if st.compressor is not None:
                    comp = _compressor_to(attn.compressor, st.compressor, b, pos, i)
                if st.indexer is not None:
                    index = _compressor_to(attn.indexer.compressor, st.indexer, b, pos, i)
                per_seq[b].append(LayerState(window, comp, index))
        return [SequenceCache(pos, tuple(layers)) for pos, layers in zip(positions, per_seq)]


def _compressor_from(comp: Compressor, states: list[CompressorState], positions: list[int], e_max: int,
                     layer: int, what: str, dtype: torch.dtype, device: torch.device) -> BatchedCompressorState:
    r, wd = comp.ratio, work_dtype(dtype)
    out = BatchedCompressorState.zeros(comp, len(states), e_max, dtype, device)
    for b, (st, pos) in enumerate(zip(states, positions)):
        count, fill = st.num_entries, st.buffer_kv.shape[0]
        if count > e_max:
            raise ValueError(f"layer {layer} ({what}): sequence {b} has {count} compressed entries (position {pos}, "
                             f"ratio {r}) but E_max={e_max}; raise E_max or decode it eagerly")
        if count * r + fill != pos or fill >= r:
            raise ValueError(f"layer {layer} ({what}), sequence {b}: {count} entries and {fill} buffered tokens do not "
                             f"make position {pos} at ratio {r}")
        out.buffer_kv[b, :fill] = st.buffer_kv.to(dtype)
        out.buffer_gate[b, :fill] = st.buffer_gate.to(wd)
        out.entries[b, :count] = st.entries.to(dtype)
        if comp.overlap and st.overlap_kv is not None:
            out.overlap_kv[b] = st.overlap_kv.to(dtype)
            out.overlap_gate[b] = st.overlap_gate.to(wd)
    return out


def _compressor_to(comp: Compressor, st: BatchedCompressorState, b: int, pos: int, layer: int) -> CompressorState:
    r = comp.ratio
    count, fill = pos // r, pos % r
    if count > st.e_max:
        raise ValueError(f"layer {layer}: sequence {b} at position {pos} has {count} compressed entries at ratio {r} "
                         f"but E_max={st.e_max}: the decode step dropped the entries past E_max")
    overlap = comp.overlap and count > 0
    return CompressorState(st.buffer_kv[b, :fill].clone(), st.buffer_gate[b, :fill].clone(),
                           st.entries[b, :count].clone(), st.overlap_kv[b].clone() if overlap else None,
                           st.overlap_gate[b].clone() if overlap else None)
