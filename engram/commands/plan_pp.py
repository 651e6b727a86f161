"""`engram plan-pp CONFIG --pp N [--partition a,b,...] [--json]`: check or plan a pipeline-parallel split.

CONFIG is a config.json, a directory holding one, or any config name another command takes (engram/commands/config_names.py:
the shipped deepseek-v4.1-flash and paper-demo layouts, the model presets tiny, small, 4b-like, 8b-like).

Prints the config's sharing edges by kind, the Engram input dependencies, the legal cut points and the
chosen partition with each stage's local caches (exit 0), or the error (exit 2). The partition comes from
--partition, else ENGRAM_PP_LAYER_PARTITION, else the planner.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "check a pipeline-parallel partition against the config's cross-layer sharing, or plan one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="config.json, a directory holding one, or a config name: deepseek-v4.1-flash, "
                                       "paper-demo, tiny, small, 4b-like, 8b-like")
    parser.add_argument("--pp", type=int, required=True, help="number of pipeline stages")
    parser.add_argument("--partition", default=None,
                        help="layers per stage, e.g. 8,6,6,20 (default: $ENGRAM_PP_LAYER_PARTITION, else planned)")
    parser.add_argument("--engram-cost", type=float, default=None,
                        help="extra planning cost of an Engram layer over a plain layer (1.0); default 0.5")
    parser.add_argument("--layer-costs", default=None,
                        help="comma-separated planning cost of every layer (overrides --engram-cost)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _ranges(xs: list[int]) -> str:
    """[3, 4, 5, 7] -> "3-5, 7"."""
    out: list[str] = []
    for x in xs:
        if out and x == last + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
        last = x
    return ", ".join(out)


def _groups_dict(layout: Any) -> dict[str, Any]:
    """A DeepSeek-V4 stage's cache groups (pages of ``page_bytes`` at block_size 16, bf16)."""
    return {"page_bytes": layout.page_bytes,
            "groups": {g.name: {"layers": list(g.layers), "rows_per_page": g.rows_per_page,
                                "pages_per_sequence": g.pages_per_sequence} for g in layout.groups}}


def _plan_dict(plan: Any, allocations: list[Any]) -> dict[str, Any]:
    g = plan.graph
    return {
        "num_hidden_layers": g.num_layers,
        "pp": plan.pp,
        "edges": {kind: [[e.source, e.consumer] for e in edges] for kind, edges in g.edges_by_kind().items()},
        "inputs": {"token_ids_and_lookbacks": list(g.engram_layers)},  # Engram layers: never block a cut
        "legal_cut_points": list(plan.legal_cut_points),
        "partition": list(plan.partition),
        "partition_origin": plan.origin,
        "max_stage_cost": plan.max_stage_cost,
        "stages": [
            {"stage": s.index, "layers": [s.start, s.end], "cost": s.cost,
             "window_cache_layers": list(a.window_cache_layers), "kv_cache_layers": list(a.kv_cache_layers),
             "index_cache_layers": list(a.index_cache_layers),
             "candidate_buffer_layers": list(a.candidate_buffer_layers),
             "engram_layers": list(a.engram_layers), "needs_token_ids": a.needs_token_ids,
             **({} if a.cache_layout is None else {"cache_groups": _groups_dict(a.cache_layout)})}
            for s, a in zip(plan.stages, allocations)
        ],
    }


def _print_plan(plan: Any, allocations: list[Any]) -> None:
    g = plan.graph
    print(f"layers: {g.num_layers}  pp: {plan.pp}")
    print("sharing edges (source -> consumers):")
    for kind, edges in g.edges_by_kind().items():
        by_source: dict[int, list[int]] = {}
        for e in edges:
            by_source.setdefault(e.source, []).append(e.consumer)
        text = "; ".join(f"{s} -> {_ranges(c)}" for s, c in by_source.items()) or "none"
        print(f"  {kind:<9} {text}")
    if g.engram_layers:
        print(f"inputs: Engram layers {_ranges(list(g.engram_layers))} need the step's token ids and lookbacks")
    print(f"legal cut points: {_ranges(list(plan.legal_cut_points)) or 'none'}")
    print(f"partition: {','.join(map(str, plan.partition))} "
          f"({plan.origin}; largest stage cost {plan.max_stage_cost:g})")
    for s, a in zip(plan.stages, allocations):
        parts = [f"kv caches {_ranges(list(a.kv_cache_layers)) or '-'}"]
        if a.index_cache_layers:
            parts.append(f"index caches {_ranges(list(a.index_cache_layers))}")
        if a.candidate_buffer_layers:
            parts.append(f"candidate buffer {a.candidate_buffer_layers[0]}")
        if a.engram_layers:
            parts.append(f"engram {_ranges(list(a.engram_layers))} (needs token ids)")
        if a.cache_layout is not None:
            groups = ", ".join(f"{g.name} {_ranges(list(g.layers))}" for g in a.cache_layout.groups)
            parts.append(f"cache groups {groups} (pages of {a.cache_layout.page_bytes:,} B)")
        print(f"  stage {s.index}: layers {s.start}-{s.end - 1} (cost {s.cost:g}); " + "; ".join(parts))


def run(args: argparse.Namespace) -> int:
    import sys

    from engram.commands.config_names import resolve_config
    from engram.parallel.pp import ENGRAM_EXTRA_COST, local_allocation, plan_pipeline

    try:
        config = resolve_config(args.config, "CONFIG")
        costs = None
        if args.layer_costs is not None:
            try:
                costs = [float(c) for c in args.layer_costs.split(",")]
            except ValueError:
                raise ValueError(f"--layer-costs={args.layer_costs!r}: expected comma-separated numbers") from None
        engram_cost = ENGRAM_EXTRA_COST if args.engram_cost is None else args.engram_cost
        plan = plan_pipeline(config, args.pp, partition=args.partition, costs=costs, engram_cost=engram_cost)
        allocations = [local_allocation(plan, s) for s in range(plan.pp)]
    except (ValueError, NotImplementedError, OSError) as e:
        if args.json:
            print(json.dumps({"error": str(e), "error_type": type(e).__name__}, indent=2))
        else:
            print(f"engram plan-pp: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_plan_dict(plan, allocations), indent=2))
    else:
        _print_plan(plan, allocations)
    return 0
