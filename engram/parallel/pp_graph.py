"""Cross-layer sharing graph of a decoder, read from its HF-style config before anything is allocated.
``sharing_graph(config)`` gives the edges a pipeline cut must not separate: ``kv`` and ``index`` (a layer reads the
nearest earlier source's cache / top-k selection), ``index_k`` (an index source that is not a KV source reads its KV
source) and ``candidate`` (index sources after the candidate source read its blocks). Engram layers are inputs, not
edges. Bad fields (``sharing_fields``, shared with ModelConfig) raise ValueError naming field and value."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from engram.config import hf_text_config
from engram.model.sharing_fields import (compress_ratios, field_error, is_int, num_hidden_layers,
                                            source_layer_ids)

EDGE_KINDS = ("kv", "index", "index_k", "candidate")  # display and sort order of edge kinds


@dataclass(frozen=True)
class SharingEdge:
    """``consumer`` reads state that ``source`` produced in the same step; both must sit on one stage."""

    kind: str  # one of EDGE_KINDS
    source: int  # 0-indexed decoder layer that produces the state
    consumer: int  # later layer that reads it (source < consumer)

    def sort_key(self) -> tuple[int, int, int]:
        return (self.source, self.consumer, EDGE_KINDS.index(self.kind))

    def crosses(self, position: int) -> bool:
        """True when a cut before layer ``position`` separates source and consumer."""
        return self.source < position <= self.consumer


@dataclass(frozen=True)
class SharingGraph:
    """Everything a pipeline planner needs to know about one decoder's layers."""

    num_layers: int  # num_hidden_layers
    compress_ratios: tuple[int, ...] | None  # per layer (MTP extras dropped); None = our decoder (no V4.1 fields)
    kv_sources: tuple[int, ...] | None  # kv_source_layer_ids; None = every layer owns its KV
    index_sources: tuple[int, ...] | None  # index_source_layer_ids; None = no index sharing
    candidate_source: int  # candidate_source_layer_id, -1 = none
    candidate_topk_blocks: int  # candidate_topk_blocks, 0 = no candidate sharing
    engram_layers: tuple[int, ...]  # engram_layer_ids: need token ids + lookbacks as stage inputs
    edges: tuple[SharingEdge, ...] = field(default=())  # sorted by (source, consumer, kind)

    @property
    def v41(self) -> bool:
        """True when the config carries DeepSeek-V4.1 attention fields (compress_ratios)."""
        return self.compress_ratios is not None

    def is_compressed(self, layer: int) -> bool:
        """Layers that take part in KV/index sharing: ratio != 0 in V4.1, every layer in our decoder."""
        return self.compress_ratios is None or self.compress_ratios[layer] != 0

    def edges_by_kind(self) -> dict[str, list[SharingEdge]]:
        out: dict[str, list[SharingEdge]] = {k: [] for k in EDGE_KINDS}
        for e in self.edges:
            out[e.kind].append(e)
        return out

    def consumers(self, kind: str) -> set[int]:
        """Layers that read another layer's state of this kind."""
        return {e.consumer for e in self.edges if e.kind == kind}

    def kv_source_of(self, layer: int) -> int:
        """The layer whose KV cache ``layer`` reads (itself when it owns one)."""
        for e in self.edges:
            if e.kind == "kv" and e.consumer == layer:
                return e.source
        return layer

    def legal_cut_points(self) -> list[int]:
        """Positions p in 1..num_layers-1 (cut before layer p) that no edge crosses."""
        blocked = [False] * (self.num_layers + 1)
        for e in self.edges:
            for p in range(e.source + 1, e.consumer + 1):
                blocked[p] = True
        return [p for p in range(1, self.num_layers) if not blocked[p]]


# --------------------------------------------------------------------------------------------- reading
def _engram_layers(hf: dict[str, Any], n: int) -> tuple[int, ...]:
    ids = hf.get("engram_layer_ids")
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or not all(is_int(x) for x in ids):
        raise field_error("engram_layer_ids", ids, "must be a list of ints")
    for x in ids:
        if not 0 <= x < n:
            raise field_error("engram_layer_ids", ids, f"layer {x} is out of range [0, {n}) (num_hidden_layers={n})")
    return tuple(sorted(set(ids)))


def _nearest_edges(kind: str, sources: tuple[int, ...], n: int, ratios: tuple[int, ...] | None) -> list[SharingEdge]:
    """Each participating layer reads the nearest source at or before it (no edge to itself)."""
    edges, current = [], None
    src = set(sources)
    for layer in range(n):
        if ratios is not None and ratios[layer] == 0:
            continue
        if layer in src:
            current = layer
        else:
            edges.append(SharingEdge(kind, current, layer))
    return edges


def sharing_graph(config: str | os.PathLike | dict) -> SharingGraph:
    """Build and validate the sharing graph of a config (see the module docstring for the edge kinds)."""
    hf = hf_text_config(config)
    n = num_hidden_layers(hf)
    ratios = compress_ratios(hf, n)
    kv = source_layer_ids(hf.get("kv_source_layer_ids"), "kv_source_layer_ids", "kv", n, ratios)
    index = source_layer_ids(hf.get("index_source_layer_ids"), "index_source_layer_ids", "index", n, ratios)
    if kv is not None and index is not None:
        missing = [x for x in kv if x not in index]
        if missing:
            raise field_error("kv_source_layer_ids", list(kv),
                              f"kv source layer {missing[0]} is not an index source "
                              f"(index_source_layer_ids={list(index)})")

    cand = hf.get("candidate_source_layer_id")
    cand = -1 if cand is None else cand
    if not is_int(cand) or cand < -1:
        raise field_error("candidate_source_layer_id", cand, "must be an int layer id, or -1 for none")
    topk = hf.get("candidate_topk_blocks")
    topk = 0 if topk is None else topk
    if not is_int(topk) or topk < 0:
        raise field_error("candidate_topk_blocks", topk, "must be an int >= 0")
    if cand >= 0:
        if cand >= n:
            raise field_error("candidate_source_layer_id", cand, f"is out of range [0, {n}) (num_hidden_layers={n})")
        if index is None or cand not in index:
            raise field_error("candidate_source_layer_id", cand,
                              "is not an index source "
                              f"(index_source_layer_ids={None if index is None else list(index)})")

    edges: list[SharingEdge] = []
    if kv is not None:
        edges += _nearest_edges("kv", kv, n, ratios)
    if index is not None:
        edges += _nearest_edges("index", index, n, ratios)
        if kv is not None:
            kv_set = set(kv)
            for i in index:
                if i not in kv_set:
                    owner = max(s for s in kv if s < i)  # exists: the kv pass gave layer i a source
                    edges.append(SharingEdge("index_k", owner, i))
        if cand >= 0 and topk > 0:
            edges += [SharingEdge("candidate", cand, i) for i in index if i > cand]
    edges.sort(key=SharingEdge.sort_key)
    return SharingGraph(num_layers=n, compress_ratios=ratios, kv_sources=kv, index_sources=index,
                        candidate_source=cand, candidate_topk_blocks=topk, engram_layers=_engram_layers(hf, n),
                        edges=tuple(edges))
