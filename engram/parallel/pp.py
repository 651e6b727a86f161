"""Pipeline-parallel planner: split a decoder's layers into PP stages without cutting a sharing edge.
``plan_pipeline(config, pp)`` is a pure function of its inputs, so every rank computes the same plan: among cuts no
``pp_graph.sharing_graph`` edge crosses, the pp-1 minimising the largest stage cost (ties: smallest sum of squares, then
earliest). An explicit partition (argument, else ``ENGRAM_PP_LAYER_PARTITION``) is used as given or refused with
NotImplementedError naming the crossing edges and a suggestion."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import zip_longest

import torch

from engram import envs
from engram.config import hf_text_config
from engram.model.deepseek_v4.cache_layout import CacheLayout, cache_layout
from engram.model.deepseek_v4.config import ARCHITECTURES as V4_ARCHITECTURES, V4Config
from engram.model.presets import MODEL_PRESETS, preset_config
from engram.parallel.pp_graph import SharingEdge, SharingGraph, sharing_graph

PARTITION_ENV = "ENGRAM_PP_LAYER_PARTITION"
ENGRAM_EXTRA_COST = 0.5  # default extra cost of an Engram layer over a plain decoder layer (1.0): wkv + gate
MAX_LISTED_EDGES = 4  # crossing edges named in a rejected-cut message


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous range of decoder layers."""

    index: int  # stage number, 0 = first
    start: int  # first layer (inclusive)
    end: int  # one past the last layer
    cost: float  # sum of the layers' costs

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class PipelinePlan:
    """The chosen split; identical on every rank for the same inputs."""

    graph: SharingGraph  # the validated sharing graph the plan respects
    pp: int  # number of stages
    partition: tuple[int, ...]  # layers per stage, sums to graph.num_layers
    stages: tuple[Stage, ...]  # one per stage, in order
    legal_cut_points: tuple[int, ...]  # positions p (cut before layer p) crossed by no edge
    origin: str  # where the partition came from: "planner", "partition" (the argument) or PARTITION_ENV
    v4: V4Config | None = None  # a DeepSeek-V4 config the runtime serves: its stages allocate cache groups

    @property
    def max_stage_cost(self) -> float:
        return max(s.cost for s in self.stages)

    def stage_of(self, layer: int) -> int:
        for s in self.stages:
            if s.start <= layer < s.end:
                return s.index
        raise ValueError(f"layer {layer} is out of range [0, {self.graph.num_layers})")


@dataclass(frozen=True)
class StageAllocation:
    """What one stage must allocate: only its own layers' caches and buffers."""

    stage: int  # stage number
    layers: tuple[int, ...]  # decoder layers this stage runs
    window_cache_layers: tuple[int, ...]  # V4.1: every local layer keeps its own sliding-window cache
    kv_cache_layers: tuple[int, ...]  # local layers owning a (compressed, in V4.1) KV cache: not kv consumers
    kv_source: dict[int, int]  # local layer -> layer whose KV it reads (itself when it owns one)
    index_cache_layers: tuple[int, ...]  # local compressed layers owning an indexer cache: not index consumers
    candidate_buffer_layers: tuple[int, ...]  # the candidate source, when local and candidates are shared
    engram_layers: tuple[int, ...]  # local Engram layers: one row staging buffer each
    needs_token_ids: bool  # the stage needs the step's token ids and lookbacks (it holds an Engram layer)
    # DeepSeek-V4: the cache groups of exactly the local layers (model/deepseek_v4/cache_layout.py, what the
    # engine's block manager and the Worker's pool use), pages of cache_layout.page_bytes; None for other models
    cache_layout: CacheLayout | None = None


# ------------------------------------------------------------------------------------------ costs
def layer_costs(graph: SharingGraph, costs: Sequence[float] | None = None,
                engram_cost: float = ENGRAM_EXTRA_COST) -> list[float]:
    """Per-layer costs: the given ones (validated), else 1.0 per layer plus ``engram_cost`` per Engram layer."""
    n = graph.num_layers
    if costs is None:
        if not (math.isfinite(engram_cost) and engram_cost >= 0):
            raise ValueError(f"engram_cost={engram_cost!r}: must be a finite number >= 0")
        engram = set(graph.engram_layers)
        return [1.0 + (engram_cost if i in engram else 0.0) for i in range(n)]
    costs = [float(c) for c in costs]
    if len(costs) != n:
        raise ValueError(f"layer_costs has {len(costs)} values but num_hidden_layers={n}")
    for i, c in enumerate(costs):
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"layer_costs[{i}]={c!r}: must be a finite number > 0")
    return costs


def _prefix(costs: Sequence[float]) -> list[float]:
    out = [0.0]
    for c in costs:
        out.append(out[-1] + c)
    return out


def _stages(partition: Sequence[int], prefix: Sequence[float]) -> tuple[Stage, ...]:
    stages, start = [], 0
    for i, size in enumerate(partition):
        stages.append(Stage(i, start, start + size, prefix[start + size] - prefix[start]))
        start += size
    return tuple(stages)


# ---------------------------------------------------------------------------------------- planner
def best_partition(graph: SharingGraph, pp: int, costs: Sequence[float]) -> tuple[int, ...] | None:
    """The partition over legal cuts minimising the largest stage cost (ties: sum of squares, then earliest); None when
    there are fewer than pp-1 legal cuts."""
    n = graph.num_layers
    points = [0, *graph.legal_cut_points(), n]  # candidate stage boundaries
    if pp < 1 or pp - 1 > len(points) - 2:
        return None
    prefix = _prefix(costs)
    m = len(points)

    def cost(i: int, j: int) -> float:  # stage from boundary i to boundary j
        return prefix[points[j]] - prefix[points[i]]

    inf = math.inf
    # best[k][j]: smallest largest-stage cost splitting layers [0, points[j]) into k stages
    best = [[inf] * m for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for j in range(k, m):
            best[k][j] = min((max(best[k - 1][i], cost(i, j)) for i in range(k - 1, j)), default=inf)
    bound = best[pp][m - 1]
    # tail[k][i]: smallest sum of squares splitting [points[i], n) into k stages, each <= bound
    tail = [[inf] * m for _ in range(pp + 1)]
    tail[0][m - 1] = 0.0
    for k in range(1, pp + 1):
        for i in range(m - 1):
            tail[k][i] = min((cost(i, j) ** 2 + tail[k - 1][j] for j in range(i + 1, m)
                              if cost(i, j) <= bound), default=inf)
    cuts, i = [], 0
    for k in range(pp, 0, -1):  # earliest next boundary that keeps the optimum
        j = next(j for j in range(i + 1, m) if cost(i, j) <= bound and cost(i, j) ** 2 + tail[k - 1][j] == tail[k][i])
        cuts.append(points[j])
        i = j
    return tuple(b - a for a, b in zip([0, *cuts[:-1]], cuts))


def parse_partition(text: str, origin: str = "partition") -> tuple[int, ...]:
    """``"8,6,6,20"`` -> (8, 6, 6, 20); ValueError naming ``origin`` on anything else."""
    parts = [p.strip() for p in text.split(",")]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{origin}={text!r}: expected comma-separated layer counts such as 8,6,6,20") from None


def _format_edge(e: SharingEdge, stage_of: Sequence[int]) -> str:
    return (f"{e.kind} source layer {e.source} (stage {stage_of[e.source]}) -> layer {e.consumer} "
            f"(stage {stage_of[e.consumer]})")


def crossing_edges(graph: SharingGraph, partition: Sequence[int]) -> list[SharingEdge]:
    """Edges whose source and consumer land on different stages, sorted by (source, consumer, kind)."""
    cuts, acc = set(), 0
    for size in partition[:-1]:
        acc += size
        cuts.add(acc)
    return [e for e in graph.edges if any(e.crosses(p) for p in cuts)]


def check_partition(graph: SharingGraph, pp: int, partition: Sequence[int], origin: str = "partition",
                    costs: Sequence[float] | None = None) -> None:
    """ValueError when the partition is malformed (count != pp, sum != layers, empty stage); NotImplementedError listing
    up to four crossing edges and a suggested partition when it cuts one."""
    part = list(partition)
    n = graph.num_layers
    if len(part) != pp:
        raise ValueError(f"{origin}={part}: has {len(part)} stages but pp={pp}")
    if any(x < 1 for x in part):
        raise ValueError(f"{origin}={part}: every stage needs at least 1 layer")
    if sum(part) != n:
        raise ValueError(f"{origin}={part}: stage ranges cover {sum(part)} layers but num_hidden_layers={n}")
    crossing = crossing_edges(graph, part)
    if not crossing:
        return
    stage_of = [s for s, size in enumerate(part) for _ in range(size)]
    # One edge per stage pair in turn, so that every offending cut is named before a second edge of one.
    groups: dict[tuple[int, int], list[SharingEdge]] = {}
    for e in crossing:
        groups.setdefault((stage_of[e.source], stage_of[e.consumer]), []).append(e)
    order = [e for row in zip_longest(*(groups[k] for k in sorted(groups))) for e in row if e is not None]
    where = f" (from {origin})" if origin != "partition" else ""
    lines = [f"pipeline partition {','.join(map(str, part))}{where} separates layers that share state; "
             f"{len(crossing)} sharing edge(s) cross a stage boundary:"]
    lines += [f"  {_format_edge(e, stage_of)}" for e in order[:MAX_LISTED_EDGES]]
    if len(order) > MAX_LISTED_EDGES:
        lines.append(f"  ... and {len(order) - MAX_LISTED_EDGES} more")
    lines.append(_suggestion(graph, pp, layer_costs(graph, costs)))
    raise NotImplementedError("\n".join(lines))


def _suggestion(graph: SharingGraph, pp: int, costs: Sequence[float]) -> str:
    best = best_partition(graph, pp, costs)
    if best is not None:
        return f"suggested partition: {','.join(map(str, best))}"
    fewer = len(graph.legal_cut_points()) + 1
    best = best_partition(graph, fewer, costs)
    return f"suggested partition: {','.join(map(str, best))} (pp={fewer}, the most stages the legal cuts allow)"


def plan_pipeline(config: str | os.PathLike | dict | SharingGraph, pp: int,
                  partition: Sequence[int] | str | None = None, costs: Sequence[float] | None = None,
                  engram_cost: float = ENGRAM_EXTRA_COST, env: Mapping[str, str] | None = None) -> PipelinePlan:
    """Plan ``pp`` stages for a config (path, dict or SharingGraph). ``partition`` (a sequence or "a,b,...") wins over
    ``ENGRAM_PP_LAYER_PARTITION`` in ``env``; without either the planner chooses. Config errors and malformed partitions
    raise ValueError; a cut sharing edge or too few legal cuts, NotImplementedError."""
    graph = config if isinstance(config, SharingGraph) else sharing_graph(config)
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pp={pp!r}: must be an int >= 1")
    if pp > graph.num_layers:
        raise ValueError(f"pp={pp}: more stages than num_hidden_layers={graph.num_layers}")
    per_layer = layer_costs(graph, costs, engram_cost)
    raw = (envs.pp_layer_partition() if env is None else env.get(PARTITION_ENV)) or ""
    origin = "planner"
    if partition is None and raw.strip():
        partition, origin = parse_partition(raw, PARTITION_ENV), PARTITION_ENV
    elif isinstance(partition, str):
        partition, origin = parse_partition(partition), "partition"
    elif partition is not None:
        partition, origin = tuple(int(x) for x in partition), "partition"
    legal = tuple(graph.legal_cut_points())
    if partition is None:
        partition = best_partition(graph, pp, per_layer)
        if partition is None:
            raise NotImplementedError(
                f"pp={pp} needs {pp - 1} cut points but only {len(legal)} position(s) are crossed by no sharing "
                f"edge: {list(legal)}\n{_suggestion(graph, pp, per_layer)}")
    else:
        check_partition(graph, pp, partition, origin, per_layer)
    return PipelinePlan(graph=graph, pp=pp, partition=tuple(partition),
                        stages=_stages(partition, _prefix(per_layer)), legal_cut_points=legal, origin=origin,
                        v4=None if isinstance(config, SharingGraph) else served_v4(config))


def served_v4(config: str | os.PathLike | dict) -> V4Config | None:
    """The config as a DeepSeek-V4 model the runtime serves, or None: another model type, or deepseek_v41 with V4.1's
    own attention (which V4Config refuses, so no stage of it allocates cache groups here). A bad deepseek_v4 config
    raises its ValueError."""
    hf = hf_text_config(config)
    if hf.get("model_type") not in V4_ARCHITECTURES:
        return None
    try:
        return V4Config.from_hf_dict(hf)
    except ValueError:
        if hf["model_type"] == "deepseek_v4":
            raise
        return None


# ------------------------------------------------------------------------------------- allocation
def local_allocation(plan: PipelinePlan, stage: int, block_size: int = 16,
                     cache_dtype: torch.dtype = torch.bfloat16) -> StageAllocation:
    """Caches and buffers stage ``stage`` allocates: its own layers' only (a valid plan keeps sources by consumers).
    ``block_size`` / ``cache_dtype``: the engine's, for a DeepSeek-V4 stage's cache-group pages."""
    if not 0 <= stage < plan.pp:
        raise ValueError(f"stage={stage}: out of range [0, {plan.pp}) for pp={plan.pp}")
    g = plan.graph
    layers = tuple(plan.stages[stage].layers)
    kv_readers, index_readers = g.consumers("kv"), g.consumers("index")
    has_index = g.v41 or g.index_sources is not None
    cand_shared = any(e.kind == "candidate" for e in g.edges)
    for e in g.edges:
        if e.consumer in layers and e.source not in layers:
            raise NotImplementedError(f"stage {stage}: {e.kind} source layer {e.source} (stage "
                                      f"{plan.stage_of(e.source)}) -> layer {e.consumer} (stage {stage})")
    kv_source = {layer: g.kv_source_of(layer) for layer in layers}
    return StageAllocation(
        stage=stage,
        layers=layers,
        window_cache_layers=layers if g.v41 else (),
        kv_cache_layers=tuple(x for x in layers if g.is_compressed(x) and x not in kv_readers),
        kv_source={x: s for x, s in kv_source.items() if g.is_compressed(x)},
        index_cache_layers=tuple(x for x in layers if has_index and g.is_compressed(x) and x not in index_readers),
        candidate_buffer_layers=(g.candidate_source,) if cand_shared and g.candidate_source in layers else (),
        engram_layers=tuple(x for x in g.engram_layers if x in layers),
        needs_token_ids=any(x in layers for x in g.engram_layers),
        cache_layout=None if plan.v4 is None else cache_layout(plan.v4, cache_dtype, block_size, layers),
    )


def model_plan(model: str, pp: int, partition: Sequence[int] | str | None = None,
               table_rows: int | None = None, env: Mapping[str, str] | None = None) -> PipelinePlan:
    """The plan of a model the runtime loads, from its config alone (nothing is built or read but config.json): a
    preset name (``engram.model.presets``) or a checkpoint directory; ``partition`` / ``env`` as for
    ``plan_pipeline``. What every rank of a pipeline computes before it loads its layers."""
    config = preset_config(model, table_rows=table_rows).to_hf_dict() if model in MODEL_PRESETS else model
    return plan_pipeline(config, pp, partition=partition, env=env)
